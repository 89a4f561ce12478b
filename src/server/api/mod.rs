//! The OpenAI wire format, without any HTTP: request validation (every client mistake is an
//! [`ApiError`] naming the field), and the response side ([`Assembler`] splits reasoning,
//! answer and tool calls; the `*_json` / `*_chunk` functions write OpenAI's exact shapes).
//!
//! Files: `error` ([`ApiError`]), `params` (the options both endpoints share, [`GenParams`]),
//! `request` (chat and completion bodies), `response` (reply shapes and SSE framing),
//! [`anthropic`] (the Anthropic Messages format onto the same chat input and replies).

pub mod anthropic;
mod error;
mod params;
mod request;
mod response;

pub use error::ApiError;
pub use params::{GenParams, parse_gen_params};
pub use request::{
    ChatInput, PromptInput, ToolChoice, parse_chat, parse_completion, parse_messages,
};
pub use response::{
    Assembler, Delta, ResponseMeta, SSE_DONE, Usage, chat_chunk, chat_json, completion_chunk,
    completion_json, delta_json, sse_data, tool_call_json, usage_chunk,
};
