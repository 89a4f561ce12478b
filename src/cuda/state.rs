//! A sequence's state on the GPU ([`CudaState`]): the GDN conv and recurrent states and the
//! KV cache, with the decode graphs captured for it.

use super::kernels::Dev;
use super::kv::{KV_PAGE_BYTES, PagedKv};
use super::model::CudaModel;
use super::{DeviceBuf, Gpu};
use crate::config::{LayerKind, TextConfig};
use crate::model::StateMemory;
use anyhow::Result;
use half::bf16;
use std::sync::Arc;

/// A sequence's state on the GPU: f32 GDN conv/recurrent states and the bf16 KV cache in
/// pages ([`PagedKv`]): room for `max_seq` positions is reserved, memory for those held is
/// mapped. Cloning (a snapshot) copies the GDN states and shares the KV's full pages.
pub struct CudaState {
    pub len: usize,
    /// Captured decode graphs of this state, by (attention splits, argmax vocab limit).
    pub(super) graphs: Vec<((usize, usize), DecodeGraph)>,
    pub(super) max_seq: usize,
    pub(super) gdn: Vec<(DeviceBuf, DeviceBuf)>,
    pub(super) kv: PagedKv,
    gpu: Arc<Gpu>,
}

/// A new device buffer holding a copy of `b`.
fn copy_of(g: &Gpu, b: &DeviceBuf) -> Result<DeviceBuf> {
    let n = g.alloc(b.bytes)?;
    g.copy_device(n.ptr, b.ptr, b.bytes)?;
    Ok(n)
}

impl CudaState {
    /// Attention layer `i`'s K and V caches `[max_seq, nkv, hd]`.
    pub(super) fn kv_caches(&self, i: usize) -> (Dev<bf16>, Dev<bf16>) {
        (self.kv.range(2 * i), self.kv.range(2 * i + 1))
    }

    fn try_clone(&self) -> Result<Self> {
        let g = &self.gpu;
        let mut gdn = Vec::with_capacity(self.gdn.len());
        for (c, r) in &self.gdn {
            gdn.push((copy_of(g, c)?, copy_of(g, r)?));
        }
        Ok(CudaState {
            len: self.len,
            graphs: Vec::new(),
            max_seq: self.max_seq,
            gdn,
            kv: self.kv.snapshot(g, self.len)?,
            gpu: self.gpu.clone(),
        })
    }

    /// Bytes of device memory held (KV pages shared with snapshots counted in full).
    pub fn memory_bytes(&self) -> usize {
        self.gdn
            .iter()
            .map(|(a, b)| a.bytes + b.bytes)
            .sum::<usize>()
            + self.kv.pages_held() * KV_PAGE_BYTES
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
    /// Bytes of KV a position costs in one attention layer's K (or V) cache.
    pub fn kv_token_bytes(cfg: &TextConfig) -> usize {
        cfg.num_kv_heads * cfg.head_dim * 2
    }

    /// Bytes of a state's GDN conv and recurrent states (what it holds besides its KV).
    pub fn gdn_state_bytes(cfg: &TextConfig) -> usize {
        let conv = (cfg.conv_kernel - 1) * cfg.gdn_conv_channels() * 4;
        let rec = cfg.gdn_num_value_heads * cfg.gdn_key_dim * cfg.gdn_value_dim * 4;
        cfg.num_gdn_layers() * (conv + rec)
    }

    /// What states cost on the device: the GDN part, and KV by the block (a page in each
    /// attention layer's K and V range)
    /// ([`crate::model::StateMemory::bytes_for`]), `free` bytes free now.
    pub fn state_memory_for(cfg: &TextConfig, free: usize) -> StateMemory {
        let attn = cfg.num_layers - cfg.num_gdn_layers();
        StateMemory {
            free,
            fixed: Self::gdn_state_bytes(cfg),
            block_bytes: 2 * attn * KV_PAGE_BYTES,
            block_tokens: KV_PAGE_BYTES / Self::kv_token_bytes(cfg),
        }
    }

    /// Bytes of state for one sequence of `max_seq` tokens (its KV in whole blocks).
    pub fn state_bytes(cfg: &TextConfig, max_seq: usize) -> usize {
        Self::state_memory_for(cfg, 0).bytes_for(max_seq)
    }

    /// A fresh sequence state with room for `max_seq` tokens (no KV page mapped yet).
    pub fn new_state_checked(&self) -> Result<CudaState> {
        let c = &self.config;
        let g = &self.gpu;
        let mut gdn = Vec::new();
        for kind in &c.layer_kinds {
            if *kind == LayerKind::Gdn {
                gdn.push((
                    g.alloc_zeroed((c.conv_kernel - 1) * c.gdn_conv_channels() * 4)?,
                    g.alloc_zeroed(c.gdn_num_value_heads * c.gdn_key_dim * c.gdn_value_dim * 4)?,
                ));
            }
        }
        let attn = c.num_layers - c.num_gdn_layers();
        Ok(CudaState {
            len: 0,
            graphs: Vec::new(),
            max_seq: self.max_seq,
            gdn,
            kv: PagedKv::new(
                &self.kv_pool,
                2 * attn,
                self.max_seq,
                Self::kv_token_bytes(c),
            )?,
            gpu: self.gpu.clone(),
        })
    }
}
