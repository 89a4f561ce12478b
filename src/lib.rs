//! Kestrel: an inference engine for exactly one model family, Qwen3.6-35B-A3B
//! (`qwen3_5_moe`): hybrid Gated DeltaNet / gated attention, 256-expert top-8 MoE.

pub mod bench;
pub mod chat;
pub mod config;
pub mod cuda;
pub mod generate;
pub mod grammar;
pub mod hub;
pub mod model;
pub mod ops;
pub mod sampling;
pub mod server;
pub mod session;
pub mod settings;
pub mod state;
pub mod synthetic;
pub mod tensor;
pub mod tokenizer;
pub mod tools;
pub mod weights;
