"""pydantic-ai's OpenAIResponsesModel against a kvscope server: a tool, its call forced on the first step only
as pydantic-ai documents varying tool_choice per step (a capability's get_model_settings returning a callable),
then the tool's result and the final answer; and a structured output through NativeOutput (text.format).
Prints one JSON line; tests/test_agent_frameworks.py checks it.
Run: python pydantic_ai_tool.py BASE_URL MODEL (in a virtual environment with pydantic-ai-slim)."""

import json
import sys
from dataclasses import dataclass

from pydantic_ai import Agent, NativeOutput
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.models.openai import OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider
from weather import Weather, called, report

BASE_URL, MODEL = sys.argv[1:3]


@dataclass
class CallTheToolFirst(AbstractCapability):
    def get_model_settings(self):
        return lambda ctx: {"tool_choice": ["get_weather"] if ctx.run_step <= 1 else "auto"}


model = OpenAIResponsesModel(MODEL, provider=OpenAIProvider(base_url=BASE_URL, api_key="x"))
agent = Agent(model, instructions="You answer questions about the weather.", capabilities=[CallTheToolFirst()],
              model_settings={"temperature": 0, "max_tokens": 60})


@agent.tool_plain
def get_weather(city: str) -> str:
    """The weather in a city."""
    return report(city)


result = agent.run_sync("What is the weather in Paris?")
reader = Agent(model, output_type=NativeOutput(Weather), model_settings={"temperature": 0, "max_tokens": 60})
native = reader.run_sync("Weather in Paris: 21 degrees Celsius.").output
print(json.dumps({"called": called, "output": result.output, "native": native.model_dump(),
                  "parts": [part.part_kind for message in result.all_messages() for part in message.parts]}))
