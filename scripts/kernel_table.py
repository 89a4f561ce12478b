#!/usr/bin/env python3
"""Per-op time of one fused decode step from an Nsight Compute CSV (gpu__time_duration.sum
per kernel launch, written by `scripts/gpu_check.sh kernels`): takes the launches between two
consecutive embed_gather launches (one whole step), groups them by kernel and grid, and prints
a markdown table (calls per step, us per call, us per step, share)."""
import csv
import sys
from collections import OrderedDict


def main(path):
    rows = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # ncu prints its own log lines too
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "ns")
        v = float(r["Metric Value"].replace(",", ""))
        us = v / 1e3 if unit in ("ns", "nsecond") else v * 1e3 if unit in ("ms", "msecond") else v
        name = r["Kernel Name"].split("(")[0]
        rows.append((name, r.get("Grid Size", ""), us))
    starts = [i for i, r in enumerate(rows) if r[0] == "embed_gather"]
    if len(starts) < 2:
        sys.exit(f"need two embed_gather launches in {path}, found {len(starts)}")
    step = rows[starts[-2]:starts[-1]]
    total = sum(r[2] for r in step)
    ops = OrderedDict()
    for name, grid, us in step:
        k = f"{name} {grid}"
        c, t = ops.get(k, (0, 0.0))
        ops[k] = (c + 1, t + us)
    print(f"One decode step: {len(step)} kernels, {total:.1f} us of kernel time "
          f"(sum of isolated kernel durations; launch gaps not included)\n")
    print("| kernel grid | calls/step | us/call | us/step | share |")
    print("|---|---:|---:|---:|---:|")
    for k, (c, t) in sorted(ops.items(), key=lambda kv: -kv[1][1]):
        print(f"| `{k}` | {c} | {t / c:.1f} | {t:.1f} | {100 * t / total:.1f}% |")


if __name__ == "__main__":
    main(sys.argv[1])
