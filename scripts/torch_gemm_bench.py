#!/usr/bin/env python3
"""What cuBLAS(Lt) reaches through torch for Kestrel's prefill projection shapes (8,192
tokens): y[t, n] = x[t, k] . W[n, k]^T, bf16 in, bf16 out and (where torch offers it) f32
out. A yardstick for the `gemm NxK t=T` lines of a KESTREL_PROFILE run."""
import torch

T = 8192
SHAPES = [(8192, 2048), (4096, 2048), (2048, 4096), (1024, 2048), (12352, 2048), (256, 2048)]


def time_ms(f, reps=20):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        f()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


x = torch.randn(T, 4096, device="cuda", dtype=torch.bfloat16)
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, t={T}")
for n, k in SHAPES:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    xs = x[:, :k].contiguous()
    flop = 2 * T * n * k
    ms = time_ms(lambda: xs @ w.t())
    line = f"gemm {n}x{k}: bf16 out {ms * 1e3:8.1f} us {flop / ms / 1e9:6.0f} TFLOP/s"
    try:
        ms32 = time_ms(lambda: torch.mm(xs, w.t(), out_dtype=torch.float32))
        line += f" | f32 out {ms32 * 1e3:8.1f} us {flop / ms32 / 1e9:6.0f} TFLOP/s"
    except Exception as e:  # older torch: no out_dtype
        line += f" | f32 out n/a ({type(e).__name__})"
    print(line, flush=True)
