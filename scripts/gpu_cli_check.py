#!/usr/bin/env python3
"""The command line on the GPU, end to end: `generate`, `chat` and `serve` with `--device cuda`
on a real checkpoint directory (the full-width one `fullwidth_check.py` writes), and the
"not enough GPU memory" errors: with most of the GPU held by another process, and for
more running sequences than the GPU holds.

Run by `scripts/gpu_check.sh cli` on the GPU machine; exits nonzero if any check fails and
writes each command's output under OUT.
Usage: gpu_cli_check.py --kestrel BIN --model DIR --out OUT
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

FAILED = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAILED.append(what)


def run(name, args, out, stdin=None, timeout=600):
    t = time.perf_counter()
    p = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=timeout)
    dt = time.perf_counter() - t
    with open(os.path.join(out, f"{name}.log"), "w") as f:
        f.write(f"$ {' '.join(args)}\n# rc {p.returncode}, {dt:.1f} s\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}\n")
    print(f"== {name}: rc {p.returncode} in {dt:.1f} s\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}", flush=True)
    return p


def http(method, url, body=None, timeout=300):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kestrel", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    k, m = a.kestrel, a.model

    # generate: the chat-formatted prompt, greedy, 24 tokens; the stats line goes to stderr.
    p = run("generate", [k, "generate", "--device", "cuda", "--model", m, "--prompt",
                         "Write one sentence about falcons.", "--max-tokens", "24",
                         "--temperature", "0", "--no-think"], a.out)
    check(p.returncode == 0, "generate --device cuda exits 0")
    check(len(p.stdout.strip()) > 0, "generate printed a reply")
    # The same greedy run twice gives the same text (device argmax, graph replay).
    p2 = run("generate-again", [k, "generate", "--device", "cuda", "--model", m, "--prompt",
                                "Write one sentence about falcons.", "--max-tokens", "24",
                                "--temperature", "0", "--no-think", "-q"], a.out)
    check(p2.returncode == 0 and p2.stdout.strip() == p.stdout.strip(),
          "a second greedy generate gives the same text")

    # Greedy ids from the device's fused argmax (the default) against every step's logits
    # on the host (KESTREL_HOST_SAMPLING=1): the same text over 512 tokens; both decode rates
    # are in the stats lines (stderr) of the two logs.
    long_args = [k, "generate", "--device", "cuda", "--model", m, "--prompt",
                 "Write one sentence about falcons.", "--max-tokens", "512", "--temperature", "0",
                 "--no-think"]
    pd = run("generate-512-device-argmax", long_args, a.out)
    os.environ["KESTREL_HOST_SAMPLING"] = "1"
    ph = run("generate-512-host-logits", long_args, a.out)
    del os.environ["KESTREL_HOST_SAMPLING"]
    check(pd.returncode == 0 and ph.returncode == 0 and pd.stdout == ph.stdout,
          "512 greedy tokens: the device argmax and the host's argmax of the logits give the same text")

    # chat: two turns from stdin, then EOF ends it.
    p = run("chat", [k, "chat", "--device", "cuda", "--model", m, "--max-tokens", "16",
                     "--temperature", "0", "--no-think"], a.out,
            stdin="Hello there.\nAnd a second question?\n")
    check(p.returncode == 0, "chat --device cuda exits 0 at end of input")
    check(len(p.stdout.strip()) > 0, "chat printed replies")

    # serve: load, then plain, streaming, concurrent and bad requests.
    port = 18123
    base = f"http://127.0.0.1:{port}"
    log = open(os.path.join(a.out, "serve.log"), "w")
    srv = subprocess.Popen([k, "serve", "--device", "cuda", "--model", m, "--bind",
                            f"127.0.0.1:{port}", "--max-running", "2", "--default-max-tokens", "16",
                            "--served-model-name", "fw", "--cache-mem", "1000G"],
                           stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.perf_counter()
        ready = False
        while time.perf_counter() - t0 < 300 and srv.poll() is None:
            try:
                s, _ = http("GET", base + "/health", timeout=5)
                if s == 200:
                    ready = True
                    break
            except Exception:
                pass
            time.sleep(1)
        check(ready, f"serve --device cuda answers /health ({time.perf_counter() - t0:.0f} s to load)")
        if ready:
            body = {"model": "fw", "messages": [{"role": "user", "content": "Say hi."}],
                    "max_tokens": 12, "temperature": 0}
            s, r = http("POST", base + "/v1/chat/completions", body)
            print(r[:800])
            ok = s == 200
            if ok:
                j = json.loads(r)
                ok = j["usage"]["completion_tokens"] >= 1 and j["choices"][0]["message"] is not None
            check(ok, "POST /v1/chat/completions returns a completion")
            # with logprobs the worker keeps each step's logits on the host; without, greedy ids
            # come from the device's argmax: the same reply
            s2, r2 = http("POST", base + "/v1/chat/completions", dict(body, logprobs=True))
            same = ok and s2 == 200 and (json.loads(r2)["choices"][0]["message"]["content"]
                                         == json.loads(r)["choices"][0]["message"]["content"])
            check(same, "a greedy chat completion with logprobs (host logits) gives the same reply")
            s, r = http("POST", base + "/v1/chat/completions", dict(body, stream=True))
            chunks = [l for l in r.splitlines() if l.startswith("data: ")]
            check(s == 200 and chunks and chunks[-1] == "data: [DONE]",
                  f"streaming chat completion ends with [DONE] ({len(chunks)} events)")
            results = [None, None, None]

            def one(i):
                results[i] = http("POST", base + "/v1/completions",
                                  {"model": "fw", "prompt": f"Number {i}:", "max_tokens": 10,
                                   "temperature": 0})

            ths = [threading.Thread(target=one, args=(i,)) for i in range(3)]
            for t in ths:
                t.start()
            for t in ths:
                t.join()
            check(all(r is not None and r[0] == 200 for r in results),
                  "three concurrent completions all answer 200")
            s, r = http("POST", base + "/v1/chat/completions",
                        {"model": "fw", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3})
            check(400 <= s < 500, f"a bad request gets a 4xx ({s}): {r[:200]}")
            s, r = http("GET", base + "/metrics")
            with open(os.path.join(a.out, "serve-metrics.txt"), "w") as f:
                f.write(r)
    finally:
        srv.terminate()
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
        log.close()
    serve_log = open(os.path.join(a.out, "serve.log")).read()
    print(serve_log[-3000:])
    check("the prefix cache gets" in serve_log,
          "serve limits --cache-mem 1000G to the GPU memory the running states leave, with a warning")

    # More running sequences than the GPU holds: refused at startup with the numbers.
    p = run("serve-too-many", [k, "serve", "--device", "cuda", "--model", m, "--bind",
                               f"127.0.0.1:{port + 1}", "--max-running", "200", "--max-seq", "262144"],
            a.out, timeout=300)
    check(p.returncode != 0 and "not enough GPU memory for --max-running 200" in p.stderr,
          "serve with --max-running 200 --max-seq 262144 stops at startup, saying why")
    check("panicked" not in p.stderr, "that refusal is not a panic")

    # Not enough memory: hold all but ~4 GiB of the GPU in this process, then load the model.
    import torch
    free, total = torch.cuda.mem_get_info()
    hold = torch.empty(max(free - (4 << 30), 0), dtype=torch.uint8, device="cuda")
    p = run("oom", [k, "generate", "--device", "cuda", "--model", m, "--prompt", "hi"], a.out)
    del hold
    torch.cuda.empty_cache()
    check(p.returncode != 0 and "not enough GPU memory" in p.stderr,
          "with the GPU held elsewhere, loading fails with the memory plan in the message")
    check("panicked" not in p.stderr, "the memory error is not a panic")

    print(f"\n{len(FAILED)} failed: {FAILED}" if FAILED else "\nall CLI checks passed")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
