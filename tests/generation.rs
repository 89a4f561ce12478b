//! The generation loop and the chat session on a scripted engine whose "state" is the list of
//! ids it has processed: so every test can check exactly what was prefilled, what a reused
//! state held, and what was fed back.

use anyhow::Result;
use kestrel::config::TextConfig;
use kestrel::generate::{
    GenerateOptions, ReplySettings, StopReason, ThinkingControl, generate, reply,
};
use kestrel::model::{Engine, Logits};
use kestrel::sampling::{Sampler, SamplingParams};
use kestrel::session::{Conversation, chat_turn};
use kestrel::tokenizer::{Tokenizer, special};
use std::cell::RefCell;
use std::sync::OnceLock;
use std::sync::atomic::AtomicBool;

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::bundled().unwrap())
}

/// Replies with `script`, whatever the input: a call that feeds back its last prediction
/// gets the next id of `script` (cycling); any other call (a prompt, a forced id) restarts
/// it. Records every forward call's token count.
struct Scripted {
    config: TextConfig,
    script: Vec<u32>,
    calls: RefCell<Vec<usize>>,
    /// The state's ids after the last prompt (multi-token) call.
    prefilled: RefCell<Vec<u32>>,
    /// Calls of `forward_greedy_id` (the engine choosing the next id itself).
    greedy_calls: RefCell<usize>,
}

impl Scripted {
    fn new(script: Vec<u32>) -> Self {
        Scripted {
            config: kestrel::synthetic::demo_config(),
            script,
            calls: RefCell::new(Vec::new()),
            prefilled: RefCell::new(Vec::new()),
            greedy_calls: RefCell::new(0),
        }
    }
}

/// The ids processed so far, the script position, the last prediction.
#[derive(Clone, Debug, PartialEq)]
struct Ids(Vec<u32>, usize, Option<u32>);

impl Engine for Scripted {
    type State = Ids;
    fn config(&self) -> &TextConfig {
        &self.config
    }
    fn new_state(&self) -> Result<Ids> {
        Ok(Ids(Vec::new(), 0, None))
    }
    fn state_len(&self, s: &Ids) -> usize {
        s.0.len()
    }
    fn state_bytes(&self, s: &Ids) -> usize {
        s.0.len() * 4
    }
    fn forward(&self, s: &mut Ids, tokens: &[u32], _: Logits) -> Result<Vec<f32>> {
        self.calls.borrow_mut().push(tokens.len());
        s.0.extend_from_slice(tokens);
        if tokens.len() > 1 {
            *self.prefilled.borrow_mut() = s.0.clone();
        }
        s.1 = if s.2.is_some_and(|p| tokens == [p]) {
            s.1 + 1
        } else {
            0
        };
        let next = self.script[s.1 % self.script.len()];
        s.2 = Some(next);
        let mut logits = vec![0.0; self.config.vocab_size];
        logits[next as usize] = 50.0;
        // A padding row that greedy decoding would pick if it were allowed.
        logits[special::FIRST_PADDING_ID as usize + 3] = 100.0;
        Ok(logits)
    }
    fn forward_greedy_id(&self, s: &mut Ids, token: u32, vocab_limit: usize) -> Result<u32> {
        *self.greedy_calls.borrow_mut() += 1;
        let logits = self.forward(s, &[token], Logits::Last)?;
        Ok(kestrel::sampling::greedy_id(&logits, vocab_limit))
    }
}

fn opts(max_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        stop_ids: vec![special::IM_END],
        prefill_chunk: 3,
        max_seq: 10_000,
        thinking: None,
        device_greedy: false,
        speculative: None,
    }
}

/// The thinking block's ids with an optional budget and the ids that close it.
fn thinking(budget: Option<usize>, close_ids: &[u32]) -> ThinkingControl {
    ThinkingControl {
        open_id: special::THINK,
        close_id: special::THINK_END,
        budget,
        close_ids: close_ids.to_vec(),
    }
}

fn greedy() -> Sampler {
    Sampler::new(
        SamplingParams {
            temperature: 0.0,
            vocab_limit: tokenizer().vocab_size(),
            ..Default::default()
        },
        0,
    )
}

fn ids(text: &str) -> Vec<u32> {
    tokenizer().encode(text, false).unwrap()
}

#[test]
fn prefill_in_chunks_then_one_token_per_step_and_stop_at_end_token() {
    let words = ids(" alpha beta gamma");
    let mut script = words.clone();
    script.push(special::IM_END);
    let e = Scripted::new(script);
    let mut state = e.new_state().unwrap();
    let prompt: Vec<u32> = (1000..1008).collect();
    let g = generate(
        &e,
        &mut state,
        &prompt,
        false,
        &opts(100),
        &mut greedy(),
        &AtomicBool::new(false),
        Some(5),
        |id, logits| {
            // Each id comes with the logits it was chosen from.
            assert_eq!(logits[id as usize], 50.0);
            assert_eq!(
                greedy().logprobs(logits, id, 1).top[0].0,
                id,
                "the chosen id is the most likely one"
            );
            None
        },
    )
    .unwrap();
    let mut expected = words.clone();
    expected.push(special::IM_END);
    assert_eq!(g.stats.generated, expected);
    assert_eq!(g.stats.stop, StopReason::EndToken);
    // 8 prompt tokens split at 5 into chunks of 3: 3, 2 | 3; then one call per fed token.
    let calls = e.calls.borrow().clone();
    assert_eq!(calls[..3], [3, 2, 3]);
    assert!(calls[3..].iter().all(|&n| n == 1));
    assert_eq!(calls.len(), 3 + words.len());
    assert_eq!(g.snapshot.unwrap().0, prompt[..5].to_vec());
    // The state holds the prompt and every generated id but the last (never fed).
    let mut held = prompt.clone();
    held.extend(&words);
    assert_eq!(state.0, held);
    assert_eq!(g.stats.fed_tokens(), &words[..]);
}

#[test]
fn max_tokens_context_limit_and_cancel() {
    let e = Scripted::new(ids(" la la la la"));
    let prompt: Vec<u32> = vec![1, 2, 3];
    let run = |o: GenerateOptions, cancel: bool| {
        let mut state = e.new_state().unwrap();
        generate(
            &e,
            &mut state,
            &prompt,
            false,
            &o,
            &mut greedy(),
            &AtomicBool::new(cancel),
            None,
            |_, _| None,
        )
    };
    let g = run(opts(5), false).unwrap();
    assert_eq!(
        (g.stats.generated.len(), g.stats.stop),
        (5, StopReason::MaxTokens)
    );
    let mut o = opts(100);
    o.max_seq = 7;
    let g = run(o.clone(), false).unwrap();
    assert_eq!(g.stats.stop, StopReason::ContextFull);
    assert_eq!(g.stats.prompt_tokens + g.stats.fed_tokens().len(), 7);
    o.max_seq = 2;
    let err = match run(o, false) {
        Ok(_) => panic!("a prompt over the context limit must fail"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("3 tokens") && err.contains("context limit is 2"),
        "{err}"
    );
    let g = run(opts(5), true).unwrap();
    assert_eq!(g.stats.stop, StopReason::Cancelled);
    assert!(!g.stats.prefill_complete && g.stats.generated.is_empty());
}

#[test]
fn padding_rows_are_never_sampled() {
    // The scripted logits put 100.0 on a padding id; every sampler must skip it.
    let e = Scripted::new(ids(" ok"));
    for temperature in [0.0, 1.0] {
        let mut s = Sampler::new(
            SamplingParams {
                temperature,
                vocab_limit: tokenizer().vocab_size(),
                ..Default::default()
            },
            5,
        );
        let mut state = e.new_state().unwrap();
        let g = generate(
            &e,
            &mut state,
            &[1, 2],
            false,
            &opts(4),
            &mut s,
            &AtomicBool::new(false),
            None,
            |_, _| None,
        )
        .unwrap();
        assert!(
            g.stats
                .generated
                .iter()
                .all(|&id| id < special::FIRST_PADDING_ID)
        );
    }
}

#[test]
fn thinking_budget_forces_the_end_of_the_thinking_block() {
    let e = Scripted::new(ids(" hmm"));
    let close_ids = tokenizer().encode("</think>\n\n", true).unwrap();
    assert_eq!(close_ids[0], special::THINK_END);
    let run = |o: &GenerateOptions| {
        let mut state = e.new_state().unwrap();
        generate(
            &e,
            &mut state,
            &[special::THINK, 198],
            true,
            o,
            &mut greedy(),
            &AtomicBool::new(false),
            None,
            |_, _| None,
        )
        .unwrap()
    };
    let mut o = opts(8);
    o.thinking = Some(thinking(Some(3), &close_ids));
    let g = run(&o);
    let hmm = ids(" hmm")[0];
    let mut expected = vec![hmm; 3];
    expected.extend(&close_ids);
    expected.extend(vec![hmm; 8 - expected.len()]);
    assert_eq!(g.stats.generated, expected);
    assert_eq!(g.stats.forced_tokens, close_ids.len());
    // Without a budget nothing is forced.
    o.thinking.as_mut().unwrap().budget = None;
    let g = run(&o);
    assert_eq!(g.stats.generated, vec![hmm; 8]);
}

/// With `device_greedy` a plain greedy sampler's ids come from the engine's own argmax
/// (`forward_greedy_id`, once a generated id): the same ids, a forced thinking close still
/// first; a penalised sampler or the option off keep sampling the logits.
#[test]
fn device_greedy_takes_the_engines_ids_and_keeps_forced_ones_first() {
    let hmm = ids(" hmm")[0];
    let close_ids = tokenizer().encode("</think>\n\n", true).unwrap();
    let run = |device_greedy: bool, budget: Option<usize>, sampler: &mut Sampler| {
        let e = Scripted::new(ids(" hmm"));
        let mut o = opts(8);
        o.device_greedy = device_greedy;
        o.thinking = Some(thinking(budget, &close_ids));
        let mut state = e.new_state().unwrap();
        let mut seen_logits = Vec::new();
        let g = generate(
            &e,
            &mut state,
            &[special::THINK, 198],
            true,
            &o,
            sampler,
            &AtomicBool::new(false),
            None,
            |_, l| {
                seen_logits.push(l.len());
                None
            },
        )
        .unwrap();
        let calls = *e.greedy_calls.borrow();
        (
            g.stats.generated,
            g.stats.forced_tokens,
            calls,
            seen_logits,
            state,
        )
    };
    for budget in [None, Some(3)] {
        let (ids_off, forced_off, calls_off, _, state_off) = run(false, budget, &mut greedy());
        let (ids_on, forced_on, calls_on, logits_on, state_on) = run(true, budget, &mut greedy());
        assert_eq!(ids_on, ids_off, "budget {budget:?}");
        assert_eq!(forced_on, forced_off);
        assert_eq!(state_on, state_off, "the same ids fed back");
        assert_eq!(calls_off, 0);
        assert_eq!(
            calls_on, 7,
            "every generated id but the last one fed through the engine's argmax"
        );
        // the first id is sampled from the prompt's logits; later ones see none
        assert_eq!(logits_on[0], kestrel::synthetic::demo_config().vocab_size);
        assert!(logits_on[1..].iter().all(|&n| n == 0));
        if budget.is_some() {
            assert_eq!(forced_on, close_ids.len());
            assert_eq!(ids_on[3], special::THINK_END);
        } else {
            assert_eq!(ids_on, vec![hmm; 8]);
        }
    }
    // a penalised greedy sampler needs the logits
    let mut penalised = Sampler::new(
        SamplingParams {
            temperature: 0.0,
            repetition_penalty: 1.1,
            vocab_limit: tokenizer().vocab_size(),
            ..Default::default()
        },
        0,
    );
    assert!(!penalised.is_plain_greedy());
    let (_, _, calls, _, _) = run(true, None, &mut penalised);
    assert_eq!(calls, 0);
}

fn settings(max_tokens: usize) -> ReplySettings {
    ReplySettings {
        opts: GenerateOptions {
            prefill_chunk: 4096,
            ..opts(max_tokens)
        },
        stop_strings: vec![],
        think_ids: Some((special::THINK, special::THINK_END)),
    }
}

#[test]
fn second_chat_turn_resumes_from_the_saved_state() {
    let t = tokenizer();
    let mut script = t
        .encode("Reasoning here.\n</think>\n\nHello back!", true)
        .unwrap();
    script.push(special::IM_END);
    let e = Scripted::new(script);
    let mut conv = Conversation::new();
    conv.system = Some("Be brief.".into());
    let mut sampler = greedy();
    let cancel = AtomicBool::new(false);
    let mut shown = String::new();
    let r1 = chat_turn(
        &e,
        t,
        &mut conv,
        "Hi!",
        &settings(64),
        &mut sampler,
        &cancel,
        |_, s| {
            shown.push_str(s);
            Ok(())
        },
    )
    .unwrap();
    assert_eq!(r1.stats.cached_tokens, 0);
    assert_eq!(r1.stats.stop, StopReason::EndToken);
    assert_eq!(r1.reasoning, "Reasoning here.\n");
    assert_eq!(r1.answer, "Hello back!");
    assert_eq!(shown, "Reasoning here.\nHello back!");
    assert_eq!(conv.messages.len(), 2);
    assert_eq!(conv.messages[1]["content"], "Hello back!");

    e.calls.borrow_mut().clear();
    let r2 = chat_turn(
        &e,
        t,
        &mut conv,
        "And again?",
        &settings(64),
        &mut sampler,
        &cancel,
        |_, _| Ok(()),
    )
    .unwrap();
    // The first turn's system + user messages are reused; the rest is prefilled.
    let history1 = t
        .encode(
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
            true,
        )
        .unwrap();
    assert_eq!(r2.stats.cached_tokens, history1.len());
    // Only the new part is prefilled (split where the next turn's saved state is taken),
    // then one token per step.
    let calls = e.calls.borrow().clone();
    assert_eq!(calls[0] + calls[1], r2.stats.prefilled_tokens());
    assert!(calls[2..].iter().all(|&n| n == 1));
    assert_eq!(
        r2.stats.prompt_tokens,
        conv_prompt_len_before_reply(&conv, t)
    );
    // A third turn reuses the second's history, which is longer.
    let r3 = chat_turn(
        &e,
        t,
        &mut conv,
        "Third.",
        &settings(4),
        &mut sampler,
        &cancel,
        |_, _| Ok(()),
    )
    .unwrap();
    assert!(r3.stats.cached_tokens > r2.stats.cached_tokens);
    // /reset forgets the saved states.
    conv.reset();
    let r4 = chat_turn(
        &e,
        t,
        &mut conv,
        "Fresh.",
        &settings(4),
        &mut sampler,
        &cancel,
        |_, _| Ok(()),
    )
    .unwrap();
    assert_eq!(r4.stats.cached_tokens, 0);
}

/// The prompt length of the last turn: everything up to its reply.
fn conv_prompt_len_before_reply(conv: &Conversation<Ids>, t: &Tokenizer) -> usize {
    let mut c: Conversation<Ids> = Conversation::new();
    c.system = conv.system.clone();
    c.enable_thinking = conv.enable_thinking;
    c.messages = conv.messages[..conv.messages.len() - 1].to_vec();
    c.prompt(t).unwrap().ids.len()
}

#[test]
fn the_state_after_a_reply_is_reused_when_the_template_renders_it_back() {
    // A template that renders past replies verbatim: the state after the whole previous turn
    // (prompt + reply) is a prefix of the next prompt and is resumed, not just the history.
    let mut t = Tokenizer::bundled().unwrap();
    t.template = Some(
        kestrel::chat::ChatTemplate::new(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n\
             {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        )
        .unwrap(),
    );
    let mut script = t.encode("Plain answer.", true).unwrap();
    script.push(special::IM_END);
    let e = Scripted::new(script.clone());
    let mut conv = Conversation::new();
    let mut sampler = greedy();
    let cancel = AtomicBool::new(false);
    let mut previous_end = 0;
    for (i, msg) in ["one", "two", "three"].iter().enumerate() {
        let r = chat_turn(
            &e,
            &t,
            &mut conv,
            msg,
            &settings(16),
            &mut sampler,
            &cancel,
            |_, _| Ok(()),
        )
        .unwrap();
        assert_eq!(r.answer, "Plain answer.");
        if i > 0 {
            // Everything up to the end of the previous reply (less its unfed end token).
            assert_eq!(r.stats.cached_tokens, previous_end);
        }
        previous_end = r.stats.prompt_tokens + r.stats.fed_tokens().len();
    }
}

#[test]
fn a_resumed_state_plus_the_prefill_is_exactly_the_new_prompt() {
    // Whatever is reused, the ids the engine ends up with before decoding must be the turn's
    // full prompt: nothing stale kept, nothing skipped.
    let t = tokenizer();
    let mut script = t.encode("Thought.\n</think>\n\nAnswer.", true).unwrap();
    script.push(special::IM_END);
    let e = Scripted::new(script);
    let mut conv = Conversation::new();
    let mut sampler = greedy();
    let cancel = AtomicBool::new(false);
    let mut last_state = Vec::new();
    for msg in ["first", "second", "third"] {
        let r = chat_turn(
            &e,
            t,
            &mut conv,
            msg,
            &settings(16),
            &mut sampler,
            &cancel,
            |_, _| Ok(()),
        )
        .unwrap();
        let mut before_reply: Conversation<Ids> = Conversation::new();
        before_reply.messages = conv.messages[..conv.messages.len() - 1].to_vec();
        let prompt = before_reply.prompt(t).unwrap().ids;
        assert_eq!(r.stats.prompt_tokens, prompt.len());
        let state = e.prefilled.borrow().clone();
        assert_eq!(state, prompt, "turn {msg:?}");
        assert_ne!(state, last_state);
        last_state = state;
    }
}

#[test]
fn an_over_long_conversation_is_refused_and_left_unchanged() {
    let e = Scripted::new(ids(" x"));
    let mut conv = Conversation::new();
    let mut s = settings(4);
    s.opts.max_seq = 12;
    let err = chat_turn(
        &e,
        tokenizer(),
        &mut conv,
        "a long message that does not fit in twelve tokens at all, really",
        &s,
        &mut greedy(),
        &AtomicBool::new(false),
        |_, _| Ok(()),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("context limit is 12"), "{err}");
    assert!(conv.messages.is_empty());
}

#[test]
fn raw_reply_streams_and_stops_on_a_stop_string() {
    let t = tokenizer();
    let e = Scripted::new(t.encode("one two three four five", false).unwrap());
    let mut s = settings(50);
    s.stop_strings = vec!["ree fo".into()];
    let mut state = e.new_state().unwrap();
    let mut out = String::new();
    let (r, _) = reply(
        &e,
        t,
        &mut state,
        &[1, 2, 3],
        None,
        &s,
        &mut greedy(),
        &AtomicBool::new(false),
        |_, p| {
            out.push_str(p);
            Ok(())
        },
    )
    .unwrap();
    assert_eq!(r.stats.stop, StopReason::StopString);
    assert_eq!(out, "one two th");
    assert_eq!(r.answer, out);
}
