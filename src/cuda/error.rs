//! The CUDA backend's error: what a caller can act on (no GPU, no memory) apart from the rest.
//! It travels inside `anyhow::Error`; `GpuError::of` finds it again.

/// An error of the GPU itself (the model's own checks stay `anyhow` messages).
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// No usable CUDA driver or device, or the device is not Hopper-class.
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    /// A device allocation failed: the server answers 503 and keeps running.
    #[error("GPU out of memory allocating {:.2} GiB: {driver}", *.bytes as f64 / (1u64 << 30) as f64)]
    OutOfMemory { bytes: usize, driver: String },
    /// NVRTC is missing or rejected the kernel sources.
    #[error("kernel compilation failed: {0}")]
    Compile(String),
    /// Any other driver call failed (`op` says which).
    #[error("{op}: {driver}")]
    Driver { op: &'static str, driver: String },
}

impl GpuError {
    /// The driver error of `op` (the driver's own enum, printed).
    pub fn driver(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> GpuError {
        move |e| GpuError::Driver {
            op,
            driver: format!("{e:?}"),
        }
    }

    /// The `GpuError` somewhere in `e`'s chain, if any.
    pub fn of(e: &anyhow::Error) -> Option<&GpuError> {
        e.chain().find_map(|c| c.downcast_ref::<GpuError>())
    }
}
