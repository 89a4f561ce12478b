#!/usr/bin/env python3
"""Compiles src/cuda/kernels/* with NVRTC exactly as src/cuda/mod.rs does (same order, same
options, compute_90a) without building the crate: a quick syntax/type check of kernel edits.
Needs `eval "$(scripts/setup_nvrtc.sh)"` first (CUDA_HOME with libnvrtc and the headers).
Prints the NVRTC log and exits nonzero on error; `--ptx FILE` writes the PTX."""
import ctypes, os, re, sys, time

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
mod = open(os.path.join(root, "src/cuda/mod.rs")).read()
names = re.findall(r'\("([\w.]+)", include_str!\("kernels/[\w.]+"\)\)', mod)
src = ""
for n in names:
    src += f"// ---- {n}\n" + open(os.path.join(root, "src/cuda/kernels", n)).read() + "\n"
hdr = "#include <cuda_bf16.h>\n#include <mma.h>\n"
src = hdr + src.replace(hdr, "")
home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
lib = None
for cand in ["lib/libnvrtc.so.13", "lib64/libnvrtc.so", "lib/libnvrtc.so"]:
    p = os.path.join(home, cand)
    if os.path.exists(p):
        lib = ctypes.CDLL(p)
        break
if lib is None:
    sys.exit(f"no libnvrtc under {home}: run eval \"$(scripts/setup_nvrtc.sh)\"")
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kestrel.cu", 0, None, None) == 0
opts = [b"--gpu-architecture=compute_90a", f"-I{home}/include".encode(), b"--std=c++17", b"-default-device"]
arr = (ctypes.c_char_p * len(opts))(*opts)
t = time.time()
rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
n = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value)
lib.nvrtcGetProgramLog(prog, log)
print(log.value.decode(errors="replace"))
print(f"nvrtc rc {rc} in {time.time() - t:.1f} s ({len(names)} files)")
if rc == 0 and "--ptx" in sys.argv:
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, buf)
    open(sys.argv[sys.argv.index("--ptx") + 1], "wb").write(buf.value)
sys.exit(1 if rc else 0)
