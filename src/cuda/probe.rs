//! Bandwidth probes for `kestrel bench`'s hardware bound (`copy_probe`, `read_probe` in
//! misc.cu): not part of the forward pass.

use super::Gpu;
use super::kernels::misc::{CopyProbe, READ_PROBE_SMEM, ReadProbe};
use anyhow::Result;

impl Gpu {
    /// Read bandwidth (bytes/s) of `read_probe` (misc.cu) over `items` MiB of 4 KiB rows read
    /// in 32 KiB stages of `run` 16-byte chunks a row (8: the grouped GEMMs' 128-byte K step
    /// over 256 rows; 256: whole rows, contiguous), one persistent block an SM.
    pub fn measure_weight_stream(&self, items: usize, run: usize) -> Result<f64> {
        let w = self.alloc_zeroed(items << 20)?;
        let sink = self.alloc(self.sm_count * 4)?;
        self.set_max_dynamic_smem("read_probe", READ_PROBE_SMEM)?;
        let probe = ReadProbe {
            w: w.view(),
            items: items as i32,
            run: run as i32,
            xs_out: sink.view(),
        };
        let secs = self.seconds_per_call(|| probe.launch(self))?;
        Ok((items << 20) as f64 / secs)
    }

    /// Device-to-device copy bandwidth (bytes read + written per second) over `bytes`.
    pub fn measure_copy_bandwidth(&self, bytes: usize) -> Result<f64> {
        let a = self.alloc_zeroed(bytes)?;
        let b = self.alloc(bytes)?;
        let probe = CopyProbe {
            x: a.view(),
            y: b.view(),
            n: (bytes / 16) as u64,
        };
        let secs = self.seconds_per_call(|| probe.launch(self))?;
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
