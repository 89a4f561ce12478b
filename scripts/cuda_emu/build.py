# Turns src/cuda/kernels' headers (every .cuh of SOURCES in src/cuda/mod.rs) + the kernel files
# named into C++ for the CPU emulator (cuda_emu.h), in SOURCES order (the module's): splits the
# sources into top-level items, drops the helpers the emulator provides (its "emu-provides:"
# list; every inline-asm helper of a header must be among them), maps `extern __shared__` arrays
# to the emulator's dynamic shared memory and adds alignment checks to gdn_chunk.cu's float4
# accessors.
# Usage: python3 build.py OUT.inc gdn_chunk.cu [gdn_state.cu ...]
import os, re, sys

here = os.path.dirname(os.path.abspath(__file__))
kdir = os.path.join(here, "..", "..", "src", "cuda", "kernels")
mod = open(os.path.join(here, "..", "..", "src", "cuda", "mod.rs")).read()
sources = re.findall(r'\("([\w.]+)", include_str!\("kernels/[\w.]+"\)\)', mod)


def items(src):
    """Top-level items: preprocessor lines, and declarations or definitions up to their closing
    brace or semicolon, each with the comments and blank lines before it."""
    out, i, start, depth, n = [], 0, 0, 0, len(src)
    line_start = True
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            i = src.find("\n", i)
            i = n if i < 0 else i
            continue
        if src.startswith("/*", i):
            i = src.index("*/", i) + 2
            continue
        if c in "\"'":
            j = i + 1
            while src[j] != c:
                j += 2 if src[j] == "\\" else 1
            i = j + 1
            line_start = False
            continue
        if c == "#" and depth == 0 and line_start:
            j = i
            while True:
                e = src.find("\n", j)
                e = n if e < 0 else e
                if src[e - 1] != "\\":
                    break
                j = e + 1
            out.append(src[start:e + 1])
            start = i = e + 1
            line_start = True
            continue
        if c == "\n":
            line_start = True
        elif not c.isspace():
            line_start = False
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                j = i + 1
                while j < n and src[j] in " \t":
                    j += 1
                if j < n and src[j] == ";":
                    i = j
                out.append(src[start:i + 1])
                start = i + 1
        elif c == ";" and depth == 0:
            out.append(src[start:i + 1])
            start = i + 1
        i += 1
    out.append(src[start:])
    return out


def code(item):
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", item, flags=re.S)


def name(item):
    c = code(item).strip()
    m = re.match(r"#\s*define\s+(\w+)", c)
    if m:
        return m.group(1)
    c = re.sub(r"__launch_bounds__\([^)]*\)|__align__\([^)]*\)", "", c)
    m = re.search(r"(\w+)\s*\(", c)
    return m.group(1) if m else c[:40]


emu = open(os.path.join(here, "cuda_emu.h")).read()
provided = set()
for line in re.findall(r"// emu-provides:([^\n]*)", emu):
    provided.update(line.split())
# Kernels the emulator leaves out (their inline asm has no emulation and no check runs them).
for line in re.findall(r"// emu-skips:([^\n]*)", emu):
    provided.update(line.split())

wanted = sys.argv[2:]
for f in wanted:
    assert f in sources and f.endswith(".cu"), f"{f}: not a kernel file of SOURCES"
out = ['#include "cuda_emu.h"\n']
for f in sources:
    if f.endswith(".cuh"):  # a header: its helpers, less the emulator's
        kept = []
        for it in items(open(os.path.join(kdir, f)).read()):
            c = code(it)
            if "#include" in c or "typedef __nv_bfloat16 bf16;" in c:
                continue
            nm = name(it)
            if nm in provided:
                continue
            assert "asm" not in c, f"inline asm in {f}'s {nm}: add it to cuda_emu.h (and its emu-provides list)"
            kept.append(it)
        out.append(f"\n// ---- {f}\n" + "".join(kept))
        continue
    if f not in wanted:
        continue
    src = "".join(it for it in items(open(os.path.join(kdir, f)).read()) if name(it) not in provided)
    src = re.sub(r"extern __shared__ (?:__align__\(\d+\) )?((?:unsigned )?\w+) (\w+)\[\];",
                 r"\1* \2 = reinterpret_cast<\1*>(emu_dyn_smem());", src)
    assert "extern __shared__" not in src, f
    if f == "gdn_chunk.cu":
        for fn in ["ld4(const float* p) {", "st4(float* p, float4 v) {"]:
            assert fn in src, fn
            src = src.replace(fn, fn + " emu_check_align(p);")
    out.append(f"\n// ---- {f}\n" + src)
open(sys.argv[1], "w").write("".join(out))
