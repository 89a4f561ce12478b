//! Bandwidth probes for `kestrel bench`'s hardware bound (`copy_probe`, `read_probe` in
//! misc.cu): not part of the forward pass.

use super::{Arg, Gpu};
use anyhow::{Result, bail};

impl Gpu {
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
