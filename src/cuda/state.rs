//! A sequence's state on the GPU ([`CudaState`]): the GDN conv and recurrent states and the
//! KV cache, with the decode graphs captured for it.

use super::model::CudaModel;
use super::{DeviceBuf, Gpu};
use crate::config::{LayerKind, TextConfig};
use anyhow::Result;
use std::sync::Arc;

/// A sequence's state on the GPU: f32 GDN conv/recurrent states, bf16 KV cache of up to
/// `max_seq` positions. A fresh state has room for all of them; cloning copies it on the device
/// (a snapshot) with room for the positions it holds only, so that the prefix cache keeps a
/// short conversation's KV, not `max_seq`'s, and a clone grows to `max_seq` on its first
/// forward ([`CudaState::reserve_kv`]).
pub struct CudaState {
    pub len: usize,
    /// Captured decode graphs of this state, by (attention splits, argmax vocab limit).
    pub(super) graphs: Vec<((usize, usize), DecodeGraph)>,
    pub(super) max_seq: usize,
    pub(super) gdn: Vec<(DeviceBuf, DeviceBuf)>,
    pub(super) kv: Vec<(DeviceBuf, DeviceBuf)>,
    pub(super) kv_token_bytes: usize,
    gpu: Arc<Gpu>,
}

/// A new device buffer of `bytes` holding the first `used` bytes of `b`.
fn copy_prefix(g: &Gpu, b: &DeviceBuf, bytes: usize, used: usize) -> Result<DeviceBuf> {
    let n = g.alloc(bytes)?;
    if used > 0 {
        g.copy_device(n.ptr, b.ptr, used)?;
    }
    Ok(n)
}

impl CudaState {
    /// Positions the KV buffers have room for.
    pub(super) fn kv_room(&self) -> usize {
        self.kv
            .first()
            .map_or(usize::MAX, |(k, _)| k.bytes / self.kv_token_bytes)
    }

    /// Room for `max_seq` positions in the KV buffers (a snapshot's copy has room for its own
    /// only). The captured decode graphs name the old buffers, so they go.
    pub(super) fn reserve_kv(&mut self) -> Result<()> {
        if self.kv_room() >= self.max_seq {
            return Ok(());
        }
        let (used, bytes) = (
            self.len * self.kv_token_bytes,
            self.max_seq * self.kv_token_bytes,
        );
        for (k, v) in &mut self.kv {
            *k = copy_prefix(&self.gpu, k, bytes, used)?;
            *v = copy_prefix(&self.gpu, v, bytes, used)?;
        }
        self.graphs.clear();
        Ok(())
    }

    fn try_clone(&self) -> Result<Self> {
        let g = &self.gpu;
        let mut gdn = Vec::with_capacity(self.gdn.len());
        for (c, r) in &self.gdn {
            gdn.push((
                copy_prefix(g, c, c.bytes, c.bytes)?,
                copy_prefix(g, r, r.bytes, r.bytes)?,
            ));
        }
        let used = self.len * self.kv_token_bytes;
        let mut kv = Vec::with_capacity(self.kv.len());
        for (k, v) in &self.kv {
            kv.push((
                copy_prefix(g, k, used, used)?,
                copy_prefix(g, v, used, used)?,
            ));
        }
        Ok(CudaState {
            len: self.len,
            graphs: Vec::new(),
            max_seq: self.max_seq,
            gdn,
            kv,
            kv_token_bytes: self.kv_token_bytes,
            gpu: self.gpu.clone(),
        })
    }

    /// Bytes of device memory held.
    pub fn memory_bytes(&self) -> usize {
        self.gdn
            .iter()
            .map(|(a, b)| a.bytes + b.bytes)
            .sum::<usize>()
            + self
                .kv
                .iter()
                .map(|(a, b)| a.bytes + b.bytes)
                .sum::<usize>()
    }
}

impl Clone for CudaState {
    fn clone(&self) -> Self {
        self.try_clone()
            .expect("GPU memory exhausted while snapshotting a sequence state")
    }
}

/// A captured decode step. The graph only names device memory, so it may move between
/// threads with its state (it is never used from two threads at once).
pub(super) struct DecodeGraph(pub(super) cudarc::driver::CudaGraph);

// SAFETY: the CUDA graph handles are plain driver objects; the owning state is used by one
// thread at a time (`&mut` for every step), which is all the driver requires.
unsafe impl Send for DecodeGraph {}

impl CudaModel {
    /// Bytes of state for one sequence of `max_seq` tokens.
    pub fn state_bytes(cfg: &TextConfig, max_seq: usize) -> usize {
        let conv = (cfg.conv_kernel - 1) * cfg.gdn_conv_channels() * 4;
        let rec = cfg.gdn_num_value_heads * cfg.gdn_key_dim * cfg.gdn_value_dim * 4;
        cfg.num_gdn_layers() * (conv + rec) + max_seq * cfg.kv_bytes_per_token(2)
    }

    /// A fresh sequence state with room for `max_seq` tokens.
    pub fn new_state_checked(&self) -> Result<CudaState> {
        let c = &self.config;
        let g = &self.gpu;
        let mut gdn = Vec::new();
        let mut kv = Vec::new();
        let kv_token_bytes = c.num_kv_heads * c.head_dim * 2;
        for kind in &c.layer_kinds {
            match kind {
                LayerKind::Gdn => gdn.push((
                    g.alloc_zeroed((c.conv_kernel - 1) * c.gdn_conv_channels() * 4)?,
                    g.alloc_zeroed(c.gdn_num_value_heads * c.gdn_key_dim * c.gdn_value_dim * 4)?,
                )),
                LayerKind::Attention => kv.push((
                    g.alloc(self.max_seq * kv_token_bytes)?,
                    g.alloc(self.max_seq * kv_token_bytes)?,
                )),
            }
        }
        Ok(CudaState {
            len: 0,
            graphs: Vec::new(),
            max_seq: self.max_seq,
            gdn,
            kv,
            kv_token_bytes,
            gpu: self.gpu.clone(),
        })
    }
}
