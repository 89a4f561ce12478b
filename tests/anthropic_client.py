"""Drives a running `kestrel serve` with the official `anthropic` Python client.

Usage: python3 tests/anthropic_client.py BASE_URL MODEL_ID

The server is expected to run the scripted engine of tests/server.rs that always writes a
short reasoning block and then one get_weather tool call (so thinking blocks and the
tool-call parsing are exercised end to end). Exits non-zero on the first failed check.
"""

import sys

import anthropic
from anthropic import Anthropic

base, model = sys.argv[1], sys.argv[2]
client = Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=60)

TOOLS = [{
    "name": "get_weather",
    "description": "Weather forecast for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}]
THINK = {"type": "enabled", "budget_tokens": 100}
HI = [{"role": "user", "content": "Hi"}]

# models
ids = [m.id for m in client.models.list().data]
assert ids == [model], ids

# non-streaming with thinking: a thinking block, then the call's text as text (no tools given)
r = client.messages.create(model=model, max_tokens=200, messages=HI, thinking=THINK,
                           system="Be brief.", metadata={"user_id": "tester"})
assert r.type == "message" and r.role == "assistant" and r.model == model, r
assert [b.type for b in r.content] == ["thinking", "text"], r.content
assert r.content[0].thinking.strip() == "Checking the weather.", r.content[0]
assert "<tool_call>" in r.content[1].text, r.content[1]
assert r.stop_reason == "end_turn" and r.stop_sequence is None, r
assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) > 0, r.usage
assert r.usage.output_tokens > 0, r.usage

# count_tokens: the same prompt
n = client.messages.count_tokens(model=model, messages=HI, thinking=THINK, system="Be brief.")
assert n.input_tokens == r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0), (n, r.usage)

# thinking disabled: no thinking block
r_off = client.messages.create(model=model, max_tokens=200, messages=HI,
                               thinking={"type": "disabled"},
                               extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 10})
assert all(b.type == "text" for b in r_off.content), r_off.content

# streaming with the SDK's helper: the same message, and the raw events in Anthropic's order
with client.messages.stream(model=model, max_tokens=200, messages=HI, thinking=THINK,
                            system="Be brief.") as stream:
    kinds = [event.type for event in stream]
    final = stream.get_final_message()
assert [b.model_dump() for b in final.content] == [b.model_dump() for b in r.content], final.content
assert final.stop_reason == "end_turn" and final.usage.output_tokens == r.usage.output_tokens, final
assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
assert "thinking" in kinds and "text" in kinds, kinds

raw = client.messages.create(model=model, max_tokens=200, messages=HI, thinking=THINK, stream=True)
order = []
for event in raw:
    name = event.type
    if name == "content_block_start":
        name += ":" + event.content_block.type
    elif name == "content_block_delta":
        name += ":" + event.delta.type
    if not order or order[-1] != name:
        order.append(name)
assert order == [
    "message_start",
    "content_block_start:thinking", "content_block_delta:thinking_delta", "content_block_stop",
    "content_block_start:text", "content_block_delta:text_delta", "content_block_stop",
    "message_delta", "message_stop",
], order

# tool use round trip
messages = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
r = client.messages.create(model=model, max_tokens=200, messages=messages, tools=TOOLS)
assert r.stop_reason == "tool_use", r
calls = [b for b in r.content if b.type == "tool_use"]
assert len(calls) == 1 and calls[0].name == "get_weather", r.content
assert calls[0].input == {"city": "Paris", "days": 3}, calls[0].input
assert calls[0].id.startswith("toolu_"), calls[0].id
messages.append({"role": "assistant", "content": r.content})
messages.append({"role": "user", "content": [
    {"type": "tool_result", "tool_use_id": calls[0].id, "content": "sunny, 24 C"}]})
r2 = client.messages.create(model=model, max_tokens=200, messages=messages, tools=TOOLS)
assert r2.stop_reason == "tool_use", r2
# the second turn resumed from the first turn's cached prefix
assert (r2.usage.cache_read_input_tokens or 0) > 0, r2.usage

# streamed tool use, with thinking
with client.messages.stream(model=model, max_tokens=200, messages=messages, tools=TOOLS,
                            thinking=THINK) as stream:
    final = stream.get_final_message()
assert [b.type for b in final.content] == ["thinking", "tool_use"], final.content
assert final.content[1].input == {"city": "Paris", "days": 3}, final.content[1]
assert final.stop_reason == "tool_use", final

# forced tool choice with thinking is refused, as Anthropic refuses it
try:
    client.messages.create(model=model, max_tokens=200, messages=HI, tools=TOOLS, thinking=THINK,
                           tool_choice={"type": "any"})
    raise AssertionError("forced tool use with thinking accepted")
except anthropic.BadRequestError as e:
    assert e.body["error"]["type"] == "invalid_request_error", e.body

# errors surface as the client's exception types
try:
    client.messages.create(model="claude-nope", max_tokens=10, messages=HI)
    raise AssertionError("unknown model accepted")
except anthropic.NotFoundError as e:
    assert e.body["type"] == "error" and e.body["error"]["type"] == "not_found_error", e.body
try:
    # this SDK no longer has the sampling keywords; they go as extra body fields
    client.messages.create(model=model, max_tokens=10, messages=HI, extra_body={"temperature": 5})
    raise AssertionError("temperature 5 accepted")
except anthropic.BadRequestError as e:
    assert e.body["error"]["type"] == "invalid_request_error", e.body

print("anthropic client: all checks passed")
