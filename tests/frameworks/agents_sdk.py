"""The OpenAI Agents SDK against a kvscope server, as its docs point it at another OpenAI-compatible one:
the default client replaced, the default (Responses) model, a @function_tool, forced on the first turn
with ModelSettings(tool_choice=...), Runner.run and Runner.run_streamed, and an output_type. Prints one
JSON line of what the application got; tests/test_agent_frameworks.py checks it.
Run: python agents_sdk.py BASE_URL MODEL (in a virtual environment with openai-agents)."""

import asyncio
import json
import sys

from agents import (Agent, ModelSettings, Runner, function_tool, set_default_openai_api, set_default_openai_client,
                    set_tracing_disabled)
from openai import AsyncOpenAI
from weather import Weather, called, report

BASE_URL, MODEL = sys.argv[1:3]


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return report(city)


async def main() -> None:
    set_tracing_disabled(True)  # no traces sent to OpenAI's servers
    set_default_openai_client(AsyncOpenAI(base_url=BASE_URL, api_key="x", timeout=300, max_retries=0))
    set_default_openai_api("responses")  # the SDK's default, said out loud
    settings = ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=60)
    agent = Agent(name="weather", instructions="You answer questions about the weather.", model=MODEL,
                  tools=[get_weather], model_settings=settings)
    ran = await Runner.run(agent, "What is the weather in Paris?", max_turns=3)
    streamed = Runner.run_streamed(agent, "What is the weather in Rome?", max_turns=3)
    kinds = [event.type async for event in streamed.stream_events()]
    structured = Agent(name="reader", instructions="Read the weather report.", model=MODEL, output_type=Weather,
                       model_settings=ModelSettings(temperature=0, max_tokens=60))
    parsed = await Runner.run(structured, "Weather in Paris: 21 degrees Celsius.")
    print(json.dumps({"called": called, "run": {"output": ran.final_output,
                                                "items": [item.type for item in ran.new_items]},
                      "streamed": {"output": streamed.final_output, "events": sorted(set(kinds)),
                                   "items": [item.type for item in streamed.new_items]},
                      "output_type": parsed.final_output.model_dump()}))


asyncio.run(main())
