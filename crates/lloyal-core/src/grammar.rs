//! Grammar-constrained decoding with llguidance.
//!
//! A [`Grammar`] is a matcher over one model's vocabulary: it masks the
//! logits of tokens the grammar forbids next and advances on the tokens a
//! branch accepts. It is plain data that clones cheaply (the compiled
//! grammar and lexer are shared), so a branch's grammar forks with it.
//!
//! The token environment (a byte trie of the vocabulary, with every
//! end-of-generation token as llguidance's EOS) is built once per model and
//! kept in the model. End-of-generation tokens are allowed exactly where the
//! grammar accepts.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use crate::error::{Error, Result};
use crate::gbnf::gbnf_to_lark;
use crate::model::Model;

/// How a grammar is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrammarSpec {
    /// llama.cpp's GBNF (the subset documented in [`crate::gbnf`]).
    Gbnf(String),
    /// llguidance's Lark syntax (<https://github.com/guidance-ai/llguidance>).
    Lark(String),
    /// A JSON schema, as JSON text.
    JsonSchema(String),
}

/// The compiled-grammar factory of one model, built on first use and kept
/// with the model ([`Model::cached`]).
struct GrammarFactory(std::result::Result<Arc<TokenEnv>, String>);

/// What every grammar of one model shares.
struct TokenEnv {
    factory: ParserFactory,
    /// `is_eog[t]`: llguidance's EOS set (end-of-generation tokens).
    is_eog: Vec<bool>,
}

/// Bounds on grammars (llguidance adds its own: `ParserLimits`, whose
/// defaults bound grammar size, lexer states and per-token work).
pub mod limits {
    /// Largest grammar or JSON schema text accepted.
    pub const MAX_SOURCE_BYTES: usize = 512 << 10;
    /// How deep GBNF parentheses may nest (llguidance's Lark limit too).
    pub const MAX_NESTING: usize = crate::gbnf::MAX_NESTING;
    /// llguidance's own bounds, set explicitly (they are its defaults; the
    /// values are listed in docs/limits.md): grammar size in symbols, lexer
    /// states, and the work one token's mask may take (past which the
    /// matcher reports an error instead of running on).
    pub fn llguidance() -> llguidance::api::ParserLimits {
        llguidance::api::ParserLimits {
            max_items_in_row: 2_000,
            initial_lexer_fuel: 1_000_000,
            step_lexer_fuel: 200_000,
            max_lexer_states: 250_000,
            max_grammar_size: 500_000,
            step_max_items: 50_000,
            precompute_large_lexemes: true,
            verbose_errors: true,
        }
    }

    /// Stack of the thread grammars are compiled on: enough for the
    /// longest rule chain `MAX_SOURCE_BYTES` can spell (about 3 KiB of
    /// stack per rule).
    pub(crate) const STACK_BYTES: usize = 512 << 20;
}

fn grammar_error(message: impl std::fmt::Display) -> Error {
    Error::Grammar(message.to_string())
}

/// A matcher failure (an internal llguidance error, not bad input).
fn matcher_error(e: anyhow::Error) -> Error {
    grammar_error(format!("grammar matcher failed: {e}"))
}

fn token_env(model: &Model) -> Result<Arc<TokenEnv>> {
    model
        .cached(|m| GrammarFactory(build_env(m).map(Arc::new)))
        .0
        .clone()
        .map_err(grammar_error)
}

/// The vocabulary as llguidance sees it: each token's bytes, special tokens
/// (those that render only as special) marked with TokTrie's 0xFF prefix.
fn build_env(model: &Model) -> std::result::Result<TokenEnv, String> {
    let n_vocab = model.vocab_size();
    let mut words = Vec::with_capacity(n_vocab as usize);
    let mut eog = Vec::new();
    let mut is_eog = vec![false; n_vocab as usize];
    for token in 0..n_vocab as i32 {
        let plain = model.token_bytes(token, false).map_err(|e| e.to_string())?;
        let word = if plain.is_empty() {
            let special = model.token_bytes(token, true).map_err(|e| e.to_string())?;
            if special.is_empty() {
                special
            } else {
                let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                marked.extend_from_slice(&special);
                marked
            }
        } else {
            plain
        };
        words.push(word);
        if model.is_stop_token(token).unwrap_or(false) {
            eog.push(token as u32);
            is_eog[token as usize] = true;
        }
    }
    if eog.is_empty() {
        return Err("the model has no end-of-generation token".to_owned());
    }
    let trie = TokTrie::from(&TokRxInfo::new(n_vocab, eog[0]), &words).with_eos_tokens(&eog);
    let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
    let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
    factory.quiet();
    *factory.limits_mut() = limits::llguidance();
    Ok(TokenEnv { factory, is_eog })
}

/// Compact JSON unless the schema says otherwise: small models given free
/// whitespace tend to emit runs of newlines.
fn with_json_defaults(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    schema
}

fn top_level(spec: &GrammarSpec) -> Result<TopLevelGrammar> {
    Ok(match spec {
        GrammarSpec::Gbnf(text) => {
            TopLevelGrammar::from_lark(gbnf_to_lark(text).map_err(grammar_error)?)
        }
        GrammarSpec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        GrammarSpec::JsonSchema(text) => {
            let schema: serde_json::Value = serde_json::from_str(text)
                .map_err(|e| grammar_error(format!("the JSON schema is not valid JSON: {e}")))?;
            if !(schema.is_object() || schema.is_boolean()) {
                return Err(grammar_error(
                    "a JSON schema must be an object or a boolean",
                ));
            }
            TopLevelGrammar::from_json_schema(with_json_defaults(schema))
        }
    })
}

/// A grammar matcher for one model. See the module docs.
#[derive(Clone)]
pub struct Grammar {
    matcher: Matcher,
    env: Arc<TokenEnv>,
    /// Tokens accepted since the start (for rollback).
    consumed: usize,
    /// Set for a lazy grammar ([`Grammar::lazy`]).
    lazy: Option<Box<Lazy>>,
}

/// The waiting side of a lazy grammar: the text produced so far, searched
/// for the trigger words.
#[derive(Clone)]
struct Lazy {
    words: Arc<[Vec<u8>]>,
    /// The bytes accepted tokens render as (special tokens as their text),
    /// the length after each accepted token, and the tokens themselves.
    seen: Vec<u8>,
    ends: Vec<usize>,
    tokens: Vec<u32>,
    /// `consumed` once the trigger's token was accepted; `None` while
    /// waiting.
    fired_at: Option<usize>,
}

impl Lazy {
    /// Where the first trigger word starts in `seen` followed by `more`, if
    /// one ends inside `more` (earlier text has been searched already).
    fn find(&self, more: &[u8]) -> Option<usize> {
        let longest = self.words.iter().map(Vec::len).max().unwrap_or(0);
        let from = self.seen.len().saturating_sub(longest.saturating_sub(1));
        let mut window = self.seen[from..].to_vec();
        window.extend_from_slice(more);
        self.words
            .iter()
            .filter(|w| !w.is_empty())
            .filter_map(|w| window.windows(w.len()).position(|x| x == w.as_slice()))
            .min()
            .map(|at| from + at)
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Grammar {
    /// Compile `spec` for `model`. An invalid grammar or schema is an
    /// [`Error::Grammar`] here, never an unconstrained matcher later.
    ///
    /// Compilation runs on a thread of its own with a large stack
    /// ([`limits`]): llguidance recurses along chains of rules (a chain of
    /// 3,000 rules overflowed an 8 MiB stack).
    pub fn new(model: &Model, spec: &GrammarSpec) -> Result<Self> {
        let env = token_env(model)?;
        let size = match spec {
            GrammarSpec::Gbnf(t) | GrammarSpec::Lark(t) | GrammarSpec::JsonSchema(t) => t.len(),
        };
        if size > limits::MAX_SOURCE_BYTES {
            return Err(grammar_error(format!(
                "the grammar is {size} bytes; at most {} are accepted",
                limits::MAX_SOURCE_BYTES
            )));
        }
        let spec = spec.clone();
        let compile_env = Arc::clone(&env);
        let matcher = crate::isolate::on_thread(
            "grammar",
            limits::STACK_BYTES,
            None,
            Error::Grammar,
            move || {
                let parser = compile_env
                    .factory
                    .create_parser(top_level(&spec)?)
                    .map_err(|e| grammar_error(error_head(&e.to_string())))?;
                let matcher = Matcher::new(Ok(parser));
                match matcher.get_error() {
                    Some(e) => Err(grammar_error(e)),
                    None => Ok(matcher),
                }
            },
        )?;
        Ok(Self {
            matcher,
            env,
            consumed: 0,
            lazy: None,
        })
    }

    /// Compile `spec` as a *lazy* grammar: it constrains nothing until the
    /// text the branch produces contains one of `triggers` (a tool-call
    /// opener such as `<tool_call>`); from the trigger's first byte on, the
    /// output must match `spec`, so the grammar is written to start with
    /// the trigger. What the branch produced from the trigger to the end of
    /// the token that completed it is fed to the grammar when that token is
    /// accepted (a token whose tail the grammar rejects is not allowed): the
    /// tokens themselves when the trigger starts on a token boundary (so a
    /// special-token trigger is that token), else that text tokenized.
    pub fn lazy(model: &Model, spec: &GrammarSpec, triggers: &[String]) -> Result<Self> {
        if triggers.is_empty() || triggers.iter().any(String::is_empty) {
            return Err(grammar_error(
                "a lazy grammar needs at least one trigger word, and no empty one",
            ));
        }
        let mut grammar = Self::new(model, spec)?;
        grammar.lazy = Some(Box::new(Lazy {
            words: triggers.iter().map(|w| w.as_bytes().to_vec()).collect(),
            seen: Vec::new(),
            ends: Vec::new(),
            tokens: Vec::new(),
            fired_at: None,
        }));
        Ok(grammar)
    }

    /// Whether the grammar constrains the next token: always, except for a
    /// lazy grammar still waiting for its trigger.
    pub fn constrains(&self) -> bool {
        self.lazy.as_ref().is_none_or(|l| l.fired_at.is_some())
    }

    /// Whether this is a lazy grammar and its trigger has appeared.
    pub fn triggered(&self) -> Option<bool> {
        self.lazy.as_ref().map(|l| l.fired_at.is_some())
    }

    /// The bytes `token` renders as (special tokens as their text).
    fn text_of(&self, token: i32) -> &[u8] {
        let bytes = self.env.factory.tok_env().tok_trie().token(token as u32);
        match bytes.split_first() {
            Some((&TokTrie::SPECIAL_TOKEN_MARKER, rest)) => rest,
            _ => bytes,
        }
    }

    /// For a waiting lazy grammar: the tokens to feed the matcher if
    /// accepting `token` fires the trigger (`None` if it does not).
    fn firing(&self, token: i32) -> Option<Vec<u32>> {
        let lazy = self.lazy.as_ref().filter(|l| l.fired_at.is_none())?;
        let more = self.text_of(token);
        let at = lazy.find(more)?;
        // Where the trigger starts on a token boundary, the grammar gets
        // the tokens themselves: a trigger that is a special token (a
        // family's `<|call|>`) is that token, not text spelling it.
        if at == lazy.seen.len() {
            return Some(vec![token as u32]);
        }
        if let Ok(i) = lazy.ends.binary_search(&at) {
            let mut tokens = lazy.tokens[i + 1..].to_vec();
            tokens.push(token as u32);
            return Some(tokens);
        }
        if at == 0 {
            let mut tokens = lazy.tokens.clone();
            tokens.push(token as u32);
            return Some(tokens);
        }
        // The trigger starts inside a token (" Paris" for "Paris"): what
        // precedes it is not fed, and the rest is tokenized again.
        let tail = match at.checked_sub(lazy.seen.len()) {
            None => [&lazy.seen[at..], more].concat(),
            Some(inside) => more[inside..].to_vec(),
        };
        Some(self.env.factory.tok_env().tokenize_bytes(&tail))
    }

    /// Set the logit of every token the grammar forbids next to -inf.
    /// Once the grammar is complete only end-of-generation tokens remain.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<()> {
        let vocab = self.env.is_eog.len();
        if logits.len() != vocab {
            return Err(crate::error::invalid(format!(
                "logits have {} entries; the vocabulary has {vocab}",
                logits.len(),
            )));
        }
        if !self.constrains() {
            return Ok(());
        }
        let mask = self.matcher.compute_mask_or_eos().map_err(matcher_error)?;
        // Walk the bitmask a word at a time: most words are all-zero or
        // all-one, and those need no per-bit test.
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = mask.as_slice().get(w).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (i, l) in chunk.iter_mut().enumerate() {
                if bits & (1 << i) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        Ok(())
    }

    /// Whether the grammar allows `token` next (nothing changes).
    pub fn allows(&mut self, token: i32) -> Result<bool> {
        let Some(&is_eog) = usize::try_from(token)
            .ok()
            .and_then(|t| self.env.is_eog.get(t))
        else {
            return Ok(false);
        };
        if is_eog {
            return Ok(self.is_accepting());
        }
        if !self.constrains() {
            return match self.firing(token) {
                None => Ok(true),
                Some(tail) => self
                    .matcher
                    .validate_tokens(&tail)
                    .map(|n| n == tail.len())
                    .map_err(matcher_error),
            };
        }
        if self.matcher.is_stopped() {
            return Ok(false);
        }
        let t = token as u32;
        self.matcher
            .validate_tokens(&[t])
            .map(|n| n == 1)
            .map_err(matcher_error)
    }

    /// Advance past `token`. A token the grammar forbids is an
    /// [`Error::Grammar`] and leaves the matcher as it was. An
    /// end-of-generation token (allowed once the grammar accepts) leaves
    /// the matcher as it is.
    pub fn accept(&mut self, token: i32) -> Result<()> {
        if !self.allows(token)? {
            return Err(grammar_error(format!(
                "token {token} is not allowed by the grammar here"
            )));
        }
        self.consume_allowed(token)
    }

    /// Advance past `token`, which [`Grammar::allows`] just approved (so
    /// the per-token path validates once, not twice).
    pub(crate) fn consume_allowed(&mut self, token: i32) -> Result<()> {
        if self.env.is_eog[token as usize] {
            return Ok(());
        }
        if !self.constrains() {
            let tail = self.firing(token);
            if let Some(tail) = &tail {
                self.matcher.consume_tokens(tail).map_err(matcher_error)?;
            }
            let more = self.text_of(token).to_vec();
            let consumed = self.consumed + 1;
            if let Some(lazy) = self.lazy.as_mut() {
                lazy.seen.extend_from_slice(&more);
                lazy.ends.push(lazy.seen.len());
                lazy.tokens.push(token as u32);
                lazy.fired_at = tail.map(|_| consumed);
            }
            self.consumed = consumed;
            return Ok(());
        }
        self.matcher
            .consume_token(token as u32)
            .map_err(matcher_error)?;
        self.consumed += 1;
        Ok(())
    }

    /// How many tokens the matcher has consumed (see [`Grammar::rewind`]).
    pub fn consumed(&self) -> usize {
        self.consumed
    }

    /// Undo accepted tokens until [`Grammar::consumed`] is `count` again.
    pub fn rewind(&mut self, count: usize) -> Result<()> {
        if count >= self.consumed {
            return Ok(());
        }
        if let Some(lazy) = self.lazy.as_mut() {
            if lazy.fired_at.is_some_and(|fired| count < fired) {
                // Back to before the trigger: waiting again.
                self.matcher.reset().map_err(matcher_error)?;
                lazy.fired_at = None;
            }
            if lazy.fired_at.is_none() {
                lazy.ends.truncate(count);
                lazy.tokens.truncate(count);
                lazy.seen.truncate(lazy.ends.last().copied().unwrap_or(0));
                self.consumed = count;
                return Ok(());
            }
        }
        self.matcher
            .rollback(self.consumed - count)
            .map_err(matcher_error)?;
        self.consumed = count;
        Ok(())
    }

    /// Back to the start of the grammar (a lazy grammar waits again).
    pub fn reset(&mut self) -> Result<()> {
        self.matcher.reset().map_err(matcher_error)?;
        self.consumed = 0;
        if let Some(lazy) = self.lazy.as_mut() {
            lazy.seen.clear();
            lazy.ends.clear();
            lazy.tokens.clear();
            lazy.fired_at = None;
        }
        Ok(())
    }

    /// Whether the text so far is a complete match (an end-of-generation
    /// token would be allowed now). A waiting lazy grammar accepts.
    pub fn is_accepting(&mut self) -> bool {
        !self.constrains()
            || self.matcher.is_stopped()
            || self.matcher.is_accepting().unwrap_or(false)
    }

    /// Whether nothing but end-of-generation can follow.
    pub fn is_stopped(&self) -> bool {
        self.constrains() && self.matcher.is_stopped()
    }
}

fn error_head(message: &str) -> String {
    // llguidance errors can carry long context dumps; the first lines say
    // what is wrong.
    message.lines().take(6).collect::<Vec<_>>().join("\n")
}

/// llama.cpp's JSON-schema-to-GBNF conversion (the text a user can inspect
/// or pass back as a GBNF grammar).
pub fn json_schema_to_grammar(schema: &str) -> Result<String> {
    serde_json::from_str::<serde_json::Value>(schema)
        .map_err(|e| grammar_error(format!("the JSON schema is not valid JSON: {e}")))?;
    llama_cpp_2::json_schema_to_grammar(schema)
        .map_err(|e| grammar_error(format!("llama.cpp could not convert the schema: {e}")))
}
