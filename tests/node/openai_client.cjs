// The official openai npm client against a kvscope server, as an application uses it: parse() with a zod
// schema, a forced tool call streamed (the SDK's stream helper puts the deltas together), a plain
// streamed answer, and the Responses API's round trip: responses.create with a function tool, its
// function_call answered by a function_call_output, then the final answer. Prints one JSON line of what
// the application got; tests/test_clients.py checks it.
// Run: NODE_PATH=<folder with openai and zod> node openai_client.cjs BASE_URL MODEL
const OpenAI = require("openai");
const { zodResponseFormat } = require("openai/helpers/zod");
const { z } = require("zod");

const WEATHER_TOOL = {
  type: "function",
  function: {
    name: "get_weather",
    description: "The weather in a city.",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
};

async function main() {
  const [baseURL, model] = process.argv.slice(2);
  const client = new OpenAI({ baseURL, apiKey: "x", timeout: 300_000, maxRetries: 0 });
  const ask = (content) => ({ model, temperature: 0, max_tokens: 40, messages: [{ role: "user", content }] });

  const Weather = z.object({ city: z.string(), celsius: z.number().int() });
  const parsed = await client.chat.completions.parse({
    ...ask("The weather in Paris as JSON."), response_format: zodResponseFormat(Weather, "weather"),
  });

  const stream = client.chat.completions.stream({
    ...ask("What is the weather in Rome?"), tools: [WEATHER_TOOL], tool_choice: "required",
  });
  const called = await stream.finalChatCompletion();

  let plain = "";
  for await (const chunk of await client.chat.completions.create({ ...ask("Say hello."), stream: true })) {
    plain += chunk.choices[0]?.delta?.content ?? "";
  }

  const { name, description, parameters } = WEATHER_TOOL.function;
  const responsesTool = { type: "function", name, description, parameters, strict: false };
  const input = [{ role: "user", content: "What is the weather in Rome?" }];
  const first = await client.responses.create({
    model, input, tools: [responsesTool], tool_choice: "required", temperature: 0, max_output_tokens: 40,
  });
  const fc = first.output.find((item) => item.type === "function_call");
  const second = await client.responses.create({
    model, tools: [responsesTool], temperature: 0, max_output_tokens: 40,
    input: [...input, fc, { type: "function_call_output", call_id: fc.call_id, output: "Sunny, 24 degrees Celsius." }],
  });
  console.log(JSON.stringify({
    parsed: parsed.choices[0].message.parsed,
    call: called.choices[0].message.tool_calls[0],
    finish_reason: called.choices[0].finish_reason,
    plain,
    responses_call: fc,
    responses_answer: second.output_text,
  }));
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
