//! A job that panics answers its caller with an error, and the context
//! goes on working (`cargo test -p lloyal-core --features testing`; `make
//! test-rust` passes it).
#![cfg(feature = "testing")]

use lloyal_core::{Branch, Context, ContextParams, Error, Reply, SamplingParams};

fn open(embeddings: bool) -> Context {
    let path = std::env::var("LLOYAL_TEST_MODEL")
        .expect("set LLOYAL_TEST_MODEL to a GGUF file (make test-rust does this)");
    Context::open_blocking(
        path,
        ContextParams {
            n_ctx: 256,
            n_seq_max: 4,
            embeddings,
            ..ContextParams::default()
        },
    )
    .expect("the test model loads")
}

/// Run `start` with a reply and wait for the answer.
fn wait<T: Send + 'static>(start: impl FnOnce(Reply<T>)) -> lloyal_core::Result<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    start(Reply::new(move |r| {
        let _ = tx.send(r);
    }));
    rx.recv().expect("every request is answered")
}

fn is_panic(r: lloyal_core::Result<impl std::fmt::Debug>) -> bool {
    matches!(&r, Err(Error::Internal(m)) if m.contains("panicked") && m.contains("injected"))
}

#[test]
fn every_job_kind_answers_a_panic_and_the_context_goes_on() {
    let ctx = std::sync::Arc::new(open(false));
    let tokens = ctx
        .model()
        .tokenize("Once upon a time", None, false)
        .unwrap();
    let root = Branch::create(&ctx, SamplingParams::greedy()).unwrap();
    assert!(wait(|r| ctx.branch_prefill(vec![(root.id(), tokens.clone())], false, r)).is_ok());
    let saved = wait(|r| root.save(r)).unwrap();

    // Each kind of job, once with a panic injected and once without.
    type Run<'a> = Box<dyn Fn() -> bool + 'a>;
    // A fork is made on the caller's thread, and its KV copy too when
    // the worker is idle: a panic there disposes of the child, frees the
    // parent and fails the fork. When the worker was not idle yet, the
    // copy is its next job: the panic disposes of the child there.
    let fork_panics = || {
        ctx.panic_next_job();
        match root.fork(None) {
            Err(e) => is_panic(Err::<(), _>(e)),
            Ok(kid) => {
                // Queued behind the copy (or after it): the child is gone.
                matches!(wait(|r| kid.save(r)), Err(Error::BranchDisposed))
            }
        }
    };
    let runs: Vec<(&str, Run)> = vec![
        ("fork", Box::new(fork_panics)),
        (
            "commit",
            Box::new(|| is_panic(wait(|r| ctx.branch_commit(vec![(root.id(), 11)], r)))),
        ),
        (
            "prefill",
            Box::new(|| {
                is_panic(wait(|r| {
                    ctx.branch_prefill(vec![(root.id(), vec![12])], true, r)
                }))
            }),
        ),
        (
            "tree",
            Box::new(|| is_panic(wait(|r| root.prefill_tree(vec![5, 6], vec![-1, -1], r)))),
        ),
        (
            "truncate",
            Box::new(|| is_panic(wait(|r| root.truncate(1, None, r)))),
        ),
        ("save", Box::new(|| is_panic(wait(|r| root.save(r))))),
        (
            "restore",
            Box::new(|| {
                is_panic(wait(|r| {
                    ctx.branch_restore(saved.clone(), SamplingParams::greedy(), r)
                }))
            }),
        ),
        (
            "reseed",
            Box::new(|| is_panic(wait(|r| root.clear_and_reseed(vec![1], vec![2, 3], r)))),
        ),
        (
            "retain_only",
            Box::new(|| is_panic(wait(|r| root.retain_only(r)))),
        ),
    ];
    for (name, run) in &runs {
        if *name != "fork" {
            ctx.panic_next_job();
        }
        assert!(
            run(),
            "{name}: the caller did not get the panic as an error"
        );
        // The branch is free again and the context works.
        let position = root.read(|b| b.position).unwrap();
        let kid = root.fork(None).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            wait(|r| ctx.branch_commit(vec![(kid.id(), 7)], r)).is_ok(),
            "{name}"
        );
        assert!(wait(|r| kid.prune(false, r)).is_ok(), "{name}");
        assert_eq!(root.read(|b| b.position).unwrap(), position, "{name}");
    }
    ctx.close_blocking();
}

#[test]
fn flat_api_jobs_answer_a_panic_too() {
    let ctx = open(false);
    ctx.panic_next_job();
    assert!(is_panic(wait(|r| ctx.decode(vec![1, 2], 0, 1, r))));
    assert!(wait(|r| ctx.decode(vec![1, 2], 0, 1, r)).is_ok());
    ctx.panic_next_job();
    assert!(is_panic(wait(|r| ctx.kv_cache_save(1, vec![1, 2], r))));
    let saved = wait(|r| ctx.kv_cache_save(1, vec![1, 2], r)).unwrap();
    ctx.panic_next_job();
    assert!(is_panic(wait(|r| ctx.kv_cache_load(2, saved.clone(), r))));
    ctx.panic_next_job();
    assert!(is_panic(wait(|r| ctx.kv_cache_remove(1, 1, -1, r))));
    assert_eq!(ctx.kv_seq_pos_max(1).unwrap(), 1);
    assert!(wait(|r| ctx.kv_cache_remove(1, 1, -1, r)).is_ok());
    assert_eq!(ctx.kv_seq_pos_max(1).unwrap(), 0);
    ctx.panic_next_job();
    assert!(is_panic(wait(|r| ctx.kv_cache_clear(r))));
    assert_eq!(
        wait(|r| ctx.kv_cache_load(2, saved.clone(), r)).unwrap(),
        vec![1, 2]
    );
    ctx.close_blocking();
}

#[test]
fn embedding_jobs_answer_a_panic_too() {
    let ctx = open(true);
    let tokens = ctx.model().tokenize("Hello there", None, false).unwrap();
    ctx.panic_next_job();
    assert!(is_panic(wait(|r| ctx.embed(vec![tokens.clone()], r))));
    ctx.panic_next_job();
    assert!(is_panic(wait(|r| ctx.encode(tokens.clone(), r))));
    assert_eq!(
        wait(|r| ctx.embed(vec![tokens.clone()], r)).unwrap().len(),
        1
    );
    ctx.close_blocking();
}
