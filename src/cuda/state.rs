//! A sequence's state on the GPU ([`CudaState`]): the GDN conv and recurrent states and the
//! KV cache, with the decode graphs captured for it.

use super::kernels::Dev;
use super::kv::{KV_PAGE_BYTES, PagedKv};
use super::model::CudaModel;
use super::{DeviceBuf, Gpu};
use crate::config::TextConfig;
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
    /// Each GDN layer's (conv, recurrent) state, views of `gdn_mem`.
    pub(super) gdn: Vec<GdnLayer>,
    /// All of them in one allocation (one allocation and one free a state, not 60).
    gdn_mem: DeviceBuf,
    pub(super) kv: PagedKv,
    gpu: Arc<Gpu>,
}

/// A new device buffer holding a copy of `b`.
fn copy_of(g: &Gpu, b: &DeviceBuf) -> Result<DeviceBuf> {
    let n = g.alloc(b.bytes)?;
    g.copy_device(n.ptr, b.ptr, b.bytes)?;
    Ok(n)
}

/// One GDN layer's (conv, recurrent) state.
type GdnLayer = (Dev<f32>, Dev<f32>);

/// The (conv, recurrent) views of each GDN layer in one allocation at `base` (layer after
/// layer, each part 256-byte aligned), and the bytes they take.
fn gdn_views(cfg: &TextConfig, base: u64) -> (Vec<GdnLayer>, usize) {
    let conv = (cfg.conv_kernel - 1) * cfg.gdn_conv_channels();
    let rec = cfg.gdn_num_value_heads * cfg.gdn_key_dim * cfg.gdn_value_dim;
    let padded = |floats: usize| (floats * 4).div_ceil(256) * 256;
    let mut at = 0usize;
    let mut views = Vec::new();
    for _ in 0..cfg.num_gdn_layers() {
        let c = Dev::new(base + at as u64, conv);
        at += padded(conv);
        let r = Dev::new(base + at as u64, rec);
        at += padded(rec);
        views.push((c, r));
    }
    (views, at)
}

impl CudaState {
    /// Attention layer `i`'s K and V caches `[max_seq, nkv, hd]`.
    pub(super) fn kv_caches(&self, i: usize) -> (Dev<bf16>, Dev<bf16>) {
        (self.kv.range(2 * i), self.kv.range(2 * i + 1))
    }

    fn try_clone(&self) -> Result<Self> {
        let g = &self.gpu;
        let gdn_mem = copy_of(g, &self.gdn_mem)?;
        let base = self.gdn.first().map_or(0, |v| v.0.ptr);
        let gdn = self
            .gdn
            .iter()
            .map(|(c, r)| {
                let to = |d: &Dev<f32>| Dev::new(gdn_mem.ptr + (d.ptr - base), d.len);
                (to(c), to(r))
            })
            .collect();
        Ok(CudaState {
            len: self.len,
            graphs: Vec::new(),
            max_seq: self.max_seq,
            gdn,
            gdn_mem,
            kv: self.kv.snapshot(g, self.len)?,
            gpu: self.gpu.clone(),
        })
    }

    /// Bytes of device memory held (KV pages shared with snapshots counted in full).
    pub fn memory_bytes(&self) -> usize {
        self.gdn_mem.bytes + self.kv.pages_held() * KV_PAGE_BYTES
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
        gdn_views(cfg, 0).1
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
        let gdn_mem = g.alloc_zeroed(Self::gdn_state_bytes(c).max(256))?;
        let (gdn, _) = gdn_views(c, gdn_mem.ptr);
        let attn = c.num_layers - c.num_gdn_layers();
        Ok(CudaState {
            len: 0,
            graphs: Vec::new(),
            max_seq: self.max_seq,
            gdn,
            gdn_mem,
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
