#!/usr/bin/env python3
"""Compiles src/cuda/kernels/* with NVRTC exactly as src/cuda/mod.rs does (same order, same
options, compute_90a) without building the crate: a quick syntax/type check of kernel edits.
Needs `eval "$(scripts/setup_nvrtc.sh)"` first (CUDA_HOME with libnvrtc and the headers).
Prints the NVRTC log and exits nonzero on error; `--ptx FILE` writes the PTX. `--regs [FILTER]`
compiles to sm_90a machine code instead (ptxas, as the driver would run it) and prints the
registers per thread of each kernel whose name contains FILTER; with `--cubin FILE` it also
writes that machine code, for `nvdisasm` (pip package nvidia-cuda-nvdisasm) to show spills
(LDL/STL) or where loads sit against griddepcontrol.wait (ACQBULK). Honours
KESTREL_KERNEL_DEFINES as the crate does."""
import ctypes, os, re, sys, time

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
mod = open(os.path.join(root, "src/cuda/mod.rs")).read()
names = re.findall(r'\("([\w.]+)", include_str!\("kernels/[\w.]+"\)\)', mod)
src = ""
for n in names:
    src += f"// ---- {n}\n" + open(os.path.join(root, "src/cuda/kernels", n)).read() + "\n"
hdr = "#include <cuda_bf16.h>\n#include <mma.h>\n"
# KESTREL_KERNEL_DEFINES="A B=1" as the crate applies it
defines = "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in os.environ.get("KESTREL_KERNEL_DEFINES", "").split())
src = hdr + defines + src.replace(hdr, "")
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
regs = "--regs" in sys.argv
arch = b"--gpu-architecture=sm_90a" if regs else b"--gpu-architecture=compute_90a"
opts = [arch, f"-I{home}/include".encode(), b"--std=c++17", b"-default-device"]
if "--ptxas-v" in sys.argv:  # ptxas's per-kernel report (spills; wgmma serialization, C7513)
    opts.append(b"--ptxas-options=-v")
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
if rc == 0 and regs:
    import struct
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, buf)
    elf = buf.raw
    # ELF64 section headers; .nv.info holds EIATTR_REGCOUNT (0x2f) records (symbol index,
    # registers), .symtab names the symbols.
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    cstr = lambda off: elf[off: elf.index(b"\0", off)].decode()
    sec_name = lambda sh: cstr(secs[shstrndx][4] + sh[0])
    symtab = next(sh for sh in secs if sec_name(sh) == ".symtab")
    strtab = secs[symtab[6]]
    syms = [cstr(strtab[4] + struct.unpack_from("<I", elf, symtab[4] + i * 24)[0])
            for i in range(symtab[5] // 24)]
    want = sys.argv[sys.argv.index("--regs") + 1] if len(sys.argv) > sys.argv.index("--regs") + 1 else ""
    rows = []
    for sh in secs:
        if sec_name(sh) != ".nv.info":
            continue
        off, end = sh[4], sh[4] + sh[5]
        while off < end:
            fmt, attr, size = struct.unpack_from("<BBH", elf, off)
            if fmt == 0x04 and attr == 0x2F:
                sym, nreg = struct.unpack_from("<II", elf, off + 4)
                if want in syms[sym]:
                    rows.append((syms[sym], nreg))
            off += 4 + (size if fmt == 0x04 else 0)
    if "--cubin" in sys.argv:
        open(sys.argv[sys.argv.index("--cubin") + 1], "wb").write(elf)
    for nm, r in sorted(rows):
        print(f"{r:4d} regs  {nm}")
sys.exit(1 if rc else 0)
