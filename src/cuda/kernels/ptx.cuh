// PTX wrappers (inline asm) of Kestrel's kernels, sm_90a: cp.async, ldmatrix, mma.sync (bf16,
// tf32) and their operand packing, mbarriers, bulk copies, setmaxnreg and wgmma.

// 16-byte asynchronous global-to-shared copy (zero-fills the destination when !valid), and
// its group fences: wait_one leaves the most recent committed group in flight.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::); }
// Wait until at most N of the committed cp.async groups are still in flight (a pipeline of
// N + 2 stages keeps N loads going while one stage is read).
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
// The same for an n known only at run time (0 to 4; more waits as for 4).
__device__ __forceinline__ void cp_async_wait_dyn(int n) {
    if (n <= 0) cp_async_wait<0>();
    else if (n == 1) cp_async_wait<1>();
    else if (n == 2) cp_async_wait<2>();
    else if (n == 3) cp_async_wait<3>();
    else cp_async_wait<4>();
}


// ---- FP8 (e4m3) weights ----
// Four e4m3fn bytes of w (byte 0 -> .x) as floats, exactly (cvt.rn.f16x2.e4m3x2 is exact: every
// e4m3 value is an f16; the byte pair's low byte goes to the low half). volatile: a GEMV over
// several tokens converts its words again for each, rather than having them hoisted out of the
// token loop as 16 floats a word (gemv_fp8 then held 255 registers and spilled).
__device__ __forceinline__ float4 e4m3x4_to_float4(unsigned w) {
    unsigned lo, hi;
    asm volatile("{\n.reg .b16 a, b;\nmov.b32 {a, b}, %2;\ncvt.rn.f16x2.e4m3x2 %0, a;\ncvt.rn.f16x2.e4m3x2 %1, b;\n}\n"
        : "=r"(lo), "=r"(hi) : "r"(w));
    float4 f;
    asm volatile("{\n.reg .b16 a, b;\nmov.b32 {a, b}, %2;\ncvt.f32.f16 %0, a;\ncvt.f32.f16 %1, b;\n}\n" : "=f"(f.x), "=f"(f.y) : "r"(lo));
    asm volatile("{\n.reg .b16 a, b;\nmov.b32 {a, b}, %2;\ncvt.f32.f16 %0, a;\ncvt.f32.f16 %1, b;\n}\n" : "=f"(f.z), "=f"(f.w) : "r"(hi));
    return f;
}

// Four e4m3fn bytes of w as two bf16 pairs, exactly: lo = (byte 0, byte 1), hi = (byte 2, byte 3)
// (the lower byte in the low half), for an mma A fragment. Each byte pair: cvt.rn.f16x2.e4m3x2
// (exact: every e4m3 value, subnormals included, is a normal f16 or zero, mantissa bits 0-6
// clear); the f16 bits without the sign shifted right by 3 are the bf16 bits of the value times
// 2^-112 (the exponent biases 15 and 127; zero stays zero; the smallest, 2^-9, gives 2^-121, a
// normal bf16), the sign ORed back (lop3); fma.rn.bf16x2 by 2^112 (0x7780) plus -0 restores the
// value, exactly. volatile, as q4_pair: the grouped FP8 MoE converts a block's words again for
// every 16 rows of its tile rather than hold the converted pairs (twice the registers).
__device__ __forceinline__ void e4m3x4_to_bf16x4(unsigned w, unsigned& lo, unsigned& hi) {
    asm volatile(
        "{\n.reg .b16 a, b;\n.reg .b32 h, t;\nmov.b32 {a, b}, %2;\n"
        "cvt.rn.f16x2.e4m3x2 h, a;\nand.b32 t, h, 0x7fff7fff;\nshr.b32 t, t, 3;\n"
        "lop3.b32 t, t, h, 0x80008000, 0xF8;\nfma.rn.bf16x2 %0, t, %3, %4;\n"
        "cvt.rn.f16x2.e4m3x2 h, b;\nand.b32 t, h, 0x7fff7fff;\nshr.b32 t, t, 3;\n"
        "lop3.b32 t, t, h, 0x80008000, 0xF8;\nfma.rn.bf16x2 %1, t, %3, %4;\n}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(w), "r"(0x77807780u), "r"(0x80008000u));
}

// ---- Affine 4-bit weights ----
// One register pair of a q4 A fragment (gemv.cuh's q4_frag): the nibbles at bits S and S + 16 of
// w as a bf16 pair of the codes q, exactly: (w >> S) & 0x000F000F | 0x43004300 is bf16 128 + q
// (0x4300 is 128 with the mantissa's low bits worth 1), then fma.rn.bf16x2 x * 1 - 128. One
// volatile asm statement: the grouped 4-bit MoE reuses a block's codes for every 16 rows of its
// tile and converts them again each time; written as C shifts and masks, ptxas hoisted 4x the
// registers of shifted words out of its row loop (218 registers a thread; 122 so), and volatile
// keeps the compiler from hoisting the statement itself. gemv_q4 holds 106 so against 80 the C
// way (two blocks an SM instead of three at k = 2,048).
template <int S>
__device__ __forceinline__ unsigned q4_pair(unsigned w) {
    unsigned r;
    asm volatile("{\n.reg .b32 t;\nshr.b32 t, %1, %6;\nlop3.b32 t, t, %2, %3, 0xEA;\nfma.rn.bf16x2 %0, t, %4, %5;\n}\n"
                 : "=r"(r)
                 : "r"(w), "r"(0x000F000Fu), "r"(0x43004300u), "r"(0x3F803F80u), "r"(0xC300C300u), "n"(S));
    return r;
}

// ---- Tensor-core fragments (mma.sync m16n8k16, bf16 in, f32 accumulate) ----
// Fragment layouts (PTX ISA "mma.m16n8k16"), g = lane / 4, c = 2 * (lane % 4):
//   A 16x16 row-major: a[0] (g, c..c+1), a[1] (g+8, c..), a[2] (g, 8+c..), a[3] (g+8, 8+c..)
//   B 16x8 (k x n):    b0 (k c..c+1, n g), b1 (k 8+c.., n g)
//   C 16x8:            d[0..1] (g, c..c+1), d[2..3] (g+8, c..c+1)
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
// Four 8x8 bf16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
// The same, each matrix transposed (B operands stored k-major, e.g. V rows = keys).
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two floats as a bf16 pair (lo in the low half: the lower column of a fragment).
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// ---- Tensor-core fragments (mma.sync m16n8k8, tf32 in, f32 accumulate) ----
// Fragment layouts (PTX ISA "mma.m16n8k8" .tf32), g = lane / 4, c = lane % 4:
//   A 16x8 row-major: a[0] (g, c), a[1] (g+8, c), a[2] (g, c+4), a[3] (g+8, c+4)
//   B 8x8 (k x n):    b0 (k c, n g), b1 (k c+4, n g)
//   C 16x8:           d[0..1] (g, 2c..2c+1), d[2..3] (g+8, 2c..2c+1)
// ldsm_x4 of f32 rows reads tf32 A fragments (each 16-byte row = 4 floats): lanes 0-15 give
// rows 0-15 at column k0, lanes 16-31 the same rows at k0 + 4; likewise B from [n][k] storage.
// f32 -> tf32 (round to nearest, ties away), as the bits of a .b32 operand.
__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ void mma_tf32_1688(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// 3xTF32 split: x = hi + lo to ~2^-22 relative, both tf32; A B ≈ A_hi B_hi + A_hi B_lo +
// A_lo B_hi (three mma, f32 accumulate) is then f32-level where one tf32 mma is 2^-11.
// Both round half away from zero as to_tf32 does, in integer ops: + half an ulp of tf32 on the
// magnitude bits, then hi drops the low 13 bits and lo leaves them to the mma, which ignores
// them (what ptxas itself emits for cvt.rna feeding an mma); NaN payloads may become inf.
__device__ __forceinline__ void split_tf32(float x, unsigned& hi, unsigned& lo) {
    hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    lo = __float_as_uint(x - __uint_as_float(hi)) + 0x1000u;  // x − hi is exact in f32
}
// The bf16 form (3xBF16, twice the tensor rate of 3xTF32): a pair (x0, x1) as bf16x2 hi (round
// to nearest) and lo = the rounded rest, x ≈ hi + lo to ~2^-17 relative; A B ≈ A_hi B_hi +
// A_hi B_lo + A_lo B_hi is then ~1e-5-level (one bf16 product is 2^-8).
__device__ __forceinline__ void split_bf16x2(float x0, float x1, unsigned& hi, unsigned& lo) {
    hi = pack_bf16x2(x0, x1);
    lo = pack_bf16x2(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
}

// ---- mbarrier (sm_90: try_wait): a 64-bit arrival counter in shared memory with a phase bit ----
// Initialised by one thread before a block barrier. A phase completes when `count` arrivals
// have happened; waiters name the parity of the phase they wait for (0 first, then 1, ...).
__device__ __forceinline__ void mbar_init(unsigned long long* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// One arrival once every cp.async this thread issued before has landed (noinc: the init count
// already counts it).
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned long long* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "MBAR_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra MBAR_WAIT;\n"
        "}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

// ---- Bulk copies and warpgroups (sm_90 / sm_90a) ----
// One arrival that also expects `bytes` of tensor-copy transactions in the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// `bytes` (a multiple of 16) from global `src` into shared `dst` (both 16-byte aligned) as one
// bulk copy (cp.async.bulk, sm_90), completing its bytes on `bar`: the copy engine moves them,
// so the block's own load path (its outstanding-request slots) stays free for other loads.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                  smem_addr(dst)),
              "l"(src), "r"(bytes), "r"(smem_addr(bar))
              : "memory");
}
// Warpgroup-wide register budget changes (sm_90a): a producer warpgroup gives registers back,
// consumer warpgroups take them (per SM sub-partition, every warpgroup has one warp there).
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
// ---- wgmma (sm_90a): warpgroup matrix multiply-accumulate from shared-memory descriptors ----
// Shared-memory matrix descriptor of a K-major operand tile in the 128-byte swizzle layout
// (rows of 64 bf16 = 128 bytes, 16-byte chunk c of row r at chunk c ^ (r % 8), 8-row groups
// 1024 bytes apart, the tile 1024-byte aligned): start address >> 4 (bits 0-13), stride between
// 8-row groups >> 4 (bits 32-45), swizzle mode 1 = 128 B (bits 62-63); the leading offset is
// unused by this layout. Advancing along K inside the 128-byte row adds bytes >> 4 to the start.
__device__ __forceinline__ unsigned long long wgmma_desc_sw128(const void* smem_tile) {
    const unsigned long long addr = smem_addr(smem_tile);
    return ((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// The same layout read N-major (imm-trans-b = 1: B's N index runs along the 128-byte rows):
// rows are K (8-row groups 1024 bytes apart: the stride field), 64-wide N blocks `lbo` bytes
// apart (the leading field).
__device__ __forceinline__ unsigned long long wgmma_desc_sw128_mn(const void* smem_tile, unsigned lbo) {
    const unsigned long long addr = smem_addr(smem_tile);
    return ((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
// Writes by the generic proxy (st.shared, cp.async) made visible to the async proxy (wgmma).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving accumulator reads/writes across in-flight wgmma.
__device__ __forceinline__ void wgmma_fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
// (and register A fragments, which an in-flight wgmma still reads)
__device__ __forceinline__ void wgmma_fence_operand(unsigned& r) { asm volatile("" : "+r"(r)::"memory"); }
// (and descriptors: computed before wgmma_fence, not sunk into the stage, where a non-wgmma
// instruction defining a wgmma input makes ptxas serialize every wgmma of the kernel: C7513)
__device__ __forceinline__ void wgmma_fence_operand(unsigned long long& r) { asm volatile("" : "+l"(r)::"memory"); }
// The 128 f32 accumulators of an m64n256 wgmma: the operand list (%0..%127) and its constraints.
#define WGMMA_D128_REGS \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
    "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
    "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63," \
    "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79," \
    "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95," \
    "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111," \
    "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}"
// The 32 f32 accumulators of an m64n64 wgmma: the operand list (%0..%31) and its constraints.
#define WGMMA_D32_REGS \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define WGMMA_D32_OUT(d) \
    "+f"((d)[0]), "+f"((d)[1]), "+f"((d)[2]), "+f"((d)[3]), "+f"((d)[4]), "+f"((d)[5]), "+f"((d)[6]), "+f"((d)[7]), \
    "+f"((d)[8]), "+f"((d)[9]), "+f"((d)[10]), "+f"((d)[11]), "+f"((d)[12]), "+f"((d)[13]), "+f"((d)[14]), "+f"((d)[15]), \
    "+f"((d)[16]), "+f"((d)[17]), "+f"((d)[18]), "+f"((d)[19]), "+f"((d)[20]), "+f"((d)[21]), "+f"((d)[22]), "+f"((d)[23]), \
    "+f"((d)[24]), "+f"((d)[25]), "+f"((d)[26]), "+f"((d)[27]), "+f"((d)[28]), "+f"((d)[29]), "+f"((d)[30]), "+f"((d)[31])
// The 64 f32 accumulators of an m64n128 wgmma: the operand list (%0..%63) and its constraints.
#define WGMMA_D64_REGS \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
    "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
    "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
// (each the next size's halves: d's first accumulators, then the rest from (d) + half)
#define WGMMA_D64_OUT(d) WGMMA_D32_OUT(d), WGMMA_D32_OUT((d) + 32)
#define WGMMA_D128_OUT(d) WGMMA_D64_OUT(d), WGMMA_D64_OUT((d) + 64)
// D[64 x 256] (f32, 128 registers a thread) = (scale_d ? D : 0) + A[64 x 16] * B[256 x 16]^T,
// A and B bf16 K-major from descriptors. Thread t of the warpgroup holds, for n8 block j,
// d[4j..4j+1] at row 16 (t / 32) + (t % 32) / 4, columns 8j + 2 (t % 4) + {0, 1}, and
// d[4j+2..4j+3] 8 rows below (mma.sync's C layout, a warp per 16 rows).
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], unsigned long long da, unsigned long long db,
                                                 int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " WGMMA_D128_REGS ", %128, %129, p, 1, 1, 0, 0;\n"
        "}\n"
        : WGMMA_D128_OUT(d)
        : "l"(da), "l"(db), "r"(scale_d));
}
// D[64 x 80] (40 registers a thread, wgmma_m64n256k16's layout over 10 n8 blocks) =
// (scale_d ? D : 0) + A[64 x 16] * B[80 x 16]^T, both K-major from descriptors: attn_flash4's
// key tiles of 80.
__device__ __forceinline__ void wgmma_m64n80k16(float (&d)[40], unsigned long long da, unsigned long long db,
                                                int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %42, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,"
        "%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39}, "
        "%40, %41, p, 1, 1, 0, 0;\n"
        "}\n"
        : WGMMA_D32_OUT(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),
          "+f"(d[38]), "+f"(d[39])
        : "l"(da), "l"(db), "r"(scale_d));
}
// D[64 x 64] (32 registers a thread) = (scale_d ? D : 0) + A[64 x 16] * B[64 x 16]^T in bf16,
// A from registers (wgmma_m64n256k16_rs_tb's fragment: an accumulator's two n8 blocks packed),
// B K-major from a 128-byte-swizzle descriptor.
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const unsigned (&a)[4], unsigned long long db,
                                                   int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        WGMMA_D32_REGS ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n"
        "}\n"
        : WGMMA_D32_OUT(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}
// The same at N = 128 (64 registers a thread) with B[16 x 128] N-major (wgmma_desc_sw128_mn).
__device__ __forceinline__ void wgmma_m64n128k16_rs_tb(float (&d)[64], const unsigned (&a)[4],
                                                       unsigned long long db, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        WGMMA_D64_REGS ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n"
        "}\n"
        : WGMMA_D64_OUT(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}
// D[64 x 256] = (scale_d ? D : 0) + A[64 x 16] * B, A from registers (thread t: a[0] = row 16 (t / 32) + (t % 32) / 4,
// columns 2 (t % 4) + {0, 1}; a[1] the row 8 below; a[2], a[3] the same 8 columns on: the
// accumulator layout of two n8 blocks, packed to bf16x2), B[16 x 256] N-major from a descriptor
// (wgmma_desc_sw128_mn).
__device__ __forceinline__ void wgmma_m64n256k16_rs_tb(float (&d)[128], const unsigned (&a)[4],
                                                       unsigned long long db, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " WGMMA_D128_REGS
        ", {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n"
        "}\n"
        : WGMMA_D128_OUT(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}
