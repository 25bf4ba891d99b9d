//! LoRA adapters and control vectors against SmolLM2 (`LLOYAL_TEST_MODEL`),
//! with adapter files written here (random A/B of the model's shapes).

use std::path::{Path, PathBuf};
use std::sync::Arc;

mod common;

use common::{model_path, Rng};
use lloyal_core::gguf::build::{file, V};
use lloyal_core::{
    Adapters, Branch, Context, ContextParams, ControlVector, Error, Lora, Reply, SamplingParams,
};

fn open() -> Arc<Context> {
    let params = ContextParams {
        n_ctx: 512,
        n_seq_max: 4,
        deterministic: true,
        type_k: lloyal_core::KvType::default_for(true),
        type_v: lloyal_core::KvType::default_for(true),
        ..ContextParams::default()
    };
    Arc::new(Context::open_blocking(model_path(), params).expect("the test model loads"))
}

/// A rank-4 LoRA on every `attn_q` and `attn_v` of the model; B is zero
/// when `b_sd` is 0. `shape_off` adds to A's input size (a wrong shape).
fn write_lora(dir: &Path, name: &str, b_sd: f32, shape_off: u64) -> PathBuf {
    let model = std::fs::File::open(model_path()).unwrap();
    let t = lloyal_core::gguf::read_tensors(model).unwrap();
    let targets: Vec<(String, u64, u64)> = t
        .tensors
        .iter()
        .filter(|i| i.name.ends_with("attn_q.weight") || i.name.ends_with("attn_v.weight"))
        .map(|i| (i.name.clone(), i.ne[0] + shape_off, i.ne[1]))
        .collect();
    let rank = 4u64;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut owned: Vec<(String, Vec<u64>, Vec<f32>)> = Vec::new();
    for (base, n_in, n_out) in targets {
        let a = (0..rank * n_in).map(|_| rng.normal(0.05)).collect();
        let b = (0..n_out * rank).map(|_| rng.normal(b_sd)).collect();
        owned.push((format!("{base}.lora_a"), vec![n_in, rank], a));
        owned.push((format!("{base}.lora_b"), vec![rank, n_out], b));
    }
    let tensors: Vec<(&str, &[u64], &[f32])> = owned
        .iter()
        .map(|(n, ne, d)| (n.as_str(), ne.as_slice(), d.as_slice()))
        .collect();
    let bytes = file(
        &[
            ("general.architecture", V::Str("llama")),
            ("general.type", V::Str("adapter")),
            ("adapter.type", V::Str("lora")),
            ("adapter.lora.alpha", V::F32(4.0)),
        ],
        &tensors,
    );
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn load(ctx: &Context, path: &Path) -> lloyal_core::Result<Lora> {
    let (tx, rx) = std::sync::mpsc::channel();
    ctx.load_lora(path, Reply::new(move |r| tx.send(r).unwrap()));
    rx.recv().unwrap()
}

fn prefill_all(ctx: &Context, items: Vec<(&Branch, Vec<i32>)>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let items = items.into_iter().map(|(b, t)| (b.id(), t)).collect();
    ctx.branch_prefill(items, false, Reply::new(move |r| tx.send(r).unwrap()));
    assert!(rx.recv().unwrap().unwrap().iter().all(Result::is_ok));
}

/// The last logits of `prompt` decoded on a new branch under `set`.
fn logits_under(ctx: &Arc<Context>, set: Adapters, prompt: &[i32]) -> Vec<f32> {
    let b = Branch::create(ctx, SamplingParams::greedy()).unwrap();
    b.set_adapters(set).unwrap();
    prefill_all(ctx, vec![(&b, prompt.to_vec())]);
    b.read(|s| s.logits().unwrap().to_vec()).unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn a_lora_changes_logits_only_as_its_weights_and_scale_say() {
    let dir = tempdir();
    let ctx = open();
    let prompt = ctx
        .model()
        .tokenize("The capital of France is", None, false)
        .unwrap();
    let zero = load(&ctx, &write_lora(&dir, "zero.gguf", 0.0, 0)).unwrap();
    let random = load(&ctx, &write_lora(&dir, "random.gguf", 0.5, 0)).unwrap();
    assert_eq!(random.n_pairs(), 2 * ctx.model().info().n_layer as usize);
    assert_eq!(random.alpha(), 4.0);
    let again = load(&ctx, random.path()).unwrap();
    assert!(again == random, "one file is loaded once");

    let with = |loras: Vec<(Lora, f32)>| Adapters {
        loras,
        control: None,
    };
    let base = logits_under(&ctx, Adapters::default(), &prompt);
    let z = logits_under(&ctx, with(vec![(zero.clone(), 1.0)]), &prompt);
    let r = logits_under(&ctx, with(vec![(random.clone(), 1.0)]), &prompt);
    let r0 = logits_under(&ctx, with(vec![(random.clone(), 0.0)]), &prompt);
    let both = logits_under(&ctx, with(vec![(zero, 1.0), (random, 1.0)]), &prompt);
    assert!(
        base == z,
        "a zero B gives the base model's logits bit for bit"
    );
    assert!(base == r0, "scale 0 is the base model");
    assert!(
        max_diff(&base, &r) > 0.1,
        "a random LoRA changes the logits"
    );
    assert!(
        both == r,
        "a zero adapter beside a random one changes nothing"
    );
    // The base again, after the sets changed back and forth.
    assert!(logits_under(&ctx, Adapters::default(), &prompt) == base);

    // A LoRA of the token embeddings: SmolLM2 ties its output layer to
    // them, and llama.cpp would abort applying it there; refused.
    let info = ctx.model().info().clone();
    let (vocab, embd, rank) = (u64::from(info.vocab_size), u64::from(info.n_embd), 4u64);
    let mut rng = Rng(11);
    let a: Vec<f32> = (0..rank * vocab).map(|_| rng.normal(0.05)).collect();
    let b: Vec<f32> = (0..rank * embd).map(|_| rng.normal(0.5)).collect();
    let bytes = file(
        &[
            ("general.architecture", V::Str("llama")),
            ("general.type", V::Str("adapter")),
            ("adapter.type", V::Str("lora")),
        ],
        &[
            ("token_embd.weight.lora_a", &[rank, vocab][..], &a[..]),
            ("token_embd.weight.lora_b", &[rank, embd][..], &b[..]),
        ],
    );
    std::fs::write(dir.join("embd.gguf"), bytes).unwrap();
    match load(&ctx, &dir.join("embd.gguf")) {
        Err(Error::AdapterLoad { reason, .. }) => assert!(reason.contains("output layer")),
        other => panic!("expected AdapterLoad, got {other:?}"),
    }
    assert!(logits_under(&ctx, Adapters::default(), &prompt) == base);
    ctx.close_blocking();
}

#[test]
fn branches_under_different_sets_share_a_step_and_each_gets_its_own_logits() {
    let dir = tempdir();
    let ctx = open();
    let prompt = ctx
        .model()
        .tokenize("Once upon a time", None, false)
        .unwrap();
    let lora = load(&ctx, &write_lora(&dir, "random.gguf", 0.5, 0)).unwrap();
    let set = Adapters {
        loras: vec![(lora, 1.0)],
        control: None,
    };
    let alone_base = logits_under(&ctx, Adapters::default(), &prompt);
    let alone_lora = logits_under(&ctx, set.clone(), &prompt);
    assert!(alone_base != alone_lora);

    let plain = Branch::create(&ctx, SamplingParams::greedy()).unwrap();
    let adapted = Branch::create(&ctx, SamplingParams::greedy()).unwrap();
    adapted.set_adapters(set.clone()).unwrap();
    let before = ctx.stats().decode_calls;
    prefill_all(
        &ctx,
        vec![(&plain, prompt.clone()), (&adapted, prompt.clone())],
    );
    assert_eq!(ctx.stats().decode_calls - before, 2, "one decode per set");
    assert!(plain.read(|s| s.logits().unwrap().to_vec()).unwrap() == alone_base);
    assert!(adapted.read(|s| s.logits().unwrap().to_vec()).unwrap() == alone_lora);

    // Forks inherit the set; branches under one set share their decodes.
    let (a, b) = (adapted.fork(None).unwrap(), adapted.fork(None).unwrap());
    assert!(
        a.read(|s| *s.adapters() == set).unwrap(),
        "forks inherit the set"
    );
    let before = ctx.stats().decode_calls;
    let (tx, rx) = std::sync::mpsc::channel();
    ctx.branch_commit(
        vec![(a.id(), 11), (b.id(), 12)],
        Reply::new(move |r| tx.send(r).unwrap()),
    );
    let results = rx.recv().unwrap().unwrap();
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert_eq!(ctx.stats().decode_calls - before, 1);
    ctx.close_blocking();
}

#[test]
fn bad_adapter_files_are_typed_errors_and_change_nothing() {
    let dir = tempdir();
    let ctx = open();
    let prompt = ctx.model().tokenize("Hello", None, false).unwrap();
    let base = logits_under(&ctx, Adapters::default(), &prompt);
    let refused = |path: &Path, needle: &str| match load(&ctx, path) {
        Err(Error::AdapterLoad { reason, .. }) => {
            assert!(reason.contains(needle), "{reason:?} should say {needle:?}")
        }
        other => panic!("{path:?}: expected AdapterLoad, got {other:?}"),
    };
    assert!(matches!(
        load(&ctx, &dir.join("missing.gguf")),
        Err(Error::AdapterNotFound(_))
    ));
    refused(&dir, "directory");
    refused(Path::new(&model_path()), "not an adapter");
    refused(&write_lora(&dir, "shape.gguf", 0.5, 7), "shapes");
    // An alpha of another type: llama.cpp would abort the process.
    let lora = std::fs::read(write_lora(&dir, "alpha.gguf", 0.5, 0)).unwrap();
    let at = lora
        .windows(b"adapter.lora.alpha".len())
        .position(|w| w == b"adapter.lora.alpha")
        .unwrap()
        + b"adapter.lora.alpha".len();
    let mut as_u32 = lora.clone();
    as_u32[at..at + 4].copy_from_slice(&4u32.to_le_bytes()); // type 6 (f32) -> 4 (u32)
    std::fs::write(dir.join("alpha.gguf"), &as_u32).unwrap();
    refused(&dir.join("alpha.gguf"), "float32");
    let good = std::fs::read(write_lora(&dir, "cut.gguf", 0.5, 0)).unwrap();
    let cut = dir.join("cut.gguf");
    std::fs::write(&cut, &good[..good.len() / 2]).unwrap();
    refused(&cut, "truncated");
    std::fs::write(dir.join("text.gguf"), b"not a gguf at all").unwrap();
    refused(&dir.join("text.gguf"), "GGUF");

    // A LoRA of another context, a duplicate, a bad scale: ValueError-like.
    let other = open();
    let foreign = load(&other, &write_lora(&dir, "other.gguf", 0.5, 0)).unwrap();
    let b = Branch::create(&ctx, SamplingParams::greedy()).unwrap();
    let bad_sets = [
        vec![(foreign, 1.0)],
        vec![(load(&ctx, &dir.join("other.gguf")).unwrap(), f32::NAN)],
    ];
    for loras in bad_sets {
        let e = b
            .set_adapters(Adapters {
                loras,
                control: None,
            })
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    }
    drop(b);
    assert!(logits_under(&ctx, Adapters::default(), &prompt) == base);
    other.close_blocking();
    ctx.close_blocking();
}

#[test]
fn a_control_vector_adds_its_directions_in_its_layers() {
    let dir = tempdir();
    let ctx = open();
    let info = ctx.model().info().clone();
    let (n_layer, n_embd) = (info.n_layer as usize, info.n_embd as usize);
    let prompt = ctx
        .model()
        .tokenize("The weather today", None, false)
        .unwrap();
    let base = logits_under(&ctx, Adapters::default(), &prompt);
    let mut rng = Rng(7);
    let mut directions = vec![0f32; n_layer * n_embd];
    directions[n_embd..]
        .iter_mut()
        .for_each(|v| *v = rng.normal(0.5));
    let cv = |scale, layers| {
        let control = ControlVector::new(ctx.model(), &directions, scale, layers).unwrap();
        Adapters {
            loras: vec![],
            control: Some(control),
        }
    };
    assert!(
        logits_under(&ctx, cv(0.0, None), &prompt) == base,
        "scale 0"
    );
    let all = logits_under(&ctx, cv(1.0, None), &prompt);
    assert!(max_diff(&base, &all) > 0.1);
    let some = logits_under(&ctx, cv(1.0, Some((5, 6))), &prompt);
    assert!(max_diff(&base, &some) > 0.0 && some != all);

    // The same directions from a file, as cvector-generator writes them.
    let names: Vec<String> = (1..n_layer).map(|l| format!("direction.{l}")).collect();
    let ne = [n_embd as u64];
    let tensors: Vec<(&str, &[u64], &[f32])> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            (
                n.as_str(),
                &ne[..],
                &directions[(i + 1) * n_embd..(i + 2) * n_embd],
            )
        })
        .collect();
    let kv = [
        ("general.architecture", V::Str("controlvector")),
        ("controlvector.model_hint", V::Str("llama")),
    ];
    let path = dir.join("cv.gguf");
    std::fs::write(&path, file(&kv, &tensors)).unwrap();
    let loaded = ControlVector::load(ctx.model(), &path, 1.0, None).unwrap();
    let set = Adapters {
        loras: vec![],
        control: Some(loaded),
    };
    assert!(logits_under(&ctx, set, &prompt) == all);

    // Bad ones: wrong size, row 0, layers out of range, another model.
    for (data, layers) in [
        (&directions[1..], None),
        (&vec![1f32; n_layer * n_embd][..], None),
        (&directions[..], Some((0, 3))),
        (&directions[..], Some((3, n_layer as i32))),
    ] {
        let e = ControlVector::new(ctx.model(), data, 1.0, layers).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    }
    let hinted = [
        ("general.architecture", V::Str("controlvector")),
        ("controlvector.model_hint", V::Str("gemma3")),
    ];
    std::fs::write(&path, file(&hinted, &tensors)).unwrap();
    let e = ControlVector::load(ctx.model(), &path, 1.0, None).unwrap_err();
    assert!(matches!(e, Error::AdapterLoad { .. }), "{e:?}");
    ctx.close_blocking();
}

/// A folder removed when dropped.
struct TempDir(PathBuf);
impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempdir() -> TempDir {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "lloyal-adapters-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    TempDir(dir)
}
