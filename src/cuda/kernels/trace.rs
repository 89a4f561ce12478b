//! `trace.cuh`: the decode timeline's record buffer and the GDN state pass's phase clock
//! (both record only in a build with `KESTREL_TRACE=1`).

use super::{Dev, On, kernels};
use crate::cuda::Gpu;
use anyhow::Result;

kernels! {
    /// Points the timeline's records at `buf` (room for `cap` records; null: off).
    TraceSet ["trace_set"] { buf: Dev<u64>, cap: u32 }
    /// Copies the phase clock (`GDN_TRACE_CHUNKS * 16` u64) into `out`.
    GdnPhaseRead ["gdn_phase_read"] { out: Dev<u64> }
}

impl TraceSet {
    pub fn launch(&self, gpu: &Gpu) -> Result<()> {
        gpu.run("trace_set", (1, 1, 1), 32, 0, &self.args(), On::Plain)
    }
}

impl GdnPhaseRead {
    pub fn launch(&self, gpu: &Gpu) -> Result<()> {
        gpu.run("gdn_phase_read", (1, 1, 1), 256, 0, &self.args(), On::Plain)
    }
}
