//! CUDA backend for NVIDIA Hopper: the device, run-time compiled kernels (NVRTC, cached on
//! disk by source hash and arch), cuBLAS for dense products, and device buffers.
//!
//! Everything loads dynamically (cudarc), so the crate builds and its CPU tests run on
//! machines without CUDA; `Gpu::open` says clearly why a GPU cannot be used.

pub mod attention;
pub mod gdn;
pub mod gemm;
pub mod model;
pub mod moe;

use anyhow::{Context, Result, anyhow, bail};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, result};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// The kernel sources, one file per op family, compiled as one module.
const SOURCES: [(&str, &str); 7] = [
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("misc.cu", include_str!("kernels/misc.cu")),
    ("norm.cu", include_str!("kernels/norm.cu")),
    ("gemv.cu", include_str!("kernels/gemv.cu")),
    ("gdn.cu", include_str!("kernels/gdn.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("moe.cu", include_str!("kernels/moe.cu")),
];

/// Every kernel the backend launches, besides `gdn::CHUNK_KERNELS`.
const KERNELS: &[&str] = &[
    "embed_gather",
    "f32_to_bf16",
    "fill_random_bf16",
    "fill_random_f32",
    "copy_probe",
    "read_probe",
    "window_probe",
    "grid_barrier_probe",
    "gdn_phase_read",
    "gemv_dec",
    "gemv_dec_w",
    "gemv_dec_stream",
    "rmsnorm_zc_bf16",
    "gdn_conv",
    "gdn_qk_l2norm",
    "gdn_gates",
    "gdn_recurrent_16",
    "gdn_recurrent_32",
    "gdn_recurrent_64",
    "gdn_recurrent_128",
    "gdn_conv_prefill",
    "gdn_conv_advance",
    "gdn_gated_norm",
    "gdn_conv_dec",
    "gdn_step_dec_16",
    "gdn_step_dec_32",
    "gdn_step_dec_64",
    "gdn_step_dec_128",
    "gdn_convstep_dec_16",
    "gdn_convstep_dec_32",
    "gdn_convstep_dec_64",
    "gdn_convstep_dec_128",
    "gdn_convstep_dec_cl2_16",
    "gdn_convstep_dec_cl2_32",
    "gdn_convstep_dec_cl2_64",
    "gdn_convstep_dec_cl2_128",
    "attn_prep",
    "attn_prep_rows",
    "attn_split",
    "attn_combine",
    "attn_combine_dec",
    "attn_flash",
    "attn_flash2_hd32",
    "attn_flash2_hd64",
    "attn_flash2_hd128",
    "attn_flash2_hd256",
    "attn_flash3_hd32",
    "attn_flash3_hd64",
    "attn_flash3_hd128",
    "attn_flash3_hd256",
    "attn_flash4_hd256",
    "attn_flash4c2_hd256",
    "attn_flash4c4_hd256",
    "attn_decode_mma_hd32",
    "attn_decode_mma_hd64",
    "attn_decode_mma_hd128",
    "attn_decode_mma_hd256",
    "attn_decode",
    "moe_route",
    "moe_plan",
    "moe_scatter",
    "moe_gemm",
    "moe_gemm2",
    "moe_gemm3_m128",
    "moe_gemm3_m64",
    "moe_gemm3_swiglu_m128",
    "moe_gemm3_swiglu_m64",
    "moe_gemm4_m128",
    "moe_gemm4_m64",
    "moe_gemm4_swiglu_m128",
    "moe_gemm4_swiglu_m64",
    "moe_gemm5_m128",
    "moe_gemm5_swiglu_m128",
    "moe_gemm6_m128",
    "moe_gemm6_m128_bf16",
    "moe_gemm6_swiglu_m128",
    "moe_gemm7_m256",
    "moe_gemm7_m256_bf16",
    "moe_gemm7_swiglu_m256",
    "moe_gemm7_m128",
    "moe_gemm7_m128_bf16",
    "moe_gemm7_swiglu_m128",
    "moe_gemv",
    "swiglu_bf16",
    "moe_combine",
    "moe_combine_bf16",
    "moe_router_dec",
    "moe_gate_up_dec",
    "moe_down_dec",
    "trace_set",
];

/// Threads for `n` lanes of work: whole warps, at most 1024.
pub(crate) fn block_threads(n: usize) -> u32 {
    n.div_ceil(32).clamp(1, 32) as u32 * 32
}

/// Bytes of cuBLASLt's workspace (NVIDIA's advice for Hopper).
pub const GEMM_WORKSPACE_BYTES: usize = 32 << 20;

/// A raw device allocation, freed on drop.
pub struct DeviceBuf {
    pub ptr: u64,
    pub bytes: usize,
    ctx: Arc<CudaContext>,
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        if self.ptr != 0 {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: ptr came from malloc_sync and is freed once.
            unsafe {
                let _ = result::free_sync(self.ptr);
            }
        }
    }
}

/// A tiled tensor map (`cuTensorMapEncodeTiled`) over the bf16 tensor at device address `base`:
/// `dims` elements per dimension (innermost first), `strides` the byte strides of the outer
/// dimensions, `boxes` the box a copy moves, in the 128-byte swizzle that wgmma's descriptors read
/// (innermost box 64 bf16), elements outside the tensor zero. `what` names it in errors.
pub fn tensor_map_bf16(
    base: u64,
    dims: &[u64],
    strides: &[u64],
    boxes: &[u32],
    what: &str,
) -> Result<[u64; 16]> {
    use cudarc::driver::sys;
    let rank = dims.len();
    if !(2..=5).contains(&rank) || strides.len() + 1 != rank || boxes.len() != rank {
        bail!("tensor map for {what}: inconsistent ranks");
    }
    if !base.is_multiple_of(16) || strides.iter().any(|s| !s.is_multiple_of(16)) {
        bail!("tensor map for {what}: the base and strides must be multiples of 16 bytes");
    }
    // SAFETY: plain data, filled by the driver below.
    let mut map: sys::CUtensorMap = unsafe { std::mem::zeroed() };
    let steps = [1u32; 5];
    // SAFETY: dims, boxes and steps have `rank` entries, strides `rank - 1`; `base` is a device
    // allocation the caller keeps alive while the map is used.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            rank as u32,
            base as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()
    .map_err(|e| anyhow!("cuTensorMapEncodeTiled ({what}): {e:?}"))?;
    Ok(map.opaque)
}

/// A kernel argument.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    Ptr(u64),
    I(i32),
    F(f32),
    U(u64),
    /// A 128-byte parameter passed by value (a `CUtensorMap`, the kernels' `TmaParam`).
    Map([u64; 16]),
}

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// cuBLASLt with its plans (`gemm.rs`), and how `gemm` runs (`KESTREL_GEMM`).
    lt: gemm::Lt,
    /// A second, higher-priority stream for work that can run beside the main stream's (in
    /// prefill: the shared expert beside the routed experts, the attention k and v products
    /// (and with `KESTREL_GDN_INPROJ=split` the GDN z and b|a) beside the main in-projection),
    /// with its own cuBLASLt handle and
    /// workspace; [`Gpu::fork_aux`] and [`Gpu::join_aux`] order it against the main stream
    /// (every fork is joined in the same layer, before the main stream reads the results).
    aux: Arc<CudaStream>,
    aux_lt: gemm::Lt,
    fork_event: cudarc::driver::CudaEvent,
    join_event: cudarc::driver::CudaEvent,
    _aux_gemm_workspace: DeviceBuf,
    gemm_path: std::sync::Mutex<gemm::GemmPath>,
    /// cuBLASLt's workspace (declared after `lt`, so dropped after it).
    _gemm_workspace: DeviceBuf,
    functions: std::collections::HashMap<&'static str, CudaFunction>,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_memory: usize,
    /// With `KESTREL_PROFILE=1`: per-op (calls, seconds), each op timed on the GPU by a pair
    /// of CUDA events (no host syncs in between, so launch gaps are not counted).
    profile: Option<std::sync::Mutex<Profile>>,
    /// Shared memory a block may opt into (bytes).
    pub max_smem_per_block: usize,
    /// Streaming multiprocessors (the persistent kernels' grid).
    pub sm_count: usize,
    /// Clusters of a persistent cluster kernel that fit on the GPU at once, by kernel
    /// ([`Gpu::max_active_clusters`]).
    active_clusters: std::sync::Mutex<std::collections::HashMap<&'static str, u32>>,
    /// Programmatic dependent launch for the prefill kernels ([`Gpu::launch_dep`]): on
    /// compute capability 9.0 and not while profiling; `KESTREL_PREFILL_PDL=0` turns it off.
    prefill_pdl: bool,
    /// The chunked delta rule's state pass on wgmma (`gdn_chunk_state_wg`, dk 64 or 128; where
    /// `gdn_state_t64` does not take the shape): on compute capability 9.0 (the sm_90a build);
    /// `KESTREL_GDN_STATE=mma` keeps the mma.sync kernel (`gdn_chunk_state`). Atomic (as the
    /// other kernel choices) so that tests can compare them on one `Gpu`.
    pub gdn_state_wg: std::sync::atomic::AtomicBool,
    /// The chunked delta rule's state pass with Sᵀ as the wgmma A operand
    /// (`gdn_chunk_state_t64`, dk = 128; takes precedence over `gdn_state_wg`): on compute
    /// capability 9.0; `KESTREL_GDN_STATE=wg` keeps `gdn_chunk_state_wg`, `=mma` the mma.sync
    /// kernel.
    pub gdn_state_t64: std::sync::atomic::AtomicBool,
    /// The chunked delta rule's prep on wgmma (`gdn_chunk_prep_wg`, dk = dv = 128): opt-in on
    /// compute capability 9.0 with `KESTREL_GDN_PREP=wg` (measured no faster yet than the
    /// mma.sync kernel, `gdn_chunk_prep`, the default; docs/KERNELS.md).
    pub gdn_prep_wg: std::sync::atomic::AtomicBool,
    /// Compute capability 9.0: the kernels are compiled for sm_90a (wgmma, setmaxnreg).
    pub sm90a: bool,
    /// Whether the last thing enqueued on the main stream was one of our kernels: only after
    /// one does [`Gpu::launch_dep`] let the next start early (after a cuBLAS call, a copy, a
    /// memset or an event it launches normally).
    main_tail_is_kernel: std::sync::atomic::AtomicBool,
}

/// Per-op GPU times: events still in flight, and the totals of resolved ones.
#[derive(Default)]
struct Profile {
    pending: Vec<(String, cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>,
    totals: std::collections::BTreeMap<String, OpTime>,
}

/// One op's profile: calls, total seconds, and the fastest and slowest call.
#[derive(Clone, Debug)]
pub struct OpTime {
    pub op: String,
    pub calls: u64,
    pub seconds: f64,
    pub min: f64,
    pub max: f64,
}

impl Profile {
    /// Waits for the pending events and adds their times to the totals.
    fn resolve(&mut self) -> Result<()> {
        for (name, start, end) in self.pending.drain(..) {
            let ms = start
                .elapsed_ms(&end)
                .map_err(|e| anyhow!("profile event: {e:?}"))?;
            let secs = ms as f64 / 1e3;
            let e = self.totals.entry(name.clone()).or_insert(OpTime {
                op: name,
                calls: 0,
                seconds: 0.0,
                min: f64::INFINITY,
                max: 0.0,
            });
            e.calls += 1;
            e.seconds += secs;
            e.min = e.min.min(secs);
            e.max = e.max.max(secs);
        }
        Ok(())
    }
}

fn cuda_include_dir() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(v) = std::env::var(var) {
            candidates.push(PathBuf::from(v).join("include"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    candidates
        .into_iter()
        .find(|p| p.join("cuda_bf16.h").exists())
}

fn fnv1a64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in *p {
            h ^= *b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn kernel_cache_dir() -> PathBuf {
    if let Ok(d) = std::env::var("KESTREL_CACHE_DIR") {
        return PathBuf::from(d).join("kernels");
    }
    let base = std::env::var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|_| std::env::var("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|_| std::env::temp_dir());
    base.join("kestrel").join("kernels")
}

/// The kernels as PTX for `arch` (e.g. `compute_90a`): from the disk cache (keyed by source
/// hash and arch) or compiled with NVRTC. Needs no GPU, only libnvrtc and the CUDA headers.
pub fn kernel_ptx(arch: &'static str, use_cache: bool) -> Result<cudarc::nvrtc::Ptx> {
    let mut src = String::new();
    for (name, text) in SOURCES {
        src.push_str(&format!("// ---- {name}\n"));
        src.push_str(text);
        src.push('\n');
    }
    let src = src.replace("#include <cuda_bf16.h>\n#include <mma.h>\n", "");
    // KESTREL_KERNEL_DEFINES="A B=1": preprocessor defines for kernel A/B runs (part of the hash).
    let defines: String = std::env::var("KESTREL_KERNEL_DEFINES")
        .unwrap_or_default()
        .split_whitespace()
        .map(|d| format!("#define {}\n", d.replacen('=', " ", 1)))
        .collect();
    let src = format!("#include <cuda_bf16.h>\n#include <mma.h>\n{defines}{src}");
    let hash = fnv1a64(&[src.as_bytes(), arch.as_bytes(), b"v1 -O3 std=c++17"]);
    let cache = kernel_cache_dir().join(format!("{hash:016x}-{arch}.ptx"));
    let cached = if use_cache {
        std::fs::read_to_string(&cache).ok()
    } else {
        None
    };
    let ptx = if let Some(text) = cached {
        tracing::debug!("kernels from cache {}", cache.display());
        cudarc::nvrtc::Ptx::from_src(text)
    } else {
        let include = cuda_include_dir().ok_or_else(|| {
            anyhow!(
                "cannot find the CUDA headers (cuda_bf16.h) that NVRTC needs: set CUDA_HOME or CUDA_PATH, or install them under /usr/local/cuda/include"
            )
        })?;
        let opts = cudarc::nvrtc::CompileOptions {
            arch: Some(arch),
            include_paths: vec![include.display().to_string()],
            options: vec!["--std=c++17".into(), "-default-device".into()],
            ..Default::default()
        };
        let t0 = std::time::Instant::now();
        let ptx = quiet_catch(|| cudarc::nvrtc::compile_ptx_with_opts(&src, opts))
            .ok_or_else(|| anyhow!("NVRTC could not be loaded (libnvrtc.so)"))?
            .map_err(|e| match e {
                cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                    anyhow!("kernel compilation failed:\n{}", log.to_string_lossy())
                }
                other => anyhow!("kernel compilation failed: {other:?}"),
            })?;
        tracing::info!("compiled kernels for {arch} in {:?}", t0.elapsed());
        let text = ptx.to_src();
        if let Some(dir) = cache.parent() {
            let _ = std::fs::create_dir_all(dir);
            let _ = std::fs::write(&cache, &text);
        }
        ptx
    };
    Ok(ptx)
}

/// Runs `f`, turning a panic (cudarc panics when a CUDA library cannot be loaded) into
/// `None` without printing the panic message.
fn quiet_catch<T>(f: impl FnOnce() -> T + std::panic::UnwindSafe) -> Option<T> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(f).ok();
    std::panic::set_hook(hook);
    r
}

impl Gpu {
    /// Opens GPU `ordinal`, checks it is Hopper-class, and compiles (or loads cached) kernels.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        let ctx = quiet_catch(|| CudaContext::new(ordinal))
            .ok_or_else(|| {
                anyhow!("CUDA is not available: the CUDA driver library (libcuda.so) could not be loaded")
            })?
            .map_err(|e| anyhow!("CUDA is not available: cannot open GPU {ordinal}: {e:?}"))?;
        // We order everything on one stream ourselves.
        // SAFETY: all work of this backend runs on `stream`.
        unsafe { ctx.disable_event_tracking() };
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let cc = ctx
            .compute_capability()
            .map_err(|e| anyhow!("cannot query the GPU: {e:?}"))?;
        if cc.0 != 9 {
            bail!(
                "GPU {ordinal} is {name} (compute capability {}.{}); Kestrel's CUDA backend needs a Hopper-class GPU (H100/H200, compute capability 9.0)",
                cc.0,
                cc.1
            );
        }
        let total_memory = ctx.total_mem().unwrap_or(0);
        // A created stream, not the legacy default one, which cannot be captured into graphs.
        let stream = ctx
            .new_stream()
            .map_err(|e| anyhow!("cannot create a CUDA stream: {e:?}"))?;
        let blas = quiet_catch(|| CudaBlas::new(stream.clone()))
            .ok_or_else(|| anyhow!("cuBLAS could not be loaded (libcublas.so)"))?
            .map_err(|e| anyhow!("cuBLAS init failed: {e:?}"))?;
        let gemm_path = gemm::GemmPath::from_env()?;
        let gemm_workspace = Self::alloc_in(&ctx, GEMM_WORKSPACE_BYTES)
            .context("allocating cuBLASLt's workspace")?;
        let lt = gemm::Lt::new(gemm_workspace.ptr, gemm_workspace.bytes)?;
        let (_, highest) = cudarc::driver::result::stream::get_priority_range()
            .map_err(|e| anyhow!("cannot query stream priorities: {e:?}"))?;
        let aux = ctx
            .new_stream_with_priority(highest)
            .map_err(|e| anyhow!("cannot create a CUDA stream: {e:?}"))?;
        let aux_gemm_workspace = Self::alloc_in(&ctx, GEMM_WORKSPACE_BYTES)
            .context("allocating the second stream's cuBLASLt workspace")?;
        let aux_lt = gemm::Lt::new(aux_gemm_workspace.ptr, aux_gemm_workspace.bytes)?;
        let event = || {
            ctx.new_event(None)
                .map_err(|e| anyhow!("cannot create a CUDA event: {e:?}"))
        };
        let (fork_event, join_event) = (event()?, event()?);
        let max_smem_per_block = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(|e| anyhow!("cannot query the GPU: {e:?}"))? as usize;
        let sm_count = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| anyhow!("cannot query the GPU: {e:?}"))? as usize;
        let module = Self::compile(&ctx, cc)?;
        let mut functions = std::collections::HashMap::new();
        for k in KERNELS.iter().chain(&gdn::CHUNK_KERNELS) {
            let f = module
                .load_function(k)
                .map_err(|e| anyhow!("kernel {k} missing from the module: {e:?}"))?;
            functions.insert(*k, f);
        }
        let profile = std::env::var("KESTREL_PROFILE")
            .ok()
            .map(|_| std::sync::Mutex::new(Profile::default()));
        let gpu = Gpu {
            ctx,
            stream,
            blas,
            lt,
            aux,
            aux_lt,
            fork_event,
            join_event,
            _aux_gemm_workspace: aux_gemm_workspace,
            gemm_path: std::sync::Mutex::new(gemm_path),
            _gemm_workspace: gemm_workspace,
            functions,
            name,
            compute_capability: cc,
            total_memory,
            max_smem_per_block,
            sm_count,
            active_clusters: Default::default(),
            // the profile's events around each launch would sit between the two kernels
            prefill_pdl: cc >= (9, 0)
                && profile.is_none()
                && std::env::var("KESTREL_PREFILL_PDL").map_or(true, |v| v != "0"),
            gdn_state_wg: (cc == (9, 0)
                && std::env::var("KESTREL_GDN_STATE").map_or(true, |v| v != "mma"))
            .into(),
            gdn_state_t64: (cc == (9, 0)
                && std::env::var("KESTREL_GDN_STATE").map_or(true, |v| v != "mma" && v != "wg"))
            .into(),
            gdn_prep_wg: (cc == (9, 0)
                && std::env::var("KESTREL_GDN_PREP").is_ok_and(|v| v == "wg"))
            .into(),
            sm90a: cc == (9, 0),
            profile,
            main_tail_is_kernel: Default::default(),
        };
        // The chunked GDN kernels need more than the default 48 KiB, how much depends on the
        // shape (GdnShape::chunked_fits checks it against this limit).
        for k in gdn::CHUNK_KERNELS {
            gpu.set_max_dynamic_smem(k, max_smem_per_block)?;
        }
        for (k, bytes) in attention::FLASH_KERNELS
            .into_iter()
            .chain(attention::DECODE_KERNELS)
            .chain(moe::GEMM3_KERNELS)
            .chain(moe::GEMM4_KERNELS)
            .chain(moe::GEMM5_KERNELS)
            .chain(moe::GEMM6_KERNELS)
        {
            gpu.set_max_dynamic_smem(k, bytes)?;
        }
        Ok(Arc::new(gpu))
    }

    fn compile(ctx: &Arc<CudaContext>, cc: (i32, i32)) -> Result<Arc<cudarc::driver::CudaModule>> {
        let arch: &'static str = if cc == (9, 0) {
            "compute_90a"
        } else {
            "compute_90"
        };
        let ptx = kernel_ptx(arch, true)?;
        ctx.load_module(ptx)
            .map_err(|e| anyhow!("loading the kernel module failed: {e:?}"))
    }

    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| anyhow!("CUDA bind: {e:?}"))
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(|e| anyhow!("cuMemGetInfo: {e:?}"))
    }

    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuf> {
        self.bind()?;
        Self::alloc_in(&self.ctx, bytes)
    }

    fn alloc_in(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DeviceBuf> {
        let ptr = if bytes == 0 {
            0
        } else {
            // SAFETY: plain device allocation; freed by DeviceBuf::drop.
            unsafe { result::malloc_sync(bytes) }.map_err(|e| {
                anyhow!(
                    "GPU out of memory allocating {:.2} GiB: {e:?}",
                    bytes as f64 / (1u64 << 30) as f64
                )
            })?
        };
        Ok(DeviceBuf {
            ptr,
            bytes,
            ctx: ctx.clone(),
        })
    }

    pub fn alloc_zeroed(&self, bytes: usize) -> Result<DeviceBuf> {
        let b = self.alloc(bytes)?;
        self.memset_zero(b.ptr, bytes)?;
        Ok(b)
    }

    pub fn memset_zero(&self, ptr: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.main_tail_not_kernel();
        // SAFETY: ptr..ptr+bytes lies in one of our allocations.
        unsafe { result::memset_d8_async(ptr, 0, bytes, self.stream.cu_stream()) }
            .map_err(|e| anyhow!("memset: {e:?}"))
    }

    pub fn upload<T: Copy>(&self, data: &[T]) -> Result<DeviceBuf> {
        let b = self.alloc(std::mem::size_of_val(data))?;
        self.copy_to_device(b.ptr, data)?;
        Ok(b)
    }

    pub fn copy_to_device<T: Copy>(&self, dst: u64, data: &[T]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        self.main_tail_not_kernel();
        // SAFETY: dst has room for data (caller's allocation). From pageable memory the call
        // returns once the source has been staged, so `data` may be dropped right after.
        unsafe { result::memcpy_htod_async(dst, data, self.stream.cu_stream()) }
            .map_err(|e| anyhow!("host-to-device copy: {e:?}"))
    }

    pub fn copy_to_host<T: Copy>(&self, src: u64, out: &mut [T]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: src holds at least out.len() elements.
        unsafe { result::memcpy_dtoh_async(out, src, self.stream.cu_stream()) }
            .map_err(|e| anyhow!("device-to-host copy: {e:?}"))?;
        self.sync()
    }

    pub fn copy_device(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.main_tail_not_kernel();
        // SAFETY: both ranges lie in our allocations and do not overlap.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(|e| anyhow!("device copy: {e:?}"))
    }

    pub fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| anyhow!("CUDA error (a kernel failed?): {e:?}"))
    }

    /// Whether per-op profiling (`KESTREL_PROFILE`) is on: it syncs after every op, so
    /// nothing can be captured into a CUDA graph.
    pub fn profiling(&self) -> bool {
        self.profile.is_some()
    }

    /// Records the launches `f` makes on the stream into a CUDA graph (nothing runs).
    pub fn capture(&self, f: impl FnOnce() -> Result<()>) -> Result<cudarc::driver::CudaGraph> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| anyhow!("CUDA graph capture: {e:?}"))?;
        let recorded = f();
        // End the capture even when recording failed, so the stream is usable again.
        let graph = self
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(|e| anyhow!("CUDA graph instantiate: {e:?}"));
        recorded?;
        graph?.ok_or_else(|| anyhow!("CUDA graph capture recorded nothing"))
    }

    /// Runs `f`, which enqueues work on `stream`; with `KESTREL_PROFILE` timed there by a pair
    /// of events under `name`.
    fn timed<T>(
        &self,
        stream: &CudaStream,
        name: impl FnOnce() -> String,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let Some(p) = &self.profile else { return f() };
        let event = || {
            self.ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| anyhow!("profile event: {e:?}"))
        };
        let (start, end) = (event()?, event()?);
        start
            .record(stream)
            .map_err(|e| anyhow!("profile event: {e:?}"))?;
        let r = f()?;
        end.record(stream)
            .map_err(|e| anyhow!("profile event: {e:?}"))?;
        let mut m = p.lock().unwrap();
        m.pending.push((name(), start, end));
        if m.pending.len() >= 8192 {
            m.resolve()?;
        }
        Ok(r)
    }

    /// The profile collected so far, most expensive op first; then reset.
    pub fn take_profile(&self) -> Vec<OpTime> {
        let Some(p) = &self.profile else {
            return Vec::new();
        };
        let mut m = p.lock().unwrap();
        if let Err(e) = m.resolve() {
            tracing::warn!("profile incomplete: {e:#}");
        }
        let mut v: Vec<OpTime> = std::mem::take(&mut m.totals).into_values().collect();
        v.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        v
    }

    /// Lets `name` use up to `bytes` of dynamic shared memory (above the 48 KiB default).
    pub fn set_max_dynamic_smem(&self, name: &str, bytes: usize) -> Result<()> {
        let f = self
            .functions
            .get(name)
            .ok_or_else(|| anyhow!("unknown kernel {name}"))?;
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(|e| anyhow!("cannot give {name} {bytes} bytes of shared memory: {e:?}"))
    }

    /// Launches `name` on the stream.
    pub fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_ex(name, grid, block, smem, args, false)
    }

    /// [`Gpu::launch`], with programmatic dependent launch when `pdl` is set: the kernel may
    /// begin while the previous kernel on the stream is still running (its blocks wait in
    /// `griddep_wait`, see common.cuh, before touching what earlier kernels write). Captured
    /// graphs keep it.
    pub fn launch_ex(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
        pdl: bool,
    ) -> Result<()> {
        self.launch_on(&self.stream, name, grid, block, smem, args, pdl)
    }

    /// [`Gpu::launch`] for a prefill kernel (one that starts with `PREFILL_KERNEL()`,
    /// common.cuh) on the main stream: with programmatic dependent launch when the previous
    /// op there was one of our kernels, so this one's blocks take the SMs that kernel's last
    /// wave leaves and wait in `griddep_wait` instead of after a launch latency.
    pub fn launch_dep(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        let pdl = self.prefill_pdl && self.main_tail_is_kernel.load(Ordering::Relaxed);
        self.launch_on(&self.stream, name, grid, block, smem, args, pdl)
    }

    /// Something other than our kernel (a copy, memset, event wait or cuBLAS call) was
    /// enqueued on the main stream: the next [`Gpu::launch_dep`] launches normally.
    pub(crate) fn main_tail_not_kernel(&self) {
        self.main_tail_is_kernel.store(false, Ordering::Relaxed);
    }

    /// The main stream, or with `aux` the second one (after [`Gpu::fork_aux`];
    /// [`Gpu::join_aux`] before the main stream reads what it wrote).
    pub(super) fn stream_of(&self, aux: bool) -> &CudaStream {
        if aux { &self.aux } else { &self.stream }
    }

    /// The second stream waits for everything enqueued on the main stream so far.
    pub fn fork_aux(&self) -> Result<()> {
        self.main_tail_not_kernel();
        self.fork_event
            .record(&self.stream)
            .and_then(|_| self.aux.wait(&self.fork_event))
            .map_err(|e| anyhow!("ordering the second stream: {e:?}"))
    }

    /// The main stream waits for everything enqueued on the second stream so far.
    pub fn join_aux(&self) -> Result<()> {
        self.main_tail_not_kernel();
        self.join_event
            .record(&self.aux)
            .and_then(|_| self.stream.wait(&self.join_event))
            .map_err(|e| anyhow!("joining the second stream: {e:?}"))
    }

    /// How many clusters of kernel `name` (compile-time cluster dims) with `block` threads and
    /// `smem` bytes of dynamic shared memory can run at once: a persistent cluster kernel's grid
    /// (one larger than this runs its last clusters after the others, which with items
    /// assigned by cluster index doubles their time). Cached per kernel.
    pub fn max_active_clusters(
        &self,
        name: &str,
        block: u32,
        smem: u32,
        cluster: u32,
    ) -> Result<u32> {
        use cudarc::driver::sys;
        let (key, f) = self
            .functions
            .get_key_value(name)
            .ok_or_else(|| anyhow!("unknown kernel {name}"))?;
        if let Some(&n) = self.active_clusters.lock().unwrap().get(key) {
            return Ok(n);
        }
        let cfg = sys::CUlaunchConfig {
            gridDimX: cluster * self.sm_count as u32,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: std::ptr::null_mut(),
            numAttrs: 0,
        };
        let mut n = 0i32;
        // SAFETY: `cfg` describes a launch of `f`; `n` receives the count.
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f.cu_function(), &cfg) }
            .result()
            .map_err(|e| anyhow!("{name}: cuOccupancyMaxActiveClusters: {e:?}"))?;
        if n < 1 {
            bail!("{name}: no cluster of {cluster} blocks fits on this GPU");
        }
        self.active_clusters.lock().unwrap().insert(key, n as u32);
        Ok(n as u32)
    }

    /// [`Gpu::launch_ex`] on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_on(
        &self,
        stream: &CudaStream,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
        pdl: bool,
    ) -> Result<()> {
        use cudarc::driver::sys;
        if skip_launch(name, grid.0) {
            return Ok(());
        }
        let f = self
            .functions
            .get(name)
            .ok_or_else(|| anyhow!("unknown kernel {name}"))?;
        // Each argument in an 8-byte slot on the stack (no allocation per launch); the driver
        // reads the parameter's own size from its start, which on little-endian hosts is the
        // value for 4-byte ints and floats too.
        const MAX_ARGS: usize = 24;
        if args.len() > MAX_ARGS {
            bail!("{name}: {} arguments, at most {MAX_ARGS}", args.len());
        }
        let mut slots = [0u64; MAX_ARGS];
        for (slot, a) in slots.iter_mut().zip(args) {
            *slot = match a {
                Arg::Ptr(p) | Arg::U(p) => *p,
                Arg::I(i) => *i as u32 as u64,
                Arg::F(x) => x.to_bits() as u64,
                Arg::Map(_) => 0,
            };
        }
        let mut params = [std::ptr::null_mut::<std::ffi::c_void>(); MAX_ARGS];
        for ((p, v), a) in params.iter_mut().zip(slots.iter_mut()).zip(args) {
            *p = match a {
                // the driver copies the parameter's 128 bytes from `args`, borrowed for the call
                Arg::Map(m) => m.as_ptr() as *mut std::ffi::c_void,
                _ => v as *mut u64 as *mut std::ffi::c_void,
            };
        }
        // SAFETY: a zeroed attribute is valid plain data; we set its id and value.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: pdl as u32,
        };
        self.timed(
            stream,
            || format!("{name} {}x{}x{}", grid.0, grid.1, grid.2),
            || {
                // SAFETY: argument lists match the kernels' signatures (checked by the GPU
                // tests); `slots`, `params` and `attr` outlive the call.
                unsafe {
                    sys::cuLaunchKernelEx(
                        &cfg,
                        f.cu_function(),
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                }
                .result()
                .with_context(|| format!("launching {name}"))
            },
        )?;
        if std::ptr::eq(stream, &*self.stream) {
            self.main_tail_is_kernel.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Fills `n` values at `ptr` (bf16, or f32 when `f32` is set) with seeded
    /// approximately-normal numbers `mean + std * N(0, 1)`.
    pub fn fill_random(
        &self,
        ptr: u64,
        n: usize,
        f32: bool,
        seed: u64,
        mean: f32,
        std: f32,
    ) -> Result<()> {
        let kernel = if f32 {
            "fill_random_f32"
        } else {
            "fill_random_bf16"
        };
        let args = [
            Arg::Ptr(ptr),
            Arg::U(n as u64),
            Arg::U(seed),
            Arg::F(mean),
            Arg::F(std),
        ];
        self.launch(kernel, (1024, 1, 1), 256, 0, &args)
    }

    /// Read bandwidth (bytes/s) of `read_probe` (misc.cu) over `items` MiB of 4 KiB rows read
    /// in 32 KiB stages of `run` 16-byte chunks a row (8: the grouped GEMMs' 128-byte K step
    /// over 256 rows; 256: whole rows, contiguous), one persistent block an SM.
    pub fn measure_weight_stream(&self, items: usize, run: usize) -> Result<f64> {
        if !(8..=256).contains(&run) || !run.is_power_of_two() {
            bail!("read_probe: run {run} is not a power of two in 8..=256");
        }
        let w = self.alloc_zeroed(items << 20)?;
        let sink = self.alloc(self.sm_count * 4)?;
        self.set_max_dynamic_smem("read_probe", 4 * 32 * 1024)?;
        let secs = self.seconds_per_call(|| {
            self.launch(
                "read_probe",
                (self.sm_count as u32, 1, 1),
                128,
                4 * 32 * 1024,
                &[
                    Arg::Ptr(w.ptr),
                    Arg::I(items as i32),
                    Arg::I(run as i32),
                    Arg::Ptr(sink.ptr),
                ],
            )
        })?;
        Ok((items << 20) as f64 / secs)
    }

    /// How fast a burst of `bytes` of weight reads comes from DRAM (`window_probe`, misc.cu:
    /// one block an SM, contiguous shares, at most `depth` 32 KiB stages in flight a block),
    /// timed inside the kernel from the first block's start to the last block's end, so without
    /// the launch's latency. Each of `reps` launches reads another part of `buf` (so nothing is
    /// in L2 from the one before); returns the median (seconds to the first block's end, seconds
    /// to the last block's end).
    pub fn measure_weight_window(
        &self,
        buf: &DeviceBuf,
        bytes: usize,
        depth: i32,
        reps: usize,
    ) -> Result<(f64, f64)> {
        if !(1..=5).contains(&depth)
            || bytes == 0
            || !bytes.is_multiple_of(16)
            || bytes > buf.bytes
            || reps == 0
        {
            bail!(
                "window_probe: depth {depth} (1-5), {bytes} bytes (16-byte multiple, at most the buffer's {}), {reps} repetitions (at least 1)",
                buf.bytes
            );
        }
        let g = self.sm_count;
        let sink = self.alloc(g * 4)?;
        let times = self.alloc(g * 16)?;
        self.set_max_dynamic_smem("window_probe", 6 * 32 * 1024)?;
        let slots = (buf.bytes / bytes).max(1);
        let mut first = Vec::new();
        let mut last = Vec::new();
        for r in 0..reps + 1 {
            let off = (r % slots) * bytes;
            self.launch(
                "window_probe",
                (g as u32, 1, 1),
                256,
                6 * 32 * 1024,
                &[
                    Arg::Ptr(buf.ptr + off as u64),
                    Arg::U((bytes / 16) as u64),
                    Arg::I(depth),
                    Arg::Ptr(sink.ptr),
                    Arg::Ptr(times.ptr),
                ],
            )?;
            self.sync()?;
            let mut t = vec![0u64; 2 * g];
            self.copy_to_host(times.ptr, &mut t)?;
            if r == 0 {
                continue; // the first launch loads the module's code and warms the clocks
            }
            let start = t.iter().step_by(2).min().copied().unwrap_or(0);
            let end_first = t.iter().skip(1).step_by(2).min().copied().unwrap_or(0);
            let end_last = t.iter().skip(1).step_by(2).max().copied().unwrap_or(0);
            first.push(end_first.saturating_sub(start) as f64 * 1e-9);
            last.push(end_last.saturating_sub(start) as f64 * 1e-9);
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(|a, b| a.total_cmp(b));
            v[v.len() / 2]
        };
        Ok((median(&mut first), median(&mut last)))
    }

    /// Seconds per grid-wide barrier (`grid_barrier_probe`, misc.cu) over `blocks` resident
    /// blocks of 128 threads and `rounds` barriers a launch, and whether every one held (no
    /// block saw another's store of the round missing, and all arrivals were counted).
    pub fn measure_grid_barrier(&self, blocks: usize, rounds: usize) -> Result<(f64, bool)> {
        let arrived = self.alloc_zeroed(4)?;
        let seen = self.alloc_zeroed(blocks * 4)?;
        let bad = self.alloc_zeroed(4)?;
        let run = || {
            self.memset_zero(arrived.ptr, 4)?;
            self.memset_zero(seen.ptr, blocks * 4)?;
            self.launch(
                "grid_barrier_probe",
                (blocks as u32, 1, 1),
                128,
                0,
                &[
                    Arg::Ptr(arrived.ptr),
                    Arg::Ptr(seen.ptr),
                    Arg::Ptr(bad.ptr),
                    Arg::I(rounds as i32),
                ],
            )
        };
        let secs = self.seconds_per_call(run)?;
        let (mut a, mut b) = ([0u32], [0u32]);
        self.copy_to_host(arrived.ptr, &mut a)?;
        self.copy_to_host(bad.ptr, &mut b)?;
        Ok((
            secs / rounds as f64,
            b[0] == 0 && a[0] as usize == rounds * blocks,
        ))
    }

    /// Device-to-device copy bandwidth (bytes read + written per second) over `bytes`.
    pub fn measure_copy_bandwidth(&self, bytes: usize) -> Result<f64> {
        let a = self.alloc_zeroed(bytes)?;
        let b = self.alloc(bytes)?;
        let n16 = (bytes / 16) as u64;
        let secs = self.seconds_per_call(|| {
            self.launch(
                "copy_probe",
                (132 * 8, 1, 1),
                512,
                0,
                &[Arg::Ptr(a.ptr), Arg::Ptr(b.ptr), Arg::U(n16)],
            )
        })?;
        Ok(2.0 * bytes as f64 / secs)
    }

    /// Wall time of one `launch` (enqueues on the main stream), after a warm-up call: the mean
    /// of 10 back to back.
    fn seconds_per_call(&self, launch: impl Fn() -> Result<()>) -> Result<f64> {
        launch()?;
        self.sync()?;
        let reps = 10;
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            launch()?;
        }
        self.sync()?;
        Ok(t0.elapsed().as_secs_f64() / reps as f64)
    }
}

/// `KESTREL_SKIP=name[:grid_x],...`: kernels that are not launched, a measuring aid (Nsight
/// Systems does not run on the H200 machine): a decode step's time with and without one kernel
/// is its cost on the step's critical path, with the overlap that graphs and programmatic
/// dependent launch give. The outputs are wrong while it is set, and a line on stderr says so.
fn skip_launch(name: &str, grid_x: u32) -> bool {
    static SKIP: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let skip = SKIP.get_or_init(|| {
        let list: Vec<String> = std::env::var("KESTREL_SKIP")
            .map(|v| {
                v.split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        if !list.is_empty() {
            eprintln!(
                "KESTREL_SKIP={}: these kernels are not launched; outputs are wrong (timing only)",
                list.join(",")
            );
        }
        list
    });
    !skip.is_empty()
        && skip.iter().any(|s| {
            s == name
                || s.strip_prefix(name).and_then(|g| g.strip_prefix(':'))
                    == Some(&grid_x.to_string())
        })
}

#[cfg(test)]
mod tests {
    /// Compiles every kernel with NVRTC when it is available (no GPU needed); skips otherwise.
    #[test]
    fn kernels_compile_with_nvrtc() {
        if super::cuda_include_dir().is_none() {
            println!("SKIPPED: no CUDA headers (set CUDA_HOME) to compile the kernels");
            return;
        }
        match super::kernel_ptx("compute_90a", false) {
            Ok(ptx) => {
                let src = ptx.to_src();
                for k in super::KERNELS.iter().chain(&super::gdn::CHUNK_KERNELS) {
                    assert!(src.contains(&format!(".entry {k}(")), "{k} missing");
                }
            }
            Err(e) if e.to_string().contains("could not be loaded") => {
                println!("SKIPPED: {e}")
            }
            Err(e) => panic!("{e:#}"),
        }
    }
}
