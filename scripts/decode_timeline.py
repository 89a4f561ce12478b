#!/usr/bin/env python3
"""Summarises a decode-step timeline written by `kestrel bench` with
KESTREL_TRACE=1 KESTREL_TRACE_OUT=PREFIX (PREFIX-CONTEXT.csv: one row per
sampled block, every 8th and the last of each kernel: tag, grid, block, y, sm, start, wait,
end in ns of %globaltimer, then up to three phase stamps a kernel takes, 0 when not taken).

Blocks are grouped into launches (same kernel and grid; a new launch when a block starts after
every earlier block of that kernel has ended), the launches ordered by their first start. A
launch's cost on the step's critical path is how far it moves the completion frontier: its last
block's end minus the previous launch's. That splits into the boundary (previous launch's end
to this launch's first wait release: what programmatic dependent launch leaves exposed) and
the body (first release to last end). Printed per kernel kind, in µs per step and per launch.
Usage: decode_timeline.py PREFIX-CONTEXT.csv[.gz] [--launches]"""
import csv
import gzip
import sys
from collections import defaultdict

TAGS = {1: "embed_gather", 2: "gemv", 3: "gdn_conv_dec", 4: "gdn_step_dec", 5: "attn_prep",
        6: "attn_decode", 7: "attn_combine", 8: "moe_router_dec", 9: "moe_gate_up_dec",
        10: "moe_down_dec"}
# What the GEMV grids are at the full shape (rows / rows per block).
GEMV = {772: "gemv in-proj GDN", 576: "gemv in-proj attn", 256: "gemv out-proj", 1056: "gemv lm_head",
        132: "gemv_dec_stream in-proj"}


def kind(tag, grid):
    name = TAGS.get(tag, f"tag{tag}")
    return GEMV.get(grid, f"gemv grid {grid}") if tag == 2 else name


def main():
    path = sys.argv[1]
    rows = list(csv.DictReader(gzip.open(path, "rt") if path.endswith(".gz") else open(path)))
    by_kernel = defaultdict(list)
    for r in rows:
        rec = {k: int(v) for k, v in r.items()}
        by_kernel[(rec["tag"], rec["grid"])].append(rec)
    launches = []
    for (tag, grid), recs in by_kernel.items():
        recs.sort(key=lambda r: r["start_ns"])
        cur, end = [], 0
        for r in recs:
            if cur and r["start_ns"] > end:
                launches.append((tag, grid, cur))
                cur, end = [], 0
            cur.append(r)
            end = max(end, r["end_ns"])
        launches.append((tag, grid, cur))
    launches.sort(key=lambda l: min(r["start_ns"] for r in l[2]))
    t0 = min(r["start_ns"] for l in launches for r in l[2])
    frontier = t0
    per_kind = defaultdict(lambda: [0, 0.0, 0.0, 0.0])  # launches, cost, boundary, body
    detail = []
    for tag, grid, recs in launches:
        first = min(r["start_ns"] for r in recs)
        waits = [r["wait_ns"] for r in recs if r["wait_ns"]]
        release = min(waits) if waits else first
        last = max(r["end_ns"] for r in recs)
        cost = max(last - frontier, 0)
        boundary = max(min(release - frontier, cost), 0)
        k = kind(tag, grid)
        p = per_kind[k]
        p[0] += 1
        p[1] += cost
        p[2] += boundary
        p[3] += cost - boundary
        detail.append((k, first - t0, release - t0, last - t0, cost))
        frontier = max(frontier, last)
    total = frontier - t0
    print(f"{sys.argv[1]}: {len(launches)} launches, step {total / 1e3:.1f} µs (first start to last end)")
    print(f"{'kernel':<22} {'launches':>8} {'µs/step':>9} {'share':>6} {'µs/launch':>10} "
          f"{'boundary':>9} {'body':>7}")
    for k, (n, cost, bnd, body) in sorted(per_kind.items(), key=lambda kv: -kv[1][1]):
        print(f"{k:<22} {n:>8} {cost / 1e3:>9.1f} {100 * cost / total:>5.1f}% {cost / n / 1e3:>10.2f} "
              f"{bnd / n / 1e3:>9.2f} {body / n / 1e3:>7.2f}")
    # Phase stamps (TRACE_PHASE in a kernel): per kernel and grid row y, the mean time from a
    # block's wait release to each phase and to its end, over the blocks that waited and took
    # the phase (a split of the decode attention is a y).
    phased = defaultdict(list)
    for tag, grid, recs in launches:
        for r in recs:
            if r.get("ph0_ns", 0) and r["wait_ns"]:
                phased[(kind(tag, grid), r["y"])].append(r)
    def mean_after_wait(recs, col, width):
        xs = [r[col] - r["wait_ns"] for r in recs if r[col]]
        return f"{sum(xs) / len(xs) / 1e3:>{width}.2f}" if xs else f"{'-':>{width}}"
    if phased:
        print(f"\n{'kernel':<22} {'y':>3} {'blocks':>6}  µs after the wait release: "
              f"{'phase 0':>8} {'phase 1':>8} {'phase 2':>8} {'end':>7}")
        for (k, y), recs in sorted(phased.items()):
            cols = " ".join(mean_after_wait(recs, c, 8) for c in ("ph0_ns", "ph1_ns", "ph2_ns"))
            print(f"{k:<22} {y:>3} {len(recs):>6}  {'':<26}{cols} {mean_after_wait(recs, 'end_ns', 7)}")
    if "--launches" in sys.argv:
        print(f"\n{'kernel':<22} {'first start':>11} {'release':>9} {'last end':>9} {'cost':>7}  (µs)")
        for k, a, b, c, cost in detail:
            print(f"{k:<22} {a / 1e3:>11.2f} {b / 1e3:>9.2f} {c / 1e3:>9.2f} {cost / 1e3:>7.2f}")


if __name__ == "__main__":
    main()
