"""Drives a running `kestrel serve` with the official `openai` Python client.

Usage: python3 tests/openai_client.py BASE_URL MODEL_ID

The server is expected to run the scripted engine of tests/server.rs that always writes a
short reasoning block and then one get_weather tool call (so the tool-call parsing is
exercised end to end). Exits non-zero on the first failed check.
"""

import json
import sys

import openai
from openai import OpenAI

base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}]

# models
ids = [m.id for m in client.models.list().data]
assert ids == [model], ids
assert client.models.retrieve(model).id == model
try:
    client.models.retrieve("not-this-model")
    raise AssertionError("retrieving another model should fail")
except openai.NotFoundError:
    pass

# plain chat: reasoning separated, the call's text left as content (no tools given)
r = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=100, seed=1
)
msg = r.choices[0].message
assert msg.role == "assistant"
assert (msg.model_extra or {}).get("reasoning_content", "").strip() == "Checking the weather.", msg
assert "<tool_call>" in (msg.content or ""), msg
assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, r.usage

# streaming chat with usage
chunks = list(client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=100,
    stream=True, stream_options={"include_usage": True},
))
content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
assert content == msg.content, (content, msg.content)
assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
assert finishes == ["stop"], finishes

# tool call round trip
messages = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=200)
choice = r.choices[0]
assert choice.finish_reason == "tool_calls", choice
call = choice.message.tool_calls[0]
assert call.type == "function" and call.function.name == "get_weather", call
assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}, call.function.arguments
messages.append(choice.message.model_dump(exclude_none=True))
messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"})
r2 = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=200)
assert r2.choices[0].finish_reason == "tool_calls", r2
# the second turn resumed from the first turn's cached prefix
assert r2.usage.prompt_tokens_details.cached_tokens > 0, r2.usage

# streamed tool call
stream = client.chat.completions.create(
    model=model, messages=messages, tools=TOOLS, max_tokens=200, stream=True
)
calls = [tc for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
assert len(calls) == 1 and calls[0].function.name == "get_weather", calls
assert json.loads(calls[0].function.arguments)["city"] == "Paris"

# structured outputs: the SDK's parse() with a pydantic model. The scripted model writes its
# reasoning and then a tool call, never JSON: the grammar makes the answer the schema's.
from typing import Literal

from pydantic import BaseModel, Field


class Forecast(BaseModel):
    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7)


r = client.chat.completions.parse(
    model=model,
    messages=[{"role": "user", "content": "Weather in Paris?"}],
    response_format=Forecast,
    max_tokens=100,
)
msg = r.choices[0].message
assert r.choices[0].finish_reason == "stop", r
assert isinstance(msg.parsed, Forecast), msg
assert Forecast.model_validate_json(msg.content) == msg.parsed, msg.content
assert (msg.model_extra or {}).get("reasoning_content", "").strip() == "Checking the weather.", msg
# a schema the grammar engine cannot use is the client's BadRequestError
try:
    client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "x"}],
        response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strnig"}}},
    )
    raise AssertionError("a bad schema accepted")
except openai.BadRequestError as e:
    assert "strnig" in str(e), e

# errors surface as the client's exception types
try:
    client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    raise AssertionError("unknown model accepted")
except Exception as e:  # openai.NotFoundError
    assert type(e).__name__ == "NotFoundError", repr(e)
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=2)
    raise AssertionError("n=2 accepted")
except Exception as e:  # openai.BadRequestError
    assert type(e).__name__ == "BadRequestError", repr(e)

print("openai client: all checks passed")
