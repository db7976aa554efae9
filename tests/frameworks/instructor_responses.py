"""instructor's RESPONSES_TOOLS mode against a kvscope server: a pydantic model filled through a forced function
call on the Responses API, whole and as a streamed Partial. Prints one JSON line; tests/test_agent_frameworks.py
checks it. Run: python instructor_responses.py BASE_URL MODEL (in a virtual environment with instructor)."""

import json
import sys

import instructor
from openai import OpenAI
from weather import Weather

BASE_URL, MODEL = sys.argv[1:3]

client = instructor.from_openai(OpenAI(base_url=BASE_URL, api_key="x", timeout=300, max_retries=0),
                                mode=instructor.Mode.RESPONSES_TOOLS)
ask = dict(model=MODEL, input="Weather in Paris: 21 degrees Celsius.", response_model=Weather, temperature=0,
           max_output_tokens=60, max_retries=0)
whole = client.responses.create(**ask)
partials = list(client.responses.create_partial(**ask))
print(json.dumps({"whole": whole.model_dump(), "partials": [p.model_dump() for p in partials]}))
