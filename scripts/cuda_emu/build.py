# Turns src/cuda/kernels/common.cuh + gdn.cu into C++ for the CPU emulator (cuda_emu.h):
# keeps common.cuh's basic helpers (up to the programmatic-dependent-launch section; the decode
# GEMV machinery after it is not used by gdn.cu), makes the griddep fences no-ops (one kernel at
# a time here), drops the CUDA includes and the asm cp.async helpers (the emulator has its own),
# maps the dynamic shared memory to the emulator's buffer and checks float4 alignment.
# Usage: python3 build.py OUT.inc
import os, re, sys

kdir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src", "cuda", "kernels")
com = open(os.path.join(kdir, "common.cuh")).read()
gdn = open(os.path.join(kdir, "gdn.cu")).read()
com = com.replace("#include <cuda_bf16.h>\n#include <mma.h>\n", "").replace("typedef __nv_bfloat16 bf16;\n", "")
cut = com.index("// Programmatic dependent launch")
com = com[:cut] + "inline void griddep_launch() {}\ninline void griddep_wait() {}\n"
assert "asm" not in com, "an asm helper is left in common.cuh: teach build.py and cuda_emu.h about it"
gdn = gdn.replace("extern __shared__ __align__(16) float gdn_smem[];", "float* gdn_smem = emu_dyn_smem();")
assert "extern __shared__" not in gdn
for name in ["ld4(const float* p) {", "st4(float* p, float4 v) {"]:
    assert name in gdn, name
    gdn = gdn.replace(name, name + " emu_check_align(p);")
open(sys.argv[1], "w").write('#include "cuda_emu.h"\n' + com + "\n" + gdn)
