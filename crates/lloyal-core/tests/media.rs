//! Images in a branch against SmolLM2 (`LLOYAL_TEST_MODEL`) with a random
//! "mlp" projector written here (16x16 images, 8x8 patches: 4 positions).

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{model_path, Rng};
use lloyal_core::gguf::build::{file, V};
use lloyal_core::media::{Media, ProjectorInfo};
use lloyal_core::{Branch, Context, ContextParams, Error, Reply, SamplingParams};

fn call<T: Send + 'static>(f: impl FnOnce(Reply<T>)) -> lloyal_core::Result<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    f(Reply::new(move |r| tx.send(r).unwrap()));
    rx.recv().unwrap()
}

/// A projector of `n_text` outputs; `image_size` is written as the type
/// `size` gives (libmtmd reads a u32 and aborts on another type).
fn write_projector(dir: &Path, name: &str, n_text: u64, size: V<'_>) -> PathBuf {
    let (e, p, h) = (16u64, 8u64, 16u64);
    let n_patches = 4u64;
    let mut rng = Rng(29);
    let mut owned: Vec<(String, Vec<u64>, Vec<f32>)> = Vec::new();
    let mut add = |name: String, ne: Vec<u64>, sd: f32, rng: &mut Rng| {
        let n = ne.iter().product::<u64>();
        let data = (0..n).map(|_| rng.normal(sd)).collect();
        owned.push((name, ne, data));
    };
    add(
        "v.patch_embd.weight".into(),
        vec![p, p, 3, e],
        0.1,
        &mut rng,
    );
    add(
        "v.position_embd.weight".into(),
        vec![e, n_patches],
        0.1,
        &mut rng,
    );
    for i in 0..2 {
        for t in ["attn_q", "attn_k", "attn_v", "attn_out"] {
            add(format!("v.blk.{i}.{t}.weight"), vec![e, e], 0.1, &mut rng);
        }
        for t in ["ln1", "ln2"] {
            add(format!("v.blk.{i}.{t}.weight"), vec![e], 0.0, &mut rng);
            add(format!("v.blk.{i}.{t}.bias"), vec![e], 0.0, &mut rng);
        }
        add(
            format!("v.blk.{i}.ffn_up.weight"),
            vec![e, e],
            0.1,
            &mut rng,
        );
        add(
            format!("v.blk.{i}.ffn_down.weight"),
            vec![e, e],
            0.1,
            &mut rng,
        );
    }
    add("mm.0.weight".into(), vec![e, h], 0.1, &mut rng);
    add("mm.0.bias".into(), vec![h], 0.1, &mut rng);
    add("mm.2.weight".into(), vec![h, n_text], 0.5, &mut rng);
    add("mm.2.bias".into(), vec![n_text], 0.1, &mut rng);
    for (name, _, data) in &mut owned {
        if name.contains(".ln") && name.ends_with("weight") {
            data.iter_mut().for_each(|x| *x = 1.0);
        }
    }
    let tensors: Vec<(&str, &[u64], &[f32])> = owned
        .iter()
        .map(|(n, ne, d)| (n.as_str(), ne.as_slice(), d.as_slice()))
        .collect();
    let bytes = file(
        &[
            ("general.architecture", V::Str("clip")),
            ("clip.has_vision_encoder", V::Bool(true)),
            ("clip.projector_type", V::Str("mlp")),
            ("clip.vision.embedding_length", V::U32(e as u32)),
            ("clip.vision.attention.head_count", V::U32(2)),
            ("clip.vision.feed_forward_length", V::U32(e as u32)),
            ("clip.vision.block_count", V::U32(2)),
            ("clip.vision.projection_dim", V::U32(n_text as u32)),
            ("clip.vision.image_size", size),
            ("clip.vision.patch_size", V::U32(p as u32)),
            ("clip.vision.attention.layer_norm_epsilon", V::F32(1e-6)),
            ("clip.vision.image_mean", V::F32s(&[0.5; 3])),
            ("clip.vision.image_std", V::F32s(&[0.5; 3])),
        ],
        &tensors,
    );
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn tempdir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lloyal-media-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn open() -> Arc<Context> {
    let params = ContextParams {
        n_ctx: 512,
        n_seq_max: 4,
        ..ContextParams::default()
    };
    Arc::new(Context::open_blocking(model_path(), params).expect("the test model loads"))
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

/// The image then a few text tokens (this projector closes an image with
/// no text token, so the logits come from the text after it).
fn prefill(ctx: &Context, b: &Branch, media: Media) -> lloyal_core::Result<i32> {
    let used = call(|r| b.prefill_media(media, r))?;
    assert!(
        b.read(|s| s.logits().is_err()).unwrap(),
        "no logits after an image"
    );
    let text = vec![504, 2343, 314];
    let n = text.len() as i32;
    let results = call(|r| ctx.branch_prefill(vec![(b.id(), text)], false, r))?;
    results
        .into_iter()
        .collect::<lloyal_core::Result<Vec<_>>>()?;
    Ok(used + n)
}

fn logits(b: &Branch) -> Vec<f32> {
    b.read(|s| s.logits().unwrap().to_vec()).unwrap()
}

/// A round trip through the worker: every job submitted before has run.
fn settle(ctx: &Context) {
    call(|r| ctx.media_positions(image(1), r)).unwrap();
}

#[test]
fn an_image_in_a_branch_then_forks_share_its_cells() {
    let dir = tempdir();
    let ctx = open();
    let good = write_projector(&dir, "good.gguf", 576, V::U32(16));
    let info = call(|r| ctx.load_projector(good, r)).unwrap();
    assert_eq!(
        info,
        ProjectorInfo {
            vision: true,
            audio: false,
            audio_sample_rate: None
        }
    );
    let layout = call(|r| ctx.media_positions(image(3), r)).unwrap();
    assert_eq!(layout.positions, 4);
    assert_eq!(call(|r| ctx.media_positions(image(3), r)).unwrap(), layout);
    assert_ne!(
        call(|r| ctx.media_positions(image(7), r)).unwrap().content,
        layout.content
    );

    let a = Branch::create(&ctx, SamplingParams::greedy()).unwrap();
    let used = prefill(&ctx, &a, image(3)).unwrap();
    assert_eq!((used, a.read(|s| s.position).unwrap()), (7, 7));
    let b = Branch::create(&ctx, SamplingParams::greedy()).unwrap();
    prefill(&ctx, &b, image(3)).unwrap();
    assert!(logits(&b) == logits(&a), "same image, same logits");
    let c = Branch::create(&ctx, SamplingParams::greedy()).unwrap();
    prefill(&ctx, &c, image(7)).unwrap();
    assert!(logits(&c) != logits(&a), "another image, other logits");
    drop((b, c));
    settle(&ctx);

    let held = ctx.branch_cells_held();
    let forks: Vec<Branch> = (0..3).map(|_| a.fork(None).unwrap()).collect();
    settle(&ctx);
    assert_eq!(
        ctx.branch_cells_held(),
        held,
        "forks share the image's cells"
    );
    drop(forks);

    // Bad media: typed errors, the branch as it was.
    let before = (a.read(|s| s.position).unwrap(), logits(&a));
    let rgb = |width, height, n| Media::Rgb {
        width,
        height,
        pixels: vec![7; n],
    };
    for bad in [
        rgb(0, 0, 0),
        rgb(9000, 1, 27000),
        rgb(16, 16, 16 * 16 * 3 - 1),
        Media::Encoded(vec![]),
        Media::Encoded(b"not an image at all".to_vec()),
        // A PNG signature and nothing after it.
        Media::Encoded(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec()),
    ] {
        let err = call(|r| a.prefill_media(bad.clone(), r)).unwrap_err();
        assert!(matches!(err, Error::Media(_)), "{bad:?}: {err:?}");
    }
    assert!(
        (a.read(|s| s.position).unwrap(), logits(&a)) == before,
        "bad media changed the branch"
    );
    // The context still works.
    prefill(&ctx, &a, image(3)).unwrap();
    assert_eq!(a.read(|s| s.position).unwrap(), 14);
    ctx.close_blocking();
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bad_projectors_are_typed_errors_and_the_context_goes_on() {
    let dir = tempdir().join("bad");
    std::fs::create_dir_all(&dir).unwrap();
    let ctx = open();
    let a = Branch::create(&ctx, SamplingParams::greedy()).unwrap();
    let err = call(|r| a.prefill_media(image(3), r)).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");

    // A key of the wrong type: libmtmd would abort the process.
    let wrong_type = write_projector(&dir, "f32-size.gguf", 576, V::F32(16.0));
    // Another model's width (Gemma 3 270M's).
    let other = write_projector(&dir, "other.gguf", 640, V::U32(16));
    let good = write_projector(&dir, "good.gguf", 576, V::U32(16));
    let mut truncated = std::fs::read(&good).unwrap();
    truncated.truncate(truncated.len() - 100);
    let cut = dir.join("cut.gguf");
    std::fs::write(&cut, truncated).unwrap();
    for path in [
        wrong_type,
        other,
        cut,
        PathBuf::from(model_path()),
        dir.clone(),
    ] {
        let err = call(|r| ctx.load_projector(path.clone(), r)).unwrap_err();
        assert!(
            matches!(err, Error::ProjectorLoad { .. }),
            "{path:?}: {err:?}"
        );
    }
    let err = call(|r| ctx.load_projector(dir.join("missing.gguf"), r)).unwrap_err();
    assert!(matches!(err, Error::AdapterNotFound(_)), "{err:?}");

    call(|r| ctx.load_projector(good, r)).unwrap();
    assert_eq!(call(|r| a.prefill_media(image(3), r)).unwrap(), 4);
    ctx.close_blocking();
    let _ = std::fs::remove_dir_all(dir);
}
