//! Fuzz targets for the parsers that read untrusted bytes: GGUF headers
//! (before llama.cpp sees a file), saved KV states (before llama.cpp's
//! reader, which trusts lengths), the GBNF translator and the chat-template
//! pre-check and parser. Each target generates inputs with proptest, both
//! random and mutated from valid ones, and fails on any panic (a stack
//! overflow would abort the test binary, which fails it too).
//!
//! Each target runs for `LLOYAL_FUZZ_SECONDS` seconds (default 2, which is
//! what CI runs); `scripts/fuzz.sh` runs them longer:
//!
//! ```text
//! LLOYAL_FUZZ_SECONDS=600 cargo test -p lloyal-core --test fuzz -- --test-threads=1 --nocapture
//! ```

use std::time::{Duration, Instant};

use lloyal_core::fuzzing::{check_state, frame_state, template_tag_tokens};
use lloyal_core::gguf::build::{header, V};
use lloyal_core::{chat, gbnf, gguf};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

/// Run `test` on inputs from `strategy` until the time budget is spent,
/// with a fresh seed every 256 cases. A failure is shrunk and reported.
fn fuzz<S: Strategy>(name: &str, strategy: S, test: impl Fn(S::Value)) {
    let seconds: u64 = std::env::var("LLOYAL_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut cases = 0u64;
    let mut round = 0u64;
    while Instant::now() < deadline {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let mut seed = [0u8; 32];
        seed[..8].copy_from_slice(&nanos.to_le_bytes());
        seed[8..16].copy_from_slice(&round.to_le_bytes());
        let config = Config {
            cases: 256,
            failure_persistence: None,
            ..Config::default()
        };
        let mut runner =
            TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &seed));
        if let Err(e) = runner.run(&strategy, |value| {
            test(value);
            Ok(())
        }) {
            panic!("{name}: {e}");
        }
        cases += 256;
        round += 1;
    }
    eprintln!("fuzz {name}: {cases} cases in {seconds} s, no failure");
}

/// A mutation applied to valid bytes: flip, overwrite with an extreme
/// integer, insert, delete or truncate.
#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Extreme(usize, u64),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
    Truncate(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let extreme = prop_oneof![
        Just(0u64),
        Just(u64::MAX),
        Just(u64::from(u32::MAX)),
        Just(1u64 << 31),
        Just(i32::MAX as u64 - 1),
        Just((-5i64) as u64),
        any::<u64>(),
    ];
    prop_oneof![
        (any::<usize>(), 1..=255u8).prop_map(|(at, x)| Mutation::Flip(at, x)),
        (any::<usize>(), extreme).prop_map(|(at, v)| Mutation::Extreme(at, v)),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, b)| Mutation::Insert(at, b)),
        (any::<usize>(), 1..64usize).prop_map(|(at, n)| Mutation::Delete(at, n)),
        any::<usize>().prop_map(Mutation::Truncate),
    ]
}

fn mutate(bytes: &mut Vec<u8>, mutations: &[Mutation]) {
    for m in mutations {
        if bytes.is_empty() {
            return;
        }
        let n = bytes.len();
        match m {
            Mutation::Flip(at, x) => bytes[at % n] ^= x,
            Mutation::Extreme(at, v) => {
                let at = at % n;
                let end = (at + 8).min(n);
                bytes[at..end].copy_from_slice(&v.to_le_bytes()[..end - at]);
            }
            Mutation::Insert(at, b) => {
                let at = at % (n + 1);
                bytes.splice(at..at, b.iter().copied());
            }
            Mutation::Delete(at, len) => {
                let at = at % n;
                bytes.drain(at..(at + len).min(n));
            }
            Mutation::Truncate(at) => bytes.truncate(at % n),
        }
    }
}

// -- GGUF headers -----------------------------------------------------------

#[derive(Debug, Clone)]
enum Kv {
    U32(u32),
    Str(String),
    U32s(Vec<u32>),
}

fn gguf_bytes(arch: &str, kv: &[(String, Kv)]) -> Vec<u8> {
    let mut pairs = vec![("general.architecture", V::Str(arch))];
    pairs.extend(kv.iter().map(|(k, v)| {
        let v = match v {
            Kv::U32(x) => V::U32(*x),
            Kv::Str(s) => V::Str(s),
            Kv::U32s(xs) => V::U32s(xs),
        };
        (k.as_str(), v)
    }));
    header(&pairs)
}

fn gguf_header() -> impl Strategy<Value = Vec<u8>> {
    let key = prop_oneof![
        Just("block_count"),
        Just("expert_count"),
        Just("expert_used_count"),
        Just("expert_group_count"),
        Just("expert_group_used_count"),
        Just("nextn_predict_layers"),
        Just("attention.head_count"),
        Just("rope.scaling.type"),
        Just("context_length"),
    ];
    let value = prop_oneof![
        prop_oneof![0..4u32, 510..515u32, any::<u32>()].prop_map(Kv::U32),
        "[a-z]{0,10}".prop_map(Kv::Str),
        prop::collection::vec(0..8u32, 0..600).prop_map(Kv::U32s),
    ];
    (
        prop_oneof![
            Just("llama".to_owned()),
            Just("gemma3".to_owned()),
            "[a-z]{1,8}"
        ],
        prop::collection::vec((key, value), 0..8),
        prop::collection::vec(mutation(), 0..4),
    )
        .prop_map(|(arch, kv, mutations)| {
            let kv: Vec<(String, Kv)> = kv
                .into_iter()
                .map(|(k, v)| (format!("{arch}.{k}"), v))
                .collect();
            let mut bytes = gguf_bytes(&arch, &kv);
            mutate(&mut bytes, &mutations);
            bytes
        })
}

fn check_gguf(bytes: &[u8]) {
    let started = Instant::now();
    if let Ok(h) = gguf::parse(bytes, bytes.len() as u64) {
        if gguf::check_hparams(&h).is_ok() {
            let arch = match h.kv.get("general.architecture") {
                Some(gguf::Value::Str(a)) => a.clone(),
                _ => panic!("accepted without an architecture"),
            };
            if let Some(gguf::Value::Int(n)) = h.kv.get(&format!("{arch}.block_count")) {
                assert!((1..=512).contains(n), "accepted block_count {n}");
            }
        }
    }
    // Bounded work: a forged count must fail fast, not loop.
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[test]
fn fuzz_gguf_header() {
    fuzz("gguf header (mutated)", gguf_header(), |b| check_gguf(&b));
    fuzz(
        "gguf header (random bytes)",
        prop::collection::vec(any::<u8>(), 0..512).prop_map(|mut b| {
            if b.len() >= 4 {
                b[..4].copy_from_slice(b"GGUF");
            }
            b
        }),
        |b| check_gguf(&b),
    );
}

// -- saved KV states --------------------------------------------------------

/// llama.cpp's sequence state for `positions`, in `caches` caches (2 for
/// sliding-window models), `layers` layers, cells with or without the
/// 12-byte extension record.
fn llama_payload(positions: &[i32], caches: usize, layers: u32, ext: bool) -> Vec<u8> {
    let mut b = 0xaf14_3cd8u32.to_le_bytes().to_vec();
    b.extend(0i32.to_le_bytes());
    for _ in 0..caches {
        b.extend(1u32.to_le_bytes());
        b.extend((positions.len() as u32).to_le_bytes());
        if positions.is_empty() {
            continue;
        }
        for &p in positions {
            b.extend(p.to_le_bytes());
            b.extend(1u32.to_le_bytes());
            if ext {
                b.extend([0u8; 12]);
            }
            b.extend(0i32.to_le_bytes());
        }
        for x in [0u32, layers, 0, 0] {
            b.extend(x.to_le_bytes());
        }
        for _ in 0..2 * layers {
            b.extend(1i32.to_le_bytes());
            b.extend(8u64.to_le_bytes());
            b.extend(vec![0u8; 8 * positions.len()]);
        }
    }
    b
}

#[test]
fn fuzz_state_frame() {
    let state = (
        prop::collection::vec(prop_oneof![0..300i32, any::<i32>()], 0..40),
        1..=2usize,
        1..4u32,
        any::<bool>(),
        prop::collection::vec(0..50_000i32, 0..8),
        prop::collection::vec(mutation(), 0..3),
        any::<bool>(),
    );
    fuzz(
        "state frame",
        state,
        |(positions, caches, layers, ext, tokens, mutations, mutate_framed)| {
            let payload = llama_payload(&positions, caches, layers, ext);
            let mut unique = positions.clone();
            unique.sort_unstable();
            unique.dedup();
            let valid = unique.len() == positions.len()
                && positions.iter().all(|&p| (0..1 << 30).contains(&p))
                && positions.len() <= 256;
            let framed = frame_state(7, &tokens, &payload);
            if mutations.is_empty() {
                assert_eq!(check_state(7, &framed, 256).is_ok(), valid, "{positions:?}");
                return;
            }
            // Mutate either the whole frame (the checksum then refuses it)
            // or llama.cpp's payload inside a re-framed state (a forgery
            // that passes the frame checks).
            if mutate_framed {
                let mut bytes = framed;
                mutate(&mut bytes, &mutations);
                let _ = check_state(7, &bytes, 256);
            } else {
                let mut payload = payload;
                mutate(&mut payload, &mutations);
                let _ = check_state(7, &frame_state(7, &tokens, &payload), 256);
            }
        },
    );
}

// -- GBNF -------------------------------------------------------------------

/// GBNF-shaped text: rules whose bodies nest groups, alternatives,
/// repetitions, literals and classes.
fn gbnf_text() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        "\"[a-z\\\\n\"]{0,4}\"",
        "\\[\\^?[a-z0-9\\-\\\\]{0,5}\\]",
        Just(".".to_owned()),
        "r[0-3]",
        Just("root".to_owned()),
    ];
    let expr = leaf.prop_recursive(40, 200, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 1..4).prop_map(|v| v.join(" ")),
            prop::collection::vec(inner.clone(), 1..4).prop_map(|v| v.join(" | ")),
            inner.clone().prop_map(|e| format!("({e})")),
            (
                inner,
                prop_oneof!["\\*", "\\+", "\\?", "\\{[0-9]{0,2},?[0-9]{0,2}\\}"]
            )
                .prop_map(|(e, op)| format!("({e}){op}")),
        ]
    });
    (
        prop::collection::vec(expr, 1..5),
        prop::collection::vec(mutation(), 0..3),
    )
        .prop_map(|(bodies, mutations)| {
            let names = ["root", "r0", "r1", "r2", "r3"];
            let text: String = bodies
                .iter()
                .zip(names)
                .map(|(body, name)| format!("{name} ::= {body}\n"))
                .collect();
            let mut bytes = text.into_bytes();
            mutate(&mut bytes, &mutations);
            String::from_utf8_lossy(&bytes).into_owned()
        })
}

#[test]
fn fuzz_gbnf_translator() {
    let check = |text: String| {
        if let Ok(lark) = gbnf::gbnf_to_lark(&text) {
            assert!(lark.starts_with("start: g_root\n"), "{lark}");
        }
    };
    fuzz("gbnf (structured, mutated)", gbnf_text(), check);
    fuzz(
        "gbnf (random text)",
        "[a-z0-9_:=|()\\[\\]\"*+?{},.\\\\ \n#^-]{0,300}",
        check,
    );
    fuzz(
        "gbnf (deep nesting)",
        (0..5_000usize, 0..5_000usize),
        |(open, close)| {
            let text = format!("root ::= {}\"a\"{}", "(".repeat(open), ")".repeat(close));
            let _ = gbnf::gbnf_to_lark(&text);
        },
    );
}

// -- chat templates -----------------------------------------------------------

#[test]
fn fuzz_chat_template() {
    let text = prop_oneof![
        "[{}%# a-z0-9.|+\\-*()'\"~\\[\\],=\n]{0,200}",
        (
            prop_oneof![Just("{{ "), Just("{% if "), Just("{% set x = ")],
            prop::collection::vec(
                prop_oneof![
                    Just("a"),
                    Just(".b"),
                    Just(" + 1"),
                    Just("|e"),
                    Just("("),
                    Just(")"),
                    Just("not "),
                    Just("'s'"),
                    Just("["),
                    Just("]"),
                ],
                0..3_000
            ),
            prop_oneof![Just(" }}"), Just(" %}{% endif %}"), Just(" %}")],
        )
            .prop_map(|(open, body, close)| format!("{open}{}{close}", body.concat())),
    ];
    fuzz("chat template", text, |source: String| {
        let _ = template_tag_tokens(&source);
        let _ = chat::validate_template(&source);
    });
}
