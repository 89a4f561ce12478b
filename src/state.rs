//! Per-sequence state: the KV cache of every attention layer and the conv + recurrent state
//! of every GDN layer. Cloning is a snapshot; `restore` rolls a sequence back to one (prefix
//! caching and speculative decoding build on this).

use crate::config::{LayerKind, TextConfig};

/// Gated DeltaNet state of one layer for one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct GdnState {
    /// The last `kernel - 1` pre-conv inputs, `[kernel-1, channels]`, oldest first.
    pub conv: Vec<f32>,
    /// Delta-rule state `[Hv, dk, dv]`, f32.
    pub recurrent: Vec<f32>,
}

/// Attention KV cache of one layer: normed + rotated keys and raw values, `[len, nkv, hd]`.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct KvCache {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum LayerState {
    Gdn(GdnState),
    Attention(KvCache),
}

/// The MTP head's part of a sequence (speculative decoding, spec §4). Its attention layer
/// has its own KV cache: the entry at position `p` comes from the pair (the main model's
/// final-normed hidden state at `p`, the token at `p + 1`), so it always lags the main state;
/// the rows it has not consumed yet wait in `hidden`. Invariant: `kv` positions + `hidden`
/// rows = [`SequenceState::len`].
#[derive(Clone, Debug, PartialEq, Default)]
pub struct MtpState {
    pub kv: KvCache,
    /// Main-model hidden states (after the final norm) not yet run through the head,
    /// `[rows, D]`, oldest first.
    pub hidden: Vec<f32>,
    /// The token after each pending row but the last (`rows - 1` ids; the last row's is the
    /// one the model picks next).
    pub next: Vec<u32>,
}

/// What a speculative verification step ([`crate::model::Engine::spec_verify`]) keeps so it
/// can be rolled back: the GDN states after each verified position (on the CPU copies; the
/// GPU will keep a slot per draft position), and where the step started.
#[derive(Clone, Debug, PartialEq)]
pub struct Verified {
    /// [`SequenceState::len`] before the step.
    pub base: usize,
    /// `gdn[i][j]`: the `j`-th GDN layer's state after verified position `base + i`.
    pub gdn: Vec<Vec<GdnState>>,
}

/// Everything one sequence carries between forward calls.
#[derive(Clone, Debug, PartialEq)]
pub struct SequenceState {
    /// Tokens already processed (the position of the next token).
    pub len: usize,
    pub layers: Vec<LayerState>,
    /// The MTP head's KV and pending rows, where the model drafts with it.
    pub mtp: Option<MtpState>,
    /// The last verification step's roll-back slots, until the next forward call.
    pub verified: Option<Verified>,
}

impl KvCache {
    /// Positions held (`rows` floats a position).
    pub fn positions(&self, row: usize) -> usize {
        self.k.len() / row.max(1)
    }
    /// Drops every position from `len` on.
    pub fn truncate(&mut self, len: usize, row: usize) {
        self.k.truncate(len * row);
        self.v.truncate(len * row);
    }
}

impl SequenceState {
    pub fn new(cfg: &TextConfig) -> Self {
        let layers = cfg
            .layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::Gdn => LayerState::Gdn(GdnState {
                    conv: vec![0.0; (cfg.conv_kernel - 1) * cfg.gdn_conv_channels()],
                    recurrent: vec![
                        0.0;
                        cfg.gdn_num_value_heads * cfg.gdn_key_dim * cfg.gdn_value_dim
                    ],
                }),
                LayerKind::Attention => LayerState::Attention(KvCache {
                    k: Vec::new(),
                    v: Vec::new(),
                }),
            })
            .collect();
        SequenceState {
            len: 0,
            layers,
            mtp: None,
            verified: None,
        }
    }

    /// A copy of the state as it is now.
    pub fn snapshot(&self) -> SequenceState {
        self.clone()
    }

    /// Rolls this sequence back (or forward) to `snap`.
    pub fn restore(&mut self, snap: &SequenceState) {
        self.clone_from(snap);
    }

    /// Bytes held by this state (f32 on the CPU backend).
    pub fn memory_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Gdn(g) => (g.conv.len() + g.recurrent.len()) * 4,
                LayerState::Attention(kv) => (kv.k.len() + kv.v.len()) * 4,
            })
            .sum::<usize>()
            + self.mtp.as_ref().map_or(0, |m| {
                (m.kv.k.len() + m.kv.v.len() + m.hidden.len()) * 4 + m.next.len() * 4
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_size_state_memory() {
        let cfg = TextConfig::qwen36_35b_a3b();
        let s = SequenceState::new(&cfg);
        // f32 conv (3 x 8192) + f32 recurrent (32 x 128 x 128) per GDN layer, empty KV.
        assert_eq!(s.memory_bytes(), 30 * (3 * 8192 + 32 * 128 * 128) * 4);
        let mut t = s.snapshot();
        t.len = 5;
        assert_ne!(s, t);
        t.restore(&s);
        assert_eq!(s, t);
    }
}
