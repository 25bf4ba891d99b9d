//! The async API (`Context::aio`) on a multi-thread tokio runtime.

use std::sync::Arc;
use std::time::Duration;

use lloyal_core::{
    Branch, BranchId, Context, ContextParams, Error, Reply, SamplingParams, StepInput,
};

fn open(n_seq_max: u32) -> Arc<Context> {
    open_with(ContextParams {
        n_ctx: 512,
        n_seq_max,
        ..ContextParams::default()
    })
}

fn open_with(params: ContextParams) -> Arc<Context> {
    let path = std::env::var("LLOYAL_TEST_MODEL")
        .expect("set LLOYAL_TEST_MODEL to a GGUF file (make test-rust does this)");
    Arc::new(Context::open_blocking(path, params).expect("the test model loads"))
}

/// A root with a prompt and `n` forks of it.
async fn forks(ctx: &Context, n: usize) -> Vec<BranchId> {
    let prompt = ctx
        .model()
        .tokenize("Once upon a time", None, false)
        .unwrap();
    let root = ctx.branch_create(SamplingParams::greedy()).unwrap();
    ctx.aio()
        .prefill(vec![(root, prompt)], false)
        .await
        .unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(ctx.aio().fork(root).await.unwrap());
    }
    // A fork's KV copy may still be queued (it returns at once): wait for
    // it, or `queued` below would count it as one of the requests a test
    // queues (on a busy machine it did, and a commit missed the step).
    for _ in 0..20_000 {
        if ctx.queued() == 0 {
            return out;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("the fork copies never ran (20 s)");
}

/// Wait until the worker has `n` requests queued behind the one it runs.
async fn queued(ctx: &Context, n: usize) {
    for _ in 0..2000 {
        if ctx.queued() > n {
            // n behind the one running
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("the requests were not queued");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn commits_from_eight_tasks_are_one_decode() {
    let ctx = open(9);
    let kids = forks(&ctx, 8).await;
    let hold = ctx.hold();
    let before = ctx.stats().decode_calls;
    let mut tasks = Vec::new();
    for (i, &kid) in kids.iter().enumerate() {
        let ctx = Arc::clone(&ctx);
        tasks.push(tokio::spawn(async move {
            ctx.aio().commit(vec![(kid, 100 + i as i32)]).await
        }));
    }
    queued(&ctx, 8).await;
    drop(hold);
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    assert_eq!(ctx.stats().decode_calls - before, 1);
    for &kid in &kids {
        assert_eq!(ctx.read_branch(kid, |b| b.position).unwrap(), 5);
    }
    ctx.aio().close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_commit_future_leaves_the_branch_before_or_after() {
    let ctx = open(2);
    let kid = forks(&ctx, 1).await[0];
    let at = |ctx: &Context| ctx.read_branch(kid, |b| b.position).unwrap();
    let start = at(&ctx);
    // Never polled: never submitted.
    drop(ctx.aio().commit(vec![(kid, 7)]));
    assert_eq!(at(&ctx), start);
    // Polled once (submitted), then dropped: the worker finishes it.
    let hold = ctx.hold();
    let cancelled = tokio::time::timeout(Duration::ZERO, ctx.aio().commit(vec![(kid, 7)])).await;
    assert!(cancelled.is_err());
    drop(hold);
    for _ in 0..2000 {
        if ctx.queued() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(at(&ctx), start + 1);
    ctx.aio().commit(vec![(kid, 8)]).await.unwrap(); // and the branch is free again
    ctx.aio().close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_fails_the_queued_requests() {
    let ctx = open(3);
    let kids = forks(&ctx, 2).await;
    let hold = ctx.hold();
    let commit = {
        let ctx = Arc::clone(&ctx);
        let kid = kids[0];
        tokio::spawn(async move { ctx.aio().commit(vec![(kid, 7)]).await })
    };
    let save = {
        let ctx = Arc::clone(&ctx);
        let kid = kids[1];
        tokio::spawn(async move { ctx.aio().save(kid).await })
    };
    queued(&ctx, 2).await;
    let close = {
        let ctx = Arc::clone(&ctx);
        tokio::spawn(async move { ctx.aio().close().await })
    };
    // Closing ends the hold (a holder may be waiting for the close).
    assert!(matches!(commit.await.unwrap(), Err(Error::ContextClosed)));
    assert!(matches!(save.await.unwrap(), Err(Error::ContextClosed)));
    close.await.unwrap().unwrap();
    drop(hold);
    assert!(matches!(
        ctx.aio().fork(kids[0]).await,
        Err(Error::ContextClosed)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_sampler_runs_on_its_own_thread_and_keeps_its_stream() {
    let ctx = open(3);
    let kids = forks(&ctx, 2).await;
    let full_vocabulary = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: Some(7),
        ..SamplingParams::default()
    };
    // Handles for the one-branch verbs; the ids go on to the async API.
    let handles: Vec<Branch> = kids.iter().map(|&k| Branch::adopt(&ctx, k)).collect();
    for b in &handles {
        b.set_params(full_vocabulary.clone()).unwrap();
    }
    assert!(handles[0].produce_is_slow().unwrap());
    let mut via_thread = Vec::new();
    let mut here = Vec::new();
    for _ in 0..6 {
        via_thread.push(ctx.aio().produce(kids[0]).await.unwrap());
        here.push(handles[1].produce().unwrap());
    }
    assert_eq!(via_thread, here);
    // Not left busy.
    ctx.aio()
        .commit(vec![(kids[0], via_thread[5])])
        .await
        .unwrap();
    ctx.aio().close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_and_a_prompt_in_one_step_are_one_decode() {
    let ctx = open(4);
    let kids = forks(&ctx, 2).await;
    let fresh = ctx.branch_create(SamplingParams::greedy()).unwrap();
    let before = ctx.stats();
    let results = ctx
        .aio()
        .step(vec![
            (kids[0], StepInput::Commit(100)),
            (fresh, StepInput::Prefill(vec![1, 2, 3, 4, 5])),
            (kids[1], StepInput::Commit(101)),
        ])
        .await
        .unwrap();
    assert!(results.iter().all(Result::is_ok));
    let after = ctx.stats();
    assert_eq!(after.decode_calls - before.decode_calls, 1);
    assert_eq!(after.tokens_decoded - before.tokens_decoded, 7);
    assert_eq!(ctx.read_branch(fresh, |b| b.position).unwrap(), 5);
    assert_eq!(ctx.read_branch(kids[1], |b| b.position).unwrap(), 5);
    ctx.aio().close().await.unwrap();
}

/// A 1,000-token prompt and 31 streams committing in a loop: the prompt
/// goes in chunks, so a commit waits behind at most the round in flight
/// when it was submitted, and its own round holds at most `n_batch`
/// tokens. Counted exactly: the tokens decoded between the submission and
/// the reply (read on the worker thread as it answers).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_long_prompt_delays_commits_by_at_most_one_round() {
    let n_batch = 64u64;
    let ctx = open_with(ContextParams {
        n_ctx: 4096,
        n_batch: n_batch as u32,
        n_seq_max: 33,
        ..ContextParams::default()
    });
    let streams = forks(&ctx, 31).await;
    let late = ctx.branch_create(SamplingParams::greedy()).unwrap();
    let prompt: Vec<i32> = (0..1000).map(|i| 100 + i % 500).collect();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for (i, &b) in streams.iter().enumerate() {
        let (ctx, done) = (Arc::clone(&ctx), Arc::clone(&done));
        tasks.push(tokio::spawn(async move {
            let mut gaps = Vec::new();
            let mut token = 200 + i as i32;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let stats = Arc::clone(&ctx);
                let reply = Reply::new(move |r| {
                    let _ = tx.send((r, stats.stats().tokens_decoded));
                });
                let submitted = ctx.stats().tokens_decoded;
                ctx.branch_commit(vec![(b, token)], reply);
                let (result, answered) = rx.await.unwrap();
                assert!(result.unwrap().iter().all(Result::is_ok));
                gaps.push(answered - submitted);
                token = ctx.aio().produce(b).await.unwrap();
            }
            gaps
        }));
    }
    tokio::time::sleep(Duration::from_millis(1)).await;
    let calls = ctx.stats().decode_calls;
    ctx.aio()
        .prefill(vec![(late, prompt)], false)
        .await
        .unwrap();
    let prompt_decodes = ctx.stats().decode_calls - calls;
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut worst = 0;
    for task in tasks {
        worst = worst.max(task.await.unwrap().into_iter().max().unwrap_or(0));
    }
    assert_eq!(ctx.read_branch(late, |b| b.position).unwrap(), 1000);
    assert!(
        worst <= 2 * n_batch,
        "a commit waited behind {worst} tokens"
    );
    assert!(prompt_decodes >= 1000 / n_batch);
    ctx.aio().close().await.unwrap();
}
