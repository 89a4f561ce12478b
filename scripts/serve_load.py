#!/usr/bin/env python3
"""Drives a running `kestrel serve` with streaming chat requests and reports what clients see.

Two kinds of load, each a row of the report:
  --concurrency 1,8,32,64   closed loop: that many requests in flight at all times
  --rates 2,8,32            open loop: requests arrive as a Poisson process of that many a second
--long-prompt-words N adds to each closed-loop row one request with a prompt of N words
("word" each, about a token apiece), sent a second into the row: the row then also reports
that request's time to first token and the other streams' worst inter-token gap while it was
prefilled (how a long prompt's admission stalls running streams).
Each row sends --requests requests (default 4 x the concurrency, at least 16) of --max-tokens
tokens each and reports output tok/s over the row's wall time, time to first token and
inter-token latency (p50 / p99, over every token of every request), and failures (any non-200
status, an error event, a missing finish_reason or a stream cut short).

Only the standard library: runs on the GPU machine as is.
    python3 scripts/serve_load.py --url http://127.0.0.1:8123 --concurrency 1,8,32,64 --json out.json
"""
import argparse
import asyncio
import json
import random
import sys
import time
from urllib.parse import urlparse


async def one_request(host, port, body, timeout):
    """Sends one streaming chat request; returns (ok, ttft_s, [itl_s], tokens, error)."""
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except Exception as e:  # noqa: BLE001 - any connect failure is a failed request
        return False, None, [], 0, f"connect: {e}"
    data = json.dumps(body).encode()
    writer.write(
        (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
         f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data)
    await writer.drain()
    ttft, last, itl, tokens, finish, err = None, None, [], 0, None, None
    try:
        status_line = await asyncio.wait_for(reader.readline(), timeout)
        status = int(status_line.split()[1]) if status_line else 0
        if status != 200:
            rest = await asyncio.wait_for(reader.read(), timeout)
            return False, None, [], 0, f"status {status}: {rest[-300:]!r}"
        while True:
            line = await asyncio.wait_for(reader.readline(), timeout)
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                break
            ev = json.loads(payload)
            if "error" in ev:
                err = str(ev["error"])
                break
            for ch in ev.get("choices", []):
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
                delta = ch.get("delta", {})
                if delta.get("content") or delta.get("reasoning_content"):
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    else:
                        itl.append(now - last)
                    last = now
            if ev.get("usage"):
                tokens = ev["usage"].get("completion_tokens", tokens)
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    finally:
        writer.close()
    ok = err is None and finish is not None
    return ok, ttft, itl, tokens, err or (None if ok else "no finish_reason")


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def body_for(i, args):
    words = " ".join(f"w{(i * 7919 + j) % 997}" for j in range(args.prompt_words))
    b = {"model": args.model, "messages": [{"role": "user", "content": f"request {i}: {words}"}],
         "max_tokens": args.max_tokens, "stream": True, "stream_options": {"include_usage": True},
         "seed": i}
    if args.greedy:
        b["temperature"] = 0
    return b


async def run_row(host, port, args, concurrency=None, rate=None):
    n = args.requests or max(16, 4 * (concurrency or int(rate) or 1))
    results = []
    long_result = None
    t0 = time.perf_counter()
    if concurrency:
        queue = list(range(n))

        async def worker():
            while queue:
                i = queue.pop()
                results.append(await one_request(host, port, body_for(i, args), args.timeout))

        async def long_one():
            await asyncio.sleep(1.0)
            b = body_for(n, args)
            b["messages"][0]["content"] = "word " * args.long_prompt_words
            b["max_tokens"] = 16
            return await one_request(host, port, b, args.timeout)

        tasks = [worker() for _ in range(concurrency)]
        if args.long_prompt_words:
            tasks.append(long_one())
        done = await asyncio.gather(*tasks)
        if args.long_prompt_words:
            long_result = done[-1]
    else:
        rng = random.Random(1)
        tasks = []
        for i in range(n):
            tasks.append(asyncio.create_task(one_request(host, port, body_for(i, args), args.timeout)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    ok = [r for r in results if r[0]]
    ttfts = [r[1] for r in ok if r[1] is not None]
    itls = [x for r in ok for x in r[2]]
    tokens = sum(r[3] for r in ok)
    errors = sorted({r[4] for r in results if not r[0]})[:5]
    row = {
        "mode": "concurrency" if concurrency else "rate",
        "concurrency": concurrency, "rate_per_s": rate, "requests": n,
        "failed": len(results) - len(ok), "errors": errors,
        "wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
        "ttft_p50_ms": (pct(ttfts, 50) or 0) * 1e3, "ttft_p99_ms": (pct(ttfts, 99) or 0) * 1e3,
        "itl_p50_ms": (pct(itls, 50) or 0) * 1e3, "itl_p99_ms": (pct(itls, 99) or 0) * 1e3,
        "itl_max_ms": max(itls, default=0) * 1e3,
    }
    if long_result is not None:
        row["long_prompt_words"] = args.long_prompt_words
        row["long_ok"] = bool(long_result[0])
        row["long_ttft_ms"] = (long_result[1] or 0) * 1e3
        if not long_result[0]:
            row["failed"] += 1
            row["errors"] = row["errors"] + [long_result[4]]
    print(f"{row['mode']:>11} {concurrency or rate:>6} {n:>5} req {row['failed']:>3} failed "
          f"{row['output_tok_s']:>9.1f} tok/s  ttft p50 {row['ttft_p50_ms']:>8.1f} p99 {row['ttft_p99_ms']:>8.1f} ms  "
          f"itl p50 {row['itl_p50_ms']:>6.1f} p99 {row['itl_p99_ms']:>6.1f} max {row['itl_max_ms']:>6.1f} ms"
          + (f"  long prompt ttft {row['long_ttft_ms']:.0f} ms" if long_result is not None else "")
          + f" {row['errors'] if row['errors'] else ''}",
          flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", help="model id (default: the first of /v1/models)")
    ap.add_argument("--concurrency", default="")
    ap.add_argument("--rates", default="")
    ap.add_argument("--requests", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--long-prompt-words", type=int, default=0)
    ap.add_argument("--greedy", action="store_true", help="temperature 0 (else the server's sampling defaults)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json")
    args = ap.parse_args()
    u = urlparse(args.url)
    host, port = u.hostname, u.port or 80
    if not args.model:
        import urllib.request
        with urllib.request.urlopen(f"{args.url}/v1/models", timeout=30) as r:
            args.model = json.load(r)["data"][0]["id"]
    rows = []
    for c in [int(x) for x in args.concurrency.split(",") if x]:
        rows.append(asyncio.run(run_row(host, port, args, concurrency=c)))
    for r in [float(x) for x in args.rates.split(",") if x]:
        rows.append(asyncio.run(run_row(host, port, args, rate=r)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"url": args.url, "max_tokens": args.max_tokens, "prompt_words": args.prompt_words,
                       "greedy": args.greedy, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "rows": rows}, f, indent=2)
    sys.exit(1 if any(r["failed"] for r in rows) else 0)


if __name__ == "__main__":
    main()
