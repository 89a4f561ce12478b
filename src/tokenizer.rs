//! The Qwen3.5/3.6 byte-level BPE tokenizer (`tokenizer.json` via the `tokenizers` crate)
//! and the checkpoint's chat template.

use crate::chat::ChatTemplate;
use anyhow::{Context, Result, anyhow};
use std::io::Read;
use std::path::Path;

/// The real Qwen3.6 tokenizer and template, built from the public vocabulary
/// (`scripts/build_tokenizer.py`); used by the demo model and when a checkpoint ships none.
const BUNDLED_TOKENIZER_GZ: &[u8] = include_bytes!("../assets/qwen3_6/tokenizer.json.gz");
const BUNDLED_TEMPLATE: &str = include_str!("../assets/qwen3_6/chat_template.jinja");

/// Ids of the real model's special tokens (`model-spec.md` §1.6).
pub mod special {
    pub const ENDOFTEXT: u32 = 248_044;
    pub const IM_START: u32 = 248_045;
    pub const IM_END: u32 = 248_046;
    pub const TOOL_CALL: u32 = 248_058;
    pub const TOOL_CALL_END: u32 = 248_059;
    pub const THINK: u32 = 248_068;
    pub const THINK_END: u32 = 248_069;
    /// Ids at or above this are padding rows of the 248,320-row embedding.
    pub const FIRST_PADDING_ID: u32 = 248_077;
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// A copy that treats special-token text as plain text, made on first use.
    literal: std::sync::OnceLock<tokenizers::Tokenizer>,
    pub template: Option<ChatTemplate>,
}

fn gunzip(bytes: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_end(&mut out)
        .context("corrupt gzip data")?;
    Ok(out)
}

impl Tokenizer {
    fn from_json_bytes(bytes: &[u8], what: &str) -> Result<tokenizers::Tokenizer> {
        tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| anyhow!("cannot load tokenizer {what}: {e}"))
    }

    /// The bundled Qwen3.6 tokenizer and chat template.
    pub fn bundled() -> Result<Self> {
        let json = gunzip(BUNDLED_TOKENIZER_GZ)?;
        Ok(Tokenizer {
            inner: Self::from_json_bytes(&json, "(bundled)")?,
            literal: Default::default(),
            template: Some(ChatTemplate::new(BUNDLED_TEMPLATE)?),
        })
    }

    /// Loads `tokenizer.json` (or `.json.gz`) and the chat template of a checkpoint
    /// (`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let plain = dir.join("tokenizer.json");
        let gz = dir.join("tokenizer.json.gz");
        let inner = if plain.exists() {
            let bytes = std::fs::read(&plain)
                .with_context(|| format!("cannot read {}", plain.display()))?;
            Self::from_json_bytes(&bytes, &plain.display().to_string())?
        } else if gz.exists() {
            let bytes =
                std::fs::read(&gz).with_context(|| format!("cannot read {}", gz.display()))?;
            Self::from_json_bytes(&gunzip(&bytes)?, &gz.display().to_string())?
        } else {
            anyhow::bail!(
                "no tokenizer.json in {} (a Qwen3.6 checkpoint ships one)",
                dir.display()
            );
        };
        Ok(Tokenizer {
            inner,
            literal: Default::default(),
            template: ChatTemplate::from_dir(dir)?,
        })
    }

    /// Loads from `dir` when it has a tokenizer, else the bundled one.
    pub fn for_model_dir(dir: &Path) -> Result<Self> {
        if dir.join("tokenizer.json").exists() || dir.join("tokenizer.json.gz").exists() {
            let mut t = Self::from_dir(dir)?;
            if t.template.is_none() {
                t.template = Some(ChatTemplate::new(BUNDLED_TEMPLATE)?);
            }
            Ok(t)
        } else {
            tracing::warn!(
                "{} has no tokenizer.json; using the bundled Qwen3.6 tokenizer",
                dir.display()
            );
            Self::bundled()
        }
    }

    /// Encodes text. With `parse_special`, special-token text such as `<|im_start|>` becomes
    /// its single id (for rendered chat prompts); without, it is ordinary text.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let tok = if parse_special {
            &self.inner
        } else {
            self.literal.get_or_init(|| {
                let mut t = self.inner.clone();
                t.set_encode_special_tokens(true);
                t
            })
        };
        let enc = tok
            .encode(text, false)
            .map_err(|e| anyhow!("tokenization failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text (`skip_special` drops special tokens like `<|im_end|>`; `<think>`
    /// and `<tool_call>` are not special and always stay).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| anyhow!("detokenization failed: {e}"))
    }

    /// The bytes token `id` stands for: its decoded text where that is whole UTF-8 (special
    /// tokens included), else its byte-level BPE characters mapped back to their bytes (a
    /// piece of a multi-byte character). `None` for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let piece = self.inner.id_to_token(id)?;
        let text = self.decode(&[id], false).ok()?;
        if !text.contains('\u{FFFD}') {
            return Some(text.into_bytes());
        }
        // GPT-2's byte-to-unicode table, inverted: printable bytes stand for themselves, the
        // others (in order) for U+0100 upwards.
        let direct = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
        let others: Vec<u8> = (0..=255u32)
            .filter(|&b| !direct(b))
            .map(|b| b as u8)
            .collect();
        piece
            .chars()
            .map(|c| match c as u32 {
                b if b < 256 && direct(b) => Some(b as u8),
                b if b >= 256 => others.get((b - 256) as usize).copied(),
                _ => None,
            })
            .collect()
    }

    /// The most bytes of text one token stands for (a vocabulary token's byte-level
    /// characters are a byte each; an added token is its text): so text of `n` bytes is at
    /// least `n / max_token_bytes()` tokens, known without tokenizing it.
    pub fn max_token_bytes(&self) -> usize {
        let vocab = self.inner.get_vocab(false);
        let added = self.inner.get_added_tokens_decoder();
        let regular = vocab.keys().map(|t| t.chars().count());
        let special = added.values().map(|t| t.content.len());
        regular.chain(special).max().unwrap_or(1).max(1)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The tokenizer as `tokenizer.json` text (for the grammar engine's vocabulary).
    pub fn to_json(&self) -> Result<String> {
        self.inner
            .to_string(false)
            .map_err(|e| anyhow!("cannot serialise the tokenizer: {e}"))
    }

    /// Number of ids the tokenizer defines (including added tokens).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
