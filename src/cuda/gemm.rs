//! Dense projections `y[t, n] = x[t, k] · W[n, k]ᵀ (+ y)`: bf16 in, f32 out, f32 accumulation,
//! through cuBLASLt with a plan (descriptors + algorithm) cached per shape.
//!
//! cuBLASLt rather than `cublasGemmEx` because it is where the epilogues (bias, bf16 out) and
//! the block-scaled FP8 products of the coming checkpoints live; on the H200 both run the
//! prefill projections at the same ~715 TFLOP/s (docs/DECISIONS.md).

use super::Gpu;
use anyhow::{Result, anyhow};
use cudarc::cublas::sys as cublas_sys;
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::CudaStream;
use std::collections::HashMap;
use std::sync::Mutex;

/// Plans kept at most; past that the cache starts over (prompt lengths vary without bound).
const MAX_PLANS: usize = 512;

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    n: usize,
    k: usize,
    t: usize,
    ldy: usize,
    accumulate: bool,
}

/// Row counts that share one algorithm bucket (see [`AlgoKey`]).
const SMALL_ROWS: usize = 32;

/// A product's shape apart from its row count `t`, and `t`'s bucket (four to an octave, `t`
/// rounded up to a quarter of its power of two): the algorithm chosen for the first product of a
/// bucket serves the bucket's later ones (each checked with `cublasLtMatmulAlgoCheck`), so a
/// prompt of a length near one seen before makes no heuristic searches (~15 ms a forward on the
/// H200: its ~11 shapes). Power-of-two buckets measured 3.5% slower prefill at 5,000 tokens
/// with 8,192's choice; a quarter octave keeps the rows within 25% of the chosen shape's.
/// Up to [`SMALL_ROWS`] rows (batched decode steps, chat turns' short pieces, whose products
/// read the weights and little else) the buckets are powers of two: a quarter octave there is
/// one or two lengths, and a conversation's first few requests each paid the searches again;
/// one bucket for all of them had 32-row batched decode steps run on the algorithm chosen for
/// 8 rows (lm_head 922 instead of ~250 us on the H200).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct AlgoKey {
    n: usize,
    k: usize,
    ldy: usize,
    accumulate: bool,
    bucket: usize,
}

impl AlgoKey {
    fn of(key: Key) -> Self {
        AlgoKey {
            n: key.n,
            k: key.k,
            ldy: key.ldy,
            accumulate: key.accumulate,
            bucket: if key.t <= SMALL_ROWS {
                key.t.next_power_of_two()
            } else {
                let step = (1usize << key.t.ilog2()) / 4;
                key.t.div_ceil(step) * step
            },
        }
    }
}

/// The descriptors of one shape and the algorithm chosen for it.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    w: sys::cublasLtMatrixLayout_t,
    x: sys::cublasLtMatrixLayout_t,
    y: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created by Plan::new, destroyed once.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            let _ = lt::destroy_matrix_layout(self.w);
            let _ = lt::destroy_matrix_layout(self.x);
            let _ = lt::destroy_matrix_layout(self.y);
        }
    }
}

/// cuBLASLt handle, its workspace and the plans made so far.
pub(super) struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: u64,
    workspace_bytes: usize,
    plans: Mutex<HashMap<Key, Plan>>,
    /// Algorithms by [`AlgoKey`].
    algos: Mutex<HashMap<AlgoKey, sys::cublasLtMatmulAlgo_t>>,
}

// SAFETY: the handle is used from one stream; the plan cache is behind a mutex.
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        self.plans.lock().unwrap().clear();
        // SAFETY: created in Lt::new, destroyed once, after its plans.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

fn lt_err(what: &str) -> impl FnOnce(lt::CublasError) -> anyhow::Error + '_ {
    move |e| anyhow!("cuBLASLt {what}: {e:?}")
}

impl Lt {
    /// `workspace`: device bytes the products may use (outlives the handle).
    pub(super) fn new(workspace: u64, workspace_bytes: usize) -> Result<Self> {
        Ok(Lt {
            handle: lt::create_handle().map_err(lt_err("init (libcublasLt.so)"))?,
            workspace,
            workspace_bytes,
            plans: Mutex::new(HashMap::new()),
            algos: Mutex::new(HashMap::new()),
        })
    }
}

impl Plan {
    fn new(key: Key) -> Result<Self> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        let bf16 = sys::cudaDataType::CUDA_R_16BF;
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(lt_err("matmul descriptor"))?;
        let plan = Plan {
            desc,
            // Column-major view: yᵀ [n, t] = W (k x n, transposed) · xᵀ [k, t].
            w: lt::create_matrix_layout(bf16, key.k as u64, key.n as u64, key.k as i64)
                .map_err(lt_err("layout"))?,
            x: lt::create_matrix_layout(bf16, key.k as u64, key.t as u64, key.k as i64)
                .map_err(lt_err("layout"))?,
            y: lt::create_matrix_layout(
                sys::cudaDataType::CUDA_R_32F,
                key.n as u64,
                key.t as u64,
                key.ldy as i64,
            )
            .map_err(lt_err("layout"))?,
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        let (op_t, op_n) = (
            cublas_sys::cublasOperation_t::CUBLAS_OP_T,
            cublas_sys::cublasOperation_t::CUBLAS_OP_N,
        );
        // SAFETY: the attributes are cublasOperation_t values of the documented size.
        unsafe {
            for (attr, op) in [
                (A::CUBLASLT_MATMUL_DESC_TRANSA, &op_t),
                (A::CUBLASLT_MATMUL_DESC_TRANSB, &op_n),
            ] {
                lt::set_matmul_desc_attribute(
                    plan.desc,
                    attr,
                    op as *const _ as *const _,
                    std::mem::size_of::<cublas_sys::cublasOperation_t>(),
                )
                .map_err(lt_err("descriptor attribute"))?;
            }
        }
        Ok(plan)
    }

    /// cuBLASLt's first choice of algorithm for this plan.
    fn heuristic(&self, lt: &Lt) -> Result<sys::cublasLtMatmulAlgo_t> {
        let pref = lt::create_matmul_pref().map_err(lt_err("preference"))?;
        let bytes = lt.workspace_bytes as u64;
        // SAFETY: a plain-old-data result slot, filled by the call below.
        let mut found: [sys::cublasLtMatmulHeuristicResult_t; 1] = unsafe { std::mem::zeroed() };
        let mut count = 0;
        // SAFETY: the descriptors are live; `found` has room for the results asked for.
        let r = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &bytes as *const u64 as *const _,
                8,
            )
            .and_then(|_| {
                sys::cublasLtMatmulAlgoGetHeuristic(
                    lt.handle,
                    self.desc,
                    self.w,
                    self.x,
                    self.y,
                    self.y,
                    pref,
                    1,
                    found.as_mut_ptr(),
                    &mut count,
                )
                .result()
            })
        };
        // SAFETY: created above.
        unsafe {
            let _ = lt::destroy_matmul_pref(pref);
        }
        r.map_err(lt_err("heuristic"))?;
        let found = &found[0];
        if count < 1 || found.state != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(anyhow!("cuBLASLt has no algorithm for this product"));
        }
        Ok(found.algo)
    }

    /// Whether `algo` runs this plan's product (with the workspace `lt` has).
    fn supports(&self, lt: &Lt, algo: &sys::cublasLtMatmulAlgo_t) -> bool {
        // SAFETY: a plain-old-data result slot, filled by the call below.
        let mut result: sys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        // SAFETY: the descriptors are live; `algo` and `result` are valid for the call.
        let r = unsafe {
            sys::cublasLtMatmulAlgoCheck(
                lt.handle,
                self.desc,
                self.w,
                self.x,
                self.y,
                self.y,
                algo,
                &mut result,
            )
        };
        r == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && result.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && result.workspaceSize <= lt.workspace_bytes
    }

    /// The algorithm for this plan: its bucket's (see [`AlgoKey`]) where that one runs it, else
    /// a heuristic search (remembered for the bucket).
    fn choose_algo(&self, lt: &Lt, key: Key) -> Result<sys::cublasLtMatmulAlgo_t> {
        let mut algos = lt.algos.lock().unwrap();
        let ak = AlgoKey::of(key);
        if let Some(algo) = algos.get(&ak)
            && self.supports(lt, algo)
        {
            return Ok(*algo);
        }
        let algo = self.heuristic(lt)?;
        algos.insert(ak, algo);
        Ok(algo)
    }
}

impl Gpu {
    /// `y[t, n] = beta * y + x[t, k] · W[n, k]ᵀ`: W and x bf16 row-major, y f32 with row
    /// stride `ldy`, f32 accumulation; `beta` is 0 or 1 (1 adds into y, e.g. the residual).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        w: u64,
        n: usize,
        k: usize,
        x: u64,
        t: usize,
        y: u64,
        ldy: usize,
        beta: f32,
    ) -> Result<()> {
        self.gemm_on(false, w, n, k, x, t, y, ldy, beta)
    }

    /// [`Gpu::gemm`] on the second stream (after [`Gpu::fork_aux`]): cuBLASLt with that
    /// stream's own workspace.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_aux(
        &self,
        w: u64,
        n: usize,
        k: usize,
        x: u64,
        t: usize,
        y: u64,
        ldy: usize,
        beta: f32,
    ) -> Result<()> {
        self.gemm_on(true, w, n, k, x, t, y, ldy, beta)
    }

    /// [`Gpu::gemm`] on the second stream when `aux`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_on(
        &self,
        aux: bool,
        w: u64,
        n: usize,
        k: usize,
        x: u64,
        t: usize,
        y: u64,
        ldy: usize,
        beta: f32,
    ) -> Result<()> {
        let key = Key {
            n,
            k,
            t,
            ldy,
            accumulate: beta != 0.0,
        };
        let (stream, lt) = if aux {
            (&*self.aux, &self.aux_lt)
        } else {
            self.main_tail_not_kernel();
            (&*self.stream, &self.lt)
        };
        self.timed(
            stream,
            || format!("gemm {n}x{k} t={t}{}", if aux { " (aux)" } else { "" }),
            || self.lt_matmul(lt, stream, key, w, x, y, beta),
        )
        .map_err(|e| anyhow!("GEMM [{t}x{k}]·[{n}x{k}]ᵀ: {e:#}"))
    }

    #[allow(clippy::too_many_arguments)]
    fn lt_matmul(
        &self,
        lt: &Lt,
        stream: &CudaStream,
        key: Key,
        w: u64,
        x: u64,
        y: u64,
        beta: f32,
    ) -> Result<()> {
        let mut plans = lt.plans.lock().unwrap();
        if !plans.contains_key(&key) {
            if plans.len() >= MAX_PLANS {
                plans.clear();
            }
            let mut plan = Plan::new(key)?;
            plan.algo = plan.choose_algo(lt, key)?;
            plans.insert(key, plan);
        }
        let plan = &plans[&key];
        let alpha = 1.0f32;
        // SAFETY: the plan's layouts describe these device buffers; the workspace is ours.
        unsafe {
            lt::matmul(
                lt.handle,
                plan.desc,
                &alpha as *const f32 as *const _,
                &beta as *const f32 as *const _,
                w as *const _,
                plan.w,
                x as *const _,
                plan.x,
                y as *const _,
                plan.y,
                y as *mut _,
                plan.y,
                &plan.algo,
                lt.workspace as *mut _,
                lt.workspace_bytes,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(lt_err("matmul"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_buckets_are_powers_of_two_then_quarter_octaves() {
        let bucket = |t| {
            AlgoKey::of(Key {
                n: 8,
                k: 8,
                t,
                ldy: 8,
                accumulate: false,
            })
            .bucket
        };
        let got: Vec<usize> = [1, 3, 7, 32, 33, 65, 70, 80, 81, 200, 256, 5000, 8192, 8193]
            .into_iter()
            .map(bucket)
            .collect();
        assert_eq!(
            got,
            [1, 4, 8, 32, 40, 80, 80, 80, 96, 224, 256, 5120, 8192, 10240]
        );
        // up to 32 rows powers of two; above, every t at most 25% below its bucket; and a
        // bucket's own t maps to itself
        for t in 1..20_000 {
            let b = bucket(t);
            let near = if t <= SMALL_ROWS {
                b.is_power_of_two() && b >= t && b < 2 * t
            } else {
                b >= t && b * 4 <= t * 5 + 4
            };
            assert!(near && bucket(b) == b, "t {t} -> {b}");
        }
    }
}
