#!/usr/bin/env python3
"""The structured-output mask's cost per token against a running `kestrel serve` (issue 41:
< 10% of a decode step), as PERFORMANCE.md table 16 measures it.

Batch 1: one streaming chat request at a time, thinking off, max_tokens 128, each kind
--rounds times (default 2), alternating: plain and json_schema (strict, an object of exactly 8
strings of 20-30 characters), each at temperature 0 and 1. The inter-token latency is the
mean gap between content chunks after the first. A constrained reply must parse as JSON with
the 8 keys: first one request a temperature with room to finish (--check-tokens, default
1024) must end by the grammar (finish "stop") and parse; the timed replies are judged only
where they finished (the synthetic weights' short tokens can run them to max_tokens, as
2026-12-07's did). Prints a row per request and the mean ITL of each kind with the constrained kinds'
excess over the same temperature unconstrained; --json writes the rows. The server's log has
the masks' compute and wait per reply ("structured output: N masks, ..." at RUST_LOG info).

Only the standard library: runs on the GPU machine as is.
    python3 scripts/struct_mask.py --url http://127.0.0.1:8126 --json out.json
"""
import argparse
import json
import urllib.request
import socket
import sys
import time
from urllib.parse import urlparse

KEYS = [f"field_{i}" for i in range(8)]
SCHEMA = {
    "type": "object",
    "properties": {k: {"type": "string", "minLength": 20, "maxLength": 30} for k in KEYS},
    "required": KEYS,
    "additionalProperties": False,
}


def one(host, port, model, schema, temperature, max_tokens, timeout):
    """One streaming request: (ttft_s, [gap_s], text, error, finish_reason)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Describe a kestrel as JSON."}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "seed": 1,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    if schema:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "kestrel", "strict": True, "schema": SCHEMA},
        }
    data = json.dumps(body).encode()
    t0 = time.perf_counter()
    s = socket.create_connection((host, port), timeout=timeout)
    s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
               "Connection: close\r\n\r\n").encode() + data)
    f = s.makefile("rb")
    status = f.readline().split()
    if len(status) < 2 or status[1] != b"200":
        return None, [], "", f"status {status!r}: {f.read()[-300:]!r}", None
    times, text, err, finish = [], [], None, None
    for line in f:
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        if line[6:] == b"[DONE]":
            break
        ev = json.loads(line[6:])
        if "error" in ev:
            err = str(ev["error"])
            break
        for c in ev.get("choices", []):
            finish = c.get("finish_reason") or finish
            piece = (c.get("delta") or {}).get("content")
            if piece:
                times.append(time.perf_counter())
                text.append(piece)
    s.close()
    if not times:
        return None, [], "", err or "no content", finish
    gaps = [b - a for a, b in zip(times, times[1:])]
    return times[0] - t0, gaps, "".join(text), err, finish


def parses(text):
    """Whether a constrained reply is the schema's object (the 8 keys)."""
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return isinstance(v, dict) and sorted(v) == sorted(KEYS)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8126")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--check-tokens", type=int, default=1024)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--json")
    args = ap.parse_args()
    u = urlparse(args.url)
    host, port = u.hostname, u.port or 80
    with urllib.request.urlopen(f"{args.url}/v1/models", timeout=args.timeout) as r:
        model = json.load(r)["data"][0]["id"]
    # warm-up: the first request of each kind compiles and fills caches
    for schema in (False, True):
        one(host, port, model, schema, 0.0, 16, args.timeout)
    # Every constrained reply given room to finish must end by the grammar (finish "stop") and
    # parse: the timed ones below stop at max_tokens where the synthetic weights' tokens are short.
    checks, rows, failed = [], [], 0
    for t in (0.0, 1.0):
        _, _, text, err, finish = one(host, port, model, True, t, args.check_tokens, args.timeout)
        good = not err and finish == "stop" and parses(text)
        checks.append({"temperature": t, "finish": finish, "parses": good, "chars": len(text),
                       "error": err, "text_head": text[:120]})
        failed += not good
        print(f"check temperature {t}: finish {finish}, {len(text)} chars, parses {good}, error {err}: "
              f"{text[:80]!r}")
    for rnd in range(args.rounds):
        for schema in (False, True):
            for t in (0.0, 1.0):
                ttft, gaps, text, err, finish = one(host, port, model, schema, t, args.max_tokens,
                                                    args.timeout)
                # a reply cut by max_tokens is not judged here (the check below is)
                ok = parses(text) if schema and not err and finish == "stop" else None
                itl = sum(gaps) / len(gaps) * 1e3 if gaps else None
                row = {"round": rnd, "schema": schema, "temperature": t, "chunks": len(gaps) + 1 if ttft else 0,
                       "ttft_ms": ttft * 1e3 if ttft else None, "itl_ms": itl, "finish": finish, "parses": ok, "error": err}
                rows.append(row)
                failed += bool(err) or ok is False
                print(f"round {rnd} schema {schema!s:5} temperature {t}: {row['chunks']} chunks, "
                      f"ITL {itl if itl is None else round(itl, 3)} ms, finish {finish}, parses {ok}, error {err}")
                sys.stdout.flush()
    mean = {}
    for schema in (False, True):
        for t in (0.0, 1.0):
            xs = [r["itl_ms"] for r in rows if r["schema"] == schema and r["temperature"] == t and r["itl_ms"]]
            mean[(schema, t)] = sum(xs) / len(xs) if xs else float("nan")
    for t in (0.0, 1.0):
        plain, masked = mean[(False, t)], mean[(True, t)]
        print(f"temperature {t}: ITL plain {plain:.3f} ms, json_schema {masked:.3f} ms: "
              f"+{masked - plain:.3f} ms ({(masked / plain - 1) * 100:+.1f}% of a step; issue 41: < 10%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": SCHEMA, "checks": checks, "requests": rows}, f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
