//! Images in a branch (feature `multimodal`, WIP): SmolLM2 with a random
//! projector (`LLOYAL_TEST_MMPROJ`, written by scripts/make_mmproj.py).
#![cfg(feature = "multimodal")]

use std::sync::Arc;

use lloyal_core::media::{marker, Media};
use lloyal_core::{Branch, Context, ContextParams, Reply, SamplingParams};

fn open() -> Arc<Context> {
    let model = std::env::var("LLOYAL_TEST_MODEL").expect("LLOYAL_TEST_MODEL");
    let params = ContextParams {
        n_ctx: 512,
        n_seq_max: 4,
        ..ContextParams::default()
    };
    let ctx = Arc::new(Context::open_blocking(model, params).unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    let mmproj = std::env::var("LLOYAL_TEST_MMPROJ").expect("LLOYAL_TEST_MMPROJ");
    ctx.load_projector(mmproj, Reply::new(move |r| tx.send(r).unwrap()));
    rx.recv().unwrap().unwrap();
    ctx
}

fn image(seed: u8) -> Media {
    Media::Rgb {
        width: 16,
        height: 16,
        pixels: (0..16 * 16 * 3)
            .map(|i: u32| (i as u8).wrapping_mul(seed))
            .collect(),
    }
}

fn prefill(ctx: &Context, b: &Branch, media: Vec<Media>) -> lloyal_core::Result<i32> {
    let (tx, rx) = std::sync::mpsc::channel();
    let text = format!("Look: {} What is it?", marker());
    ctx.branch_prefill_media(
        b.id(),
        text,
        media,
        Reply::new(move |r| tx.send(r).unwrap()),
    );
    rx.recv().unwrap()
}

#[test]
fn an_image_in_a_branch_then_forks_share_its_cells() {
    let ctx = open();
    let a = Branch::create(&ctx, SamplingParams::greedy()).unwrap();
    let used = prefill(&ctx, &a, vec![image(3)]).unwrap();
    assert_eq!(a.read(|s| s.position).unwrap(), used);
    let la = a.read(|s| s.logits().unwrap().to_vec()).unwrap();
    let b = Branch::create(&ctx, SamplingParams::greedy()).unwrap();
    prefill(&ctx, &b, vec![image(3)]).unwrap();
    assert!(
        b.read(|s| s.logits().unwrap().to_vec()).unwrap() == la,
        "same image, same logits"
    );
    let c = Branch::create(&ctx, SamplingParams::greedy()).unwrap();
    prefill(&ctx, &c, vec![image(7)]).unwrap();
    assert!(
        c.read(|s| s.logits().unwrap().to_vec()).unwrap() != la,
        "another image"
    );
    drop((b, c));
    let held = ctx.branch_cells_held();
    let forks: Vec<Branch> = (0..3).map(|_| a.fork(None).unwrap()).collect();
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(
        ctx.branch_cells_held(),
        held,
        "forks share the image's cells"
    );
    drop(forks);
    // Bad media: typed errors, the branch unchanged.
    let before = a.read(|s| s.position).unwrap();
    for bad in [
        vec![],
        vec![image(1), image(2)],
        vec![Media::Rgb {
            width: 0,
            height: 0,
            pixels: vec![],
        }],
        vec![Media::Rgb {
            width: 9000,
            height: 1,
            pixels: vec![0; 27000],
        }],
        vec![Media::Encoded(b"not an image".to_vec())],
    ] {
        assert!(prefill(&ctx, &a, bad).is_err());
    }
    assert_eq!(a.read(|s| s.position).unwrap(), before);
    ctx.close_blocking();
}
