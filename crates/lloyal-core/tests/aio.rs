//! The async API (`Context::aio`) on a multi-thread tokio runtime.

use std::sync::Arc;
use std::time::Duration;

use lloyal_core::{BranchId, Context, ContextParams, Error, SamplingParams};

fn open(n_seq_max: u32) -> Arc<Context> {
    let path = std::env::var("LLOYAL_TEST_MODEL")
        .expect("set LLOYAL_TEST_MODEL to a GGUF file (make test-rust does this)");
    Arc::new(
        Context::open_blocking(
            path,
            ContextParams {
                n_ctx: 512,
                n_seq_max,
                ..ContextParams::default()
            },
        )
        .expect("the test model loads"),
    )
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
    out
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
    let fork = {
        let ctx = Arc::clone(&ctx);
        let kid = kids[1];
        tokio::spawn(async move { ctx.aio().fork(kid).await })
    };
    queued(&ctx, 2).await;
    let close = {
        let ctx = Arc::clone(&ctx);
        tokio::spawn(async move { ctx.aio().close().await })
    };
    // Closing ends the hold (a holder may be waiting for the close).
    assert!(matches!(commit.await.unwrap(), Err(Error::ContextClosed)));
    assert!(matches!(fork.await.unwrap(), Err(Error::ContextClosed)));
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
    for &kid in &kids {
        ctx.branch_set_params(kid, full_vocabulary.clone()).unwrap();
    }
    assert!(ctx.branch_produce_is_slow(kids[0]).unwrap());
    let mut via_thread = Vec::new();
    let mut here = Vec::new();
    for _ in 0..6 {
        via_thread.push(ctx.aio().produce(kids[0]).await.unwrap());
        here.push(ctx.branch_produce(kids[1]).unwrap());
    }
    assert_eq!(via_thread, here);
    // Not left busy.
    ctx.aio()
        .commit(vec![(kids[0], via_thread[5])])
        .await
        .unwrap();
    ctx.aio().close().await.unwrap();
}
