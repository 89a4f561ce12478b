#!/usr/bin/env python3
"""Write tests/fixtures/chat_template/cases.json: prompts rendered from
assets/qwen3_6/chat_template.jinja exactly as transformers'
`apply_chat_template(..., tokenize=False)` renders them.

Requirements: pip install jinja2 tokenizers
Optional:     pip install transformers   (no torch needed) - if importable, every
              case is also rendered with transformers' own
              `render_jinja_template` and must match byte for byte.

The rendering environment mirrors transformers (utils/chat_template_utils.py):
  * jinja2 ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
    extensions=[loopcontrols])
  * filter  tojson(x, ensure_ascii=False, indent=None, separators=None,
    sort_keys=False) = json.dumps(...) - so no HTML escaping, non-ASCII kept,
    default separators ", " and ": ", keys in insertion order
  * globals raise_exception(msg) (raises TemplateError), strftime_now(fmt),
    namespace
  * messages: keys whose value is None are dropped; a message carrying
    `reasoning_content`, `thinking` or `reasoning` gets both `thinking` and
    `reasoning_content` set to that value
  * render variables: messages, tools (None when absent), documents (None),
    add_generation_prompt, the tokenizer's special tokens (eos_token,
    pad_token), then the caller's extra kwargs (enable_thinking, ...)

Each case in cases.json: {"name", "messages", "tools", "add_generation_prompt",
"enable_thinking" (only when passed), "extra" (only when passed: other template
variables, i.e. chat_template_kwargs such as {"preserve_thinking": true}),
"expected"}.  errors.json holds inputs the template rejects, with
"expected_error" (the raise_exception message) instead of "expected".

The script also asserts that the thinking-off "Hello" prompt encodes to the
known Qwen3.5/3.6 ids with assets/qwen3_6/tokenizer.json.gz.
"""

from __future__ import annotations

import gzip
import json
import sys
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "assets" / "qwen3_6"
OUT = REPO / "tests" / "fixtures" / "chat_template" / "cases.json"
OUT_ERRORS = OUT.with_name("errors.json")

SPECIAL_TOKENS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
HELLO_THINKING_OFF_IDS = [248045, 846, 198, 9419, 248046, 198, 248045, 74455, 198,
                          248068, 271, 248069, 271]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the documentation. Returns at most `limit` hits.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 50},
                "filters": {
                    "type": "object",
                    "properties": {"lang": {"type": "string"}, "tags": {"type": "array",
                                                                        "items": {"type": "string"}}},
                },
            },
            "required": ["query"],
        },
    },
}


def case(name, messages, *, tools=None, add_generation_prompt=True, **kwargs):
    c = {"name": name, "messages": messages, "tools": tools,
         "add_generation_prompt": add_generation_prompt}
    c.update(kwargs)
    return c


CASES = [
    case("single_user_thinking_default", [{"role": "user", "content": "Hello"}]),
    case("single_user_thinking_on", [{"role": "user", "content": "Hello"}], enable_thinking=True),
    case("single_user_thinking_off", [{"role": "user", "content": "Hello"}], enable_thinking=False),
    case("system_and_user", [
        {"role": "system", "content": "You are a concise assistant.  "},
        {"role": "user", "content": "  What is 2+2?\n"},
    ]),
    case("multi_turn_history_drops_old_reasoning", [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "reasoning_content": "\nSmallest prime is 2.\n",
         "content": "2"},
        {"role": "user", "content": "And another one?"},
        {"role": "assistant", "content": "<think>\nNext prime after 2.\n</think>\n\n3"},
        {"role": "user", "content": "Thanks! One more?"},
    ], enable_thinking=True),
    case("multi_turn_final_assistant_keeps_reasoning", [
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "reasoning_content": "Smallest prime is 2.", "content": "2"},
        {"role": "user", "content": "And another one?"},
        {"role": "assistant", "reasoning_content": "Next prime after 2.", "content": "3"},
    ], add_generation_prompt=False),
    case("multi_turn_preserve_thinking", [
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "reasoning_content": "Smallest prime is 2.", "content": "2"},
        {"role": "user", "content": "And another one?"},
    ], extra={"preserve_thinking": True}),
    case("tool_calls_then_two_tool_results_then_user", [
        {"role": "user", "content": "What's the weather in Paris and in Tokyo?"},
        {"role": "assistant", "reasoning_content": "Two cities, two calls.", "content": "",
         "tool_calls": [
             {"type": "function", "function": {"name": "get_weather", "arguments": {
                 "city": "Paris", "unit": "celsius", "days": 3, "threshold": 21.5,
                 "detailed": True, "extra": None,
                 "location": {"lat": 48.8566, "lon": 2.3522, "country": "FR"},
                 "tags": ["now", "tomorrow"]}}},
             {"name": "get_weather", "arguments": {"city": "Tokyo"}},
         ]},
        {"role": "tool", "content": "{\"temp\": 18, \"sky\": \"cloudy\"}"},
        {"role": "tool", "content": "{\"temp\": 24, \"sky\": \"clear\"}"},
        {"role": "user", "content": "Which one is warmer?"},
    ], tools=[WEATHER_TOOL], enable_thinking=False),
    case("agentic_turn_keeps_reasoning_across_tool_steps", [
        {"role": "user", "content": "Find the docs for tokenizers."},
        {"role": "assistant", "reasoning_content": "Search first.",
         "content": "Let me search.",
         "tool_calls": [{"type": "function", "function": {
             "name": "search_docs",
             "arguments": {"query": "tokenizers", "limit": 5,
                           "filters": {"lang": "en", "tags": ["rust", "python"]}}}}]},
        {"role": "tool", "content": "1 hit: docs/tokenizers.md"},
        {"role": "assistant", "reasoning_content": "Got a hit.",
         "content": "See docs/tokenizers.md."},
    ], tools=[WEATHER_TOOL, SEARCH_TOOL], add_generation_prompt=False),
    case("tools_defined_thinking_on", [
        {"role": "system", "content": "You help with weather and docs."},
        {"role": "user", "content": "Is it raining in Berlin?"},
    ], tools=[WEATHER_TOOL, SEARCH_TOOL], enable_thinking=True),
    case("content_as_text_parts", [
        {"role": "system", "content": [{"type": "text", "text": "You read carefully."}]},
        {"role": "user", "content": [{"type": "text", "text": "Summarize: "},
                                     {"type": "text", "text": "the cat sat on the mat."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat sat on a mat."}]},
        {"role": "user", "content": [{"type": "text", "text": "Shorter?"}]},
    ], enable_thinking=False),
    case("content_parts_with_image", [
        {"role": "user", "content": [{"type": "image", "image": "file:///tmp/cat.png"},
                                     {"type": "text", "text": "What animal is this?"}]},
    ]),
    case("unicode_content", [
        {"role": "system", "content": "Réponds en français. 🙂"},
        {"role": "user", "content": "天气怎么样？ مرحبا 👨‍👩‍👧 «ok»"},
        {"role": "assistant", "content": "Il fait beau ☀️ — 晴天。",
         "tool_calls": [{"type": "function", "function": {
             "name": "get_weather", "arguments": {"city": "Zürich",
                                                  "note": {"label": "naïve café"}}}}]},
        {"role": "tool", "content": "ensoleillé, 25 °C"},
        {"role": "user", "content": "Merci ! ありがとう"},
    ], tools=[WEATHER_TOOL]),
    case("error_system_not_first", [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "late system"},
    ]),
    case("error_no_user_query", [
        {"role": "system", "content": "only a system message"},
    ]),
]


def make_env():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def prepare_messages(messages):
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning")
                          if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def extra_kwargs(c):
    kwargs = dict(c.get("extra", {}))
    if "enable_thinking" in c:
        kwargs["enable_thinking"] = c["enable_thinking"]
    return kwargs


def render_local(template, c):
    import jinja2

    compiled = make_env().from_string(template)
    try:
        return compiled.render(messages=prepare_messages(c["messages"]), tools=c["tools"],
                               documents=None, add_generation_prompt=c["add_generation_prompt"],
                               **{**SPECIAL_TOKENS, **extra_kwargs(c)}), None
    except jinja2.exceptions.TemplateError as e:
        return None, str(e)


def render_transformers(template, c):
    try:
        import jinja2
        from transformers.utils.chat_template_utils import (_normalize_chat_messages,
                                                            render_jinja_template)
    except ImportError:
        return "unavailable", None
    try:
        rendered, _ = render_jinja_template(
            conversations=[_normalize_chat_messages(c["messages"])], tools=c["tools"],
            chat_template=template, add_generation_prompt=c["add_generation_prompt"],
            **{**SPECIAL_TOKENS, **extra_kwargs(c)})
        return rendered[0], None
    except jinja2.exceptions.TemplateError as e:
        return None, str(e)


def main() -> None:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        sys.exit("missing dependency: pip install jinja2 tokenizers")

    template = (ASSETS / "chat_template.jinja").read_text(encoding="utf-8")
    config_template = json.loads((ASSETS / "tokenizer_config.json").read_text())["chat_template"]
    if config_template != template:
        sys.exit("tokenizer_config.json chat_template differs from chat_template.jinja; "
                 "rerun scripts/build_tokenizer.py")

    out, failures, checked_with_transformers = [], [], 0
    for c in CASES:
        text, err = render_local(template, c)
        t_text, t_err = render_transformers(template, c)
        if t_text != "unavailable":
            checked_with_transformers += 1
            if (t_text, t_err) != (text, err):
                failures.append(f"{c['name']}: transformers renders differently:\n"
                                f"{t_text!r} / {t_err!r}\nvs\n{text!r} / {err!r}")
        expect_error = c["name"].startswith("error_")
        if expect_error != (err is not None):
            failures.append(f"{c['name']}: unexpected {'success' if err is None else err}")
        entry = dict(c)
        if err is None:
            entry["expected"] = text
        else:
            entry["expected_error"] = err
        out.append(entry)

    tokenizer = Tokenizer.from_str(
        gzip.decompress((ASSETS / "tokenizer.json.gz").read_bytes()).decode("utf-8"))
    hello_off = next(e for e in out if e["name"] == "single_user_thinking_off")["expected"]
    ids = tokenizer.encode(hello_off, add_special_tokens=False).ids
    if ids != HELLO_THINKING_OFF_IDS:
        failures.append(f"thinking-off Hello prompt encodes to {ids}, "
                        f"expected {HELLO_THINKING_OFF_IDS}")

    if failures:
        print("\n\n".join(failures))
        sys.exit(f"{len(failures)} failures")

    ok = [e for e in out if "expected" in e]
    errors = [e for e in out if "expected_error" in e]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(ok, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    OUT_ERRORS.write_text(json.dumps(errors, indent=2, ensure_ascii=False) + "\n",
                          encoding="utf-8")
    how = (f"cross-checked with transformers on {checked_with_transformers}"
           if checked_with_transformers else "transformers not installed, not cross-checked")
    print(f"wrote {OUT.relative_to(REPO)} ({len(ok)} cases) and "
          f"{OUT_ERRORS.relative_to(REPO)} ({len(errors)} cases), {how}; "
          f"thinking-off Hello ids OK")


if __name__ == "__main__":
    main()
