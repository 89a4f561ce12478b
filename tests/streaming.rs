//! Incremental detokenization, stop strings and reasoning/answer separation on the real
//! (bundled) Qwen3.6 tokenizer: multi-byte characters split across tokens, CJK, emoji,
//! combining marks and whitespace must come out exactly as a one-shot decode, never broken.

use anyhow::Result;
use kestrel::generate::{Channel, ReplyDecoder, StopMatcher, TextStream};
use kestrel::tokenizer::{Tokenizer, special};
use std::cell::Cell;
use std::sync::OnceLock;

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::bundled().unwrap())
}

fn decode(ids: &[u32]) -> Result<String> {
    tokenizer().decode(ids, true)
}

/// GPT-2's byte -> printable character map that byte-level BPE vocabularies are written in.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    if printable(b) {
        return char::from_u32(b as u32).unwrap();
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap()
}

/// One token per byte of `text`: every multi-byte character is split across tokens.
fn byte_tokens(text: &str) -> Vec<u32> {
    text.bytes()
        .map(|b| {
            tokenizer()
                .token_to_id(&byte_char(b).to_string())
                .unwrap_or_else(|| panic!("no single-byte token for {b:#04x}"))
        })
        .collect()
}

/// Streams `ids` one at a time; returns the pieces (the held-back rest flushed at the end).
fn stream(ids: &[u32]) -> Vec<String> {
    let mut s = TextStream::new();
    let mut pieces: Vec<String> = ids.iter().map(|&id| s.push(id, decode).unwrap()).collect();
    pieces.push(s.finish(decode).unwrap());
    pieces
}

const TRICKY: &[&str] = &[
    "你好，世界！今天天气很好。",
    "日本語のテキストと한국어 텍스트",
    "emoji: 👋🏽 👨‍👩‍👧‍👦 🇯🇵 ❤️ done",
    "combining: e\u{301} a\u{308}\u{323} Z\u{335}\u{321}a\u{336}l\u{337}g\u{338}o",
    "  leading spaces,   inner   runs, trailing  ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "mixed: price €12.50 → ¥1,800 (≈) «quoted» — dash…",
    "code: fn main() { println!(\"{}\", 1 + 2); } // 注释",
    "Ελληνικά, русский, العربية, עברית, हिन्दी, ไทย",
];

#[test]
fn streaming_equals_one_shot_decode_for_real_tokenizations() {
    for text in TRICKY {
        let ids = tokenizer().encode(text, false).unwrap();
        let pieces = stream(&ids);
        assert!(
            pieces.iter().all(|p| !p.contains('\u{FFFD}')),
            "{text:?}: {pieces:?}"
        );
        assert_eq!(pieces.concat(), decode(&ids).unwrap(), "{text:?}");
    }
}

#[test]
fn characters_split_across_byte_tokens_are_emitted_whole() {
    for text in TRICKY {
        let ids = byte_tokens(text);
        let pieces = stream(&ids);
        assert!(
            pieces.iter().all(|p| !p.contains('\u{FFFD}')),
            "{text:?}: {pieces:?}"
        );
        assert_eq!(&pieces.concat(), text);
    }
    // "你" is three bytes: nothing until the third, then the whole character.
    let ids = byte_tokens("a你b");
    assert_eq!(stream(&ids), vec!["a", "", "", "你", "b", ""]);
    // A four-byte emoji after a space.
    let ids = byte_tokens(" 👋");
    assert_eq!(stream(&ids), vec![" ", "", "", "", "👋", ""]);
}

#[test]
fn an_unfinished_character_at_the_end_is_flushed_lossily() {
    let mut ids = byte_tokens("ok ");
    ids.extend(&byte_tokens("你")[..2]);
    let pieces = stream(&ids);
    assert_eq!(pieces[..ids.len()].concat(), "ok ");
    assert_eq!(pieces.last().unwrap(), "\u{FFFD}");
}

#[test]
fn each_token_decodes_a_short_window_not_the_whole_reply() {
    // The reply grows to thousands of tokens; every push must decode only a few ids.
    let text = TRICKY.concat().repeat(20);
    let mut ids = tokenizer().encode(&text, false).unwrap();
    ids.extend(byte_tokens("末尾👋🏽"));
    assert!(ids.len() > 2000);
    let longest = Cell::new(0usize);
    let calls = Cell::new(0usize);
    let counting = |w: &[u32]| {
        longest.set(longest.get().max(w.len()));
        calls.set(calls.get() + 1);
        decode(w)
    };
    let mut s = TextStream::new();
    let mut out = String::new();
    for &id in &ids {
        out.push_str(&s.push(id, counting).unwrap());
    }
    out.push_str(&s.finish(counting).unwrap());
    assert_eq!(out, decode(&ids).unwrap());
    assert!(
        longest.get() <= 8,
        "a push decoded a window of {} ids",
        longest.get()
    );
    assert!(calls.get() <= 2 * ids.len() + 2);
}

#[test]
fn stop_strings_spanning_tokens_are_caught_and_not_printed() {
    let text = "The answer is forty-two. Next question please.";
    let ids = tokenizer().encode(text, false).unwrap();
    // The stop string starts inside one token and ends inside another.
    let stop = "two. Nex".to_string();
    let mut s = TextStream::new();
    let mut m = StopMatcher::new(std::slice::from_ref(&stop));
    let mut out = String::new();
    let mut stopped_at = None;
    for (i, &id) in ids.iter().enumerate() {
        let (t, stop) = m.push(&s.push(id, decode).unwrap());
        out.push_str(&t);
        assert!(!out.contains("two."), "stop text leaked: {out:?}");
        if stop {
            stopped_at = Some(i);
            break;
        }
    }
    assert_eq!(out, "The answer is forty-");
    let at = stopped_at.expect("stop string not found");
    assert!(at < ids.len() - 1);
}

#[test]
fn reply_decoder_separates_reasoning_from_answer() {
    let t = tokenizer();
    let text = "<think>\nLet me think: 你好.\n</think>\n\nThe answer: 👋 done<|im_end|>";
    let ids = t.encode(text, true).unwrap();
    assert!(ids.contains(&special::THINK) && ids.contains(&special::THINK_END));
    let mut d = ReplyDecoder::new(
        Some((special::THINK, special::THINK_END)),
        false,
        &[],
        &[special::IM_END],
    );
    let mut pieces = Vec::new();
    for &id in &ids {
        let (p, stop) = d.push(id, decode).unwrap();
        assert!(!stop);
        pieces.extend(p);
    }
    pieces.extend(d.finish(decode).unwrap());
    let join = |ch| {
        pieces
            .iter()
            .filter(|(c, _)| *c == ch)
            .map(|(_, s)| s.as_str())
            .collect::<String>()
    };
    assert_eq!(join(Channel::Reasoning), "Let me think: 你好.\n");
    assert_eq!(join(Channel::Answer), "The answer: 👋 done");
    assert_eq!(d.reasoning, "Let me think: 你好.\n");
    assert_eq!(d.answer, "The answer: 👋 done");
    // All reasoning pieces come before all answer pieces.
    let first_answer = pieces
        .iter()
        .position(|(c, _)| *c == Channel::Answer)
        .unwrap();
    assert!(
        pieces[first_answer..]
            .iter()
            .all(|(c, _)| *c == Channel::Answer)
    );
}

#[test]
fn reply_decoder_starts_in_reasoning_when_the_prompt_opened_it() {
    let t = tokenizer();
    let ids = t
        .encode("step one\n</think>\n\nfinal STOP ignored", true)
        .unwrap();
    let mut d = ReplyDecoder::new(
        Some((special::THINK, special::THINK_END)),
        true,
        &["STOP".to_string()],
        &[],
    );
    let mut stopped = false;
    for &id in &ids {
        let (_, stop) = d.push(id, decode).unwrap();
        if stop {
            stopped = true;
            break;
        }
    }
    assert!(stopped);
    assert_eq!(d.reasoning, "step one\n");
    assert_eq!(d.answer, "final ");
}
