//! CUDA backend for NVIDIA Hopper: the device, run-time compiled kernels (NVRTC, cached on
//! disk by source hash and arch), cuBLAS for dense products, and device buffers.
//!
//! Everything loads dynamically (cudarc), so the crate builds and its CPU tests run on
//! machines without CUDA; `Gpu::open` says clearly why a GPU cannot be used.

pub mod attention;
mod decode;
pub mod error;
pub mod gdn;
pub mod gemm;
pub mod kernels;
pub mod kv;
pub mod model;
pub mod moe;
mod prefill;
pub mod probe;
pub mod sample;
pub mod state;
mod upload;

pub use error::GpuError;

use crate::settings::Settings;
use anyhow::{Context, Result, anyhow, bail};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, result};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// The kernel sources, one file per op family, compiled as one module.
const SOURCES: [(&str, &str); 18] = [
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("ptx.cuh", include_str!("kernels/ptx.cuh")),
    ("sync.cuh", include_str!("kernels/sync.cuh")),
    ("trace.cuh", include_str!("kernels/trace.cuh")),
    ("gemv.cuh", include_str!("kernels/gemv.cuh")),
    ("misc.cu", include_str!("kernels/misc.cu")),
    ("norm.cu", include_str!("kernels/norm.cu")),
    ("gemv.cu", include_str!("kernels/gemv.cu")),
    ("gdn_decode.cu", include_str!("kernels/gdn_decode.cu")),
    ("gdn_chunk.cu", include_str!("kernels/gdn_chunk.cu")),
    ("gdn_state.cu", include_str!("kernels/gdn_state.cu")),
    ("attention.cuh", include_str!("kernels/attention.cuh")),
    ("attn_prefill.cu", include_str!("kernels/attn_prefill.cu")),
    ("attn_decode.cu", include_str!("kernels/attn_decode.cu")),
    ("moe_route.cu", include_str!("kernels/moe_route.cu")),
    ("moe_gemm.cu", include_str!("kernels/moe_gemm.cu")),
    ("moe_decode.cu", include_str!("kernels/moe_decode.cu")),
    ("sample.cu", include_str!("kernels/sample.cu")),
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

/// Page-locked (pinned) host memory of 32-bit words, freed on drop: copies from and to it
/// are DMA on the stream, asynchronous to the host, without the staging copy the driver makes
/// of pageable memory. A range handed to [`Gpu::copy_pinned_to_device`] must not be written
/// again until the stream has passed that copy (its owner syncs first).
pub struct PinnedBuf {
    ptr: std::ptr::NonNull<u32>,
    words: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the allocation belongs to this value alone; it is read through `&self` and written
// through `&mut self`, as a `Vec<u32>` would be.
unsafe impl Send for PinnedBuf {}
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    pub fn words(&self) -> &[u32] {
        // SAFETY: ptr holds `words` initialised (zeroed at allocation) u32s.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.words) }
    }

    pub fn words_mut(&mut self) -> &mut [u32] {
        // SAFETY: as in `words`, and `&mut self` is the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.words) }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: ptr came from malloc_host and is freed once.
        unsafe {
            let _ = result::free_host(self.ptr.as_ptr().cast());
        }
    }
}

/// A kernel argument.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    Ptr(u64),
    I(i32),
    F(f32),
    U(u64),
}

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// cuBLASLt with its plans (`gemm.rs`).
    lt: gemm::Lt,
    /// A second, higher-priority stream for work that can run beside the main stream's (in
    /// prefill: the shared expert beside the routed experts, the attention k and v products
    /// beside the q|gate product),
    /// with its own cuBLASLt handle and
    /// workspace; [`Gpu::fork_aux`] and [`Gpu::join_aux`] order it against the main stream
    /// (every fork is joined in the same layer, before the main stream reads the results).
    aux: Arc<CudaStream>,
    aux_lt: gemm::Lt,
    fork_event: cudarc::driver::CudaEvent,
    join_event: cudarc::driver::CudaEvent,
    _aux_gemm_workspace: DeviceBuf,
    /// cuBLASLt's workspace (declared after `lt`, so dropped after it).
    _gemm_workspace: DeviceBuf,
    /// Every kernel of the module, by name (the PTX's entries).
    functions: std::collections::HashMap<String, CudaFunction>,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_memory: usize,
    /// With `KESTREL_PROFILE=1` ([`crate::settings::Settings::profile`]): per-op (calls, seconds), each op timed on the GPU by a pair
    /// of CUDA events (no host syncs in between, so launch gaps are not counted).
    profile: Option<std::sync::Mutex<Profile>>,
    /// Shared memory a block may opt into (bytes).
    pub max_smem_per_block: usize,
    /// Streaming multiprocessors (the persistent kernels' grid).
    pub sm_count: usize,
    /// Programmatic dependent launch for the prefill kernels ([`Gpu::launch_dep`]): on
    /// not while profiling (the profile's events would sit between two kernels).
    prefill_pdl: bool,
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
                .map_err(GpuError::driver("profile event"))?;
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
    if let Some(d) = &Settings::get().cache_dir {
        return d.join("kernels");
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
    // KESTREL_TRACE=1: the timeline's and the GDN state pass's clock stamps (part of the hash).
    let defines = if Settings::get().trace {
        "#define KESTREL_TRACE\n#define KESTREL_GDN_TRACE\n"
    } else {
        ""
    };
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
            GpuError::Compile(
                "cannot find the CUDA headers (cuda_bf16.h) that NVRTC needs: set CUDA_HOME or CUDA_PATH, or install them under /usr/local/cuda/include".into(),
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
            .ok_or_else(|| GpuError::Compile("NVRTC could not be loaded (libnvrtc.so)".into()))?
            .map_err(|e| match e {
                cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                    GpuError::Compile(format!("\n{}", log.to_string_lossy()))
                }
                other => GpuError::Compile(format!("{other:?}")),
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

/// Why GPU `ordinal` could not be opened: the driver's error, and when the ordinal is past
/// the devices this process sees, how many it sees and under which `CUDA_VISIBLE_DEVICES`.
fn open_failure(ordinal: usize, err: &str) -> String {
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let scope = match &visible {
        Some(v) => format!(" (CUDA_VISIBLE_DEVICES={v:?}: ordinals count only those, from 0)"),
        None => String::new(),
    };
    match CudaContext::device_count() {
        Ok(n) if ordinal >= n.max(0) as usize => format!(
            "there is no GPU {ordinal}: this process sees {n} CUDA device{}{scope}",
            if n == 1 { "" } else { "s" }
        ),
        _ => format!("cannot open GPU {ordinal}{scope}: {err}"),
    }
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
    ///
    /// `ordinal` counts the devices the CUDA driver shows this process: where
    /// `CUDA_VISIBLE_DEVICES` is set, the driver lists only those, renumbered from 0 in that
    /// order (so `CUDA_VISIBLE_DEVICES=3` with ordinal 0 opens physical GPU 3).
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        let ctx = quiet_catch(|| CudaContext::new(ordinal))
            .ok_or_else(|| {
                GpuError::Unavailable(
                    "the CUDA driver library (libcuda.so) could not be loaded".into(),
                )
            })?
            .map_err(|e| GpuError::Unavailable(open_failure(ordinal, &format!("{e:?}"))))?;
        // We order everything on one stream ourselves.
        // SAFETY: all work of this backend runs on `stream`.
        unsafe { ctx.disable_event_tracking() };
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let cc = ctx
            .compute_capability()
            .map_err(GpuError::driver("cannot query the GPU"))?;
        if cc != (9, 0) {
            return Err(GpuError::Unavailable(format!(
                "GPU {ordinal} is {name} (compute capability {}.{}); Kestrel's CUDA backend needs a Hopper-class GPU (H100/H200, compute capability 9.0)",
                cc.0, cc.1
            ))
            .into());
        }
        let total_memory = ctx.total_mem().unwrap_or(0);
        // A created stream, not the legacy default one, which cannot be captured into graphs.
        let stream = ctx
            .new_stream()
            .map_err(GpuError::driver("cannot create a CUDA stream"))?;
        let gemm_workspace = Self::alloc_in(&ctx, GEMM_WORKSPACE_BYTES)
            .context("allocating cuBLASLt's workspace")?;
        let lt = gemm::Lt::new(gemm_workspace.ptr, gemm_workspace.bytes)?;
        let (_, highest) = cudarc::driver::result::stream::get_priority_range()
            .map_err(GpuError::driver("cannot query stream priorities"))?;
        let aux = ctx
            .new_stream_with_priority(highest)
            .map_err(GpuError::driver("cannot create a CUDA stream"))?;
        let aux_gemm_workspace = Self::alloc_in(&ctx, GEMM_WORKSPACE_BYTES)
            .context("allocating the second stream's cuBLASLt workspace")?;
        let aux_lt = gemm::Lt::new(aux_gemm_workspace.ptr, aux_gemm_workspace.bytes)?;
        let event = || {
            ctx.new_event(None)
                .map_err(GpuError::driver("cannot create a CUDA event"))
        };
        let (fork_event, join_event) = (event()?, event()?);
        let max_smem_per_block = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(GpuError::driver("cannot query the GPU"))? as usize;
        let sm_count = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(GpuError::driver("cannot query the GPU"))? as usize;
        let (module, entries) = Self::compile(&ctx)?;
        let mut functions = std::collections::HashMap::new();
        for k in entries {
            let f = module
                .load_function(&k)
                .map_err(|e| anyhow!("kernel {k} missing from the module: {e:?}"))?;
            functions.insert(k, f);
        }
        let profile = Settings::get()
            .profile
            .then(|| std::sync::Mutex::new(Profile::default()));
        let gpu = Gpu {
            ctx,
            stream,
            lt,
            aux,
            aux_lt,
            fork_event,
            join_event,
            _aux_gemm_workspace: aux_gemm_workspace,
            _gemm_workspace: gemm_workspace,
            functions,
            name,
            compute_capability: cc,
            total_memory,
            max_smem_per_block,
            sm_count,
            prefill_pdl: profile.is_none(),
            profile,
            main_tail_is_kernel: Default::default(),
        };
        // Kernels that need more than the default 48 KiB of shared memory (the chunked GDN
        // kernels as much as the GPU allows: GdnShape::chunked_fits checks what a shape needs).
        for (k, bytes) in kernels::dynamic_smem(max_smem_per_block) {
            gpu.set_max_dynamic_smem(k, bytes)?;
        }
        Ok(Arc::new(gpu))
    }

    /// The kernel module and the names of its kernels.
    fn compile(ctx: &Arc<CudaContext>) -> Result<(Arc<cudarc::driver::CudaModule>, Vec<String>)> {
        let ptx = kernel_ptx("compute_90a", true)?;
        let entries = kernels::ptx_entries(&ptx.to_src());
        let module = ctx
            .load_module(ptx)
            .map_err(GpuError::driver("loading the kernel module failed"))?;
        Ok((module, entries))
    }

    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(GpuError::driver("CUDA bind"))
            .map_err(Into::into)
    }

    /// The device's ordinal.
    pub fn device(&self) -> i32 {
        self.ctx.ordinal() as i32
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(GpuError::driver("cuMemGetInfo"))
            .map_err(Into::into)
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
            unsafe { result::malloc_sync(bytes) }.map_err(|e| GpuError::OutOfMemory {
                bytes,
                driver: format!("{e:?}"),
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
            .map_err(GpuError::driver("memset"))
            .map_err(Into::into)
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
            .map_err(GpuError::driver("host-to-device copy"))
            .map_err(Into::into)
    }

    /// `words` words of page-locked host memory, zeroed.
    pub fn alloc_pinned(&self, words: usize) -> Result<PinnedBuf> {
        self.bind()?;
        let bytes = words.max(1) * 4;
        // SAFETY: a plain page-locked allocation; freed by PinnedBuf::drop.
        let raw = unsafe { result::malloc_host(bytes, 0) }
            .map_err(GpuError::driver("page-locked host allocation"))?;
        let ptr = std::ptr::NonNull::new(raw.cast::<u32>())
            .ok_or_else(|| anyhow!("page-locked host allocation of {bytes} bytes gave null"))?;
        // SAFETY: `bytes` bytes were just allocated at ptr.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, words) };
        Ok(PinnedBuf {
            ptr,
            words,
            ctx: self.ctx.clone(),
        })
    }

    /// Queues the copy of `src`'s words `range` to `dst` on the stream and returns at once
    /// (DMA from page-locked memory): `src`'s range must stay unwritten until the stream
    /// has passed the copy.
    pub fn copy_pinned_to_device(
        &self,
        dst: u64,
        src: &PinnedBuf,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        self.main_tail_not_kernel();
        // SAFETY: dst has room for the range (caller's allocation); the words stay valid
        // (owned by `src`, which the caller keeps unwritten until the stream passed the copy).
        unsafe { result::memcpy_htod_async(dst, &src.words()[range], self.stream.cu_stream()) }
            .map_err(GpuError::driver("host-to-device copy"))
            .map_err(Into::into)
    }

    /// [`Gpu::copy_to_host`] into page-locked words `range` of `out` (a DMA, then the sync).
    pub fn copy_to_pinned(
        &self,
        src: u64,
        out: &mut PinnedBuf,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        // SAFETY: src holds at least range.len() words.
        unsafe {
            result::memcpy_dtoh_async(&mut out.words_mut()[range], src, self.stream.cu_stream())
        }
        .map_err(GpuError::driver("device-to-host copy"))?;
        self.sync()
    }

    pub fn copy_to_host<T: Copy>(&self, src: u64, out: &mut [T]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: src holds at least out.len() elements.
        unsafe { result::memcpy_dtoh_async(out, src, self.stream.cu_stream()) }
            .map_err(GpuError::driver("device-to-host copy"))?;
        self.sync()
    }

    pub fn copy_device(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.main_tail_not_kernel();
        // SAFETY: both ranges lie in our allocations and do not overlap.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(GpuError::driver("device copy"))
            .map_err(Into::into)
    }

    /// Whether work queued on the main stream is still running (without waiting; an error
    /// reads as done, for the next sync to report).
    pub fn busy(&self) -> bool {
        // SAFETY: a query of our own live stream.
        let r = unsafe { cudarc::driver::sys::cuStreamQuery(self.stream.cu_stream()) };
        r == cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY
    }

    pub fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(GpuError::driver("CUDA error (a kernel failed?)"))
            .map_err(Into::into)
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
            .map_err(GpuError::driver("CUDA graph capture"))?;
        let recorded = f();
        // End the capture even when recording failed, so the stream is usable again.
        let graph = self
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(GpuError::driver("CUDA graph instantiate"));
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
                .map_err(GpuError::driver("profile event"))
        };
        let (start, end) = (event()?, event()?);
        start
            .record(stream)
            .map_err(GpuError::driver("profile event"))?;
        let r = f()?;
        end.record(stream)
            .map_err(GpuError::driver("profile event"))?;
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
    /// `griddep_wait`, see sync.cuh, before touching what earlier kernels write). Captured
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
    /// sync.cuh) on the main stream: with programmatic dependent launch when the previous
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
            .map_err(GpuError::driver("ordering the second stream"))
            .map_err(Into::into)
    }

    /// The main stream waits for everything enqueued on the second stream so far.
    pub fn join_aux(&self) -> Result<()> {
        self.main_tail_not_kernel();
        self.join_event
            .record(&self.aux)
            .and_then(|_| self.stream.wait(&self.join_event))
            .map_err(GpuError::driver("joining the second stream"))
            .map_err(Into::into)
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
            };
        }
        let mut params = [std::ptr::null_mut::<std::ffi::c_void>(); MAX_ARGS];
        for (p, v) in params.iter_mut().zip(slots.iter_mut()).take(args.len()) {
            *p = v as *mut u64 as *mut std::ffi::c_void;
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
        let n64 = n as u64;
        if f32 {
            let out = kernels::Dev::new(ptr, n);
            kernels::misc::FillRandomF32 {
                out,
                n: n64,
                seed,
                mean,
                std,
            }
            .launch(self)
        } else {
            let out = kernels::Dev::new(ptr, n);
            kernels::misc::FillRandomBf16 {
                out,
                n: n64,
                seed,
                mean,
                std,
            }
            .launch(self)
        }
    }
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
                // every kernel the launchers name is in the module (the signature test
                // checks them against the sources)
                let entries = super::kernels::ptx_entries(&ptx.to_src());
                for k in super::kernels::all_names() {
                    assert!(entries.iter().any(|e| e == k), "{k} missing from the PTX");
                }
                assert_eq!(entries.len(), super::kernels::all_names().len());
            }
            Err(e) if e.to_string().contains("could not be loaded") => {
                println!("SKIPPED: {e}")
            }
            Err(e) => panic!("{e:#}"),
        }
    }
}
