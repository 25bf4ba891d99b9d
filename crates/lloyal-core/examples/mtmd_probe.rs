//! Research probe for issue 29 item 1 (not wired into anything): SmolLM2
//! with a random "mlp" projector (scripts/make_mmproj.py). An image prompt
//! is evaluated twice with the same image and once with another; prints
//! the last logits' max differences.
//!
//!     cargo run --release --features multimodal --example mtmd_probe -- MODEL MMPROJ
#[path = "common/mod.rs"]
mod common;

use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::mtmd::{
    mtmd_default_marker, MtmdBitmap, MtmdContext, MtmdContextParams, MtmdInputText,
};

fn main() -> common::AnyResult<()> {
    let args: Vec<String> = std::env::args().collect();
    let backend = common::init_backend()?;
    let model = LlamaModel::load_from_file(&backend, &args[1], &LlamaModelParams::default())?;
    let params = MtmdContextParams::default();
    let started = std::time::Instant::now();
    let mut mtmd = MtmdContext::init_from_file(&args[2], &model, &params)?;
    println!(
        "mtmd init {:?}, vision {}",
        started.elapsed(),
        mtmd.support_vision()
    );
    let bad = MtmdContext::init_from_file("/etc/hostname", &model, &params);
    println!("a non-GGUF projector: {}", bad.is_err());
    let image = |seed: u8| -> Vec<u8> {
        (0..16 * 16 * 3)
            .map(|i| (i as u8).wrapping_mul(seed))
            .collect()
    };
    let text = format!("Describe {} in one word:", mtmd_default_marker());
    let mut run = |pixels: &[u8]| -> common::AnyResult<Vec<f32>> {
        let mut ctx = model.new_context(&backend, common::raw_params(512, 64, 1, 2))?;
        let bitmap = MtmdBitmap::from_image_data(16, 16, pixels)?;
        let input = MtmdInputText {
            text: text.clone(),
            add_special: true,
            parse_special: true,
        };
        let chunks = mtmd.tokenize(input, &[&bitmap])?;
        println!(
            "chunks {} tokens {} positions {}",
            chunks.len(),
            chunks.total_tokens(),
            chunks.total_positions()
        );
        let n_past = chunks.eval_chunks(&mut mtmd, &mut ctx, 0, 0, 64, true)?;
        println!("n_past {n_past}");
        Ok(ctx.get_logits_ith(-1).to_vec())
    };
    let a = run(&image(3))?;
    let b = run(&image(3))?;
    let c = run(&image(7))?;
    let diff = |x: &[f32], y: &[f32]| {
        x.iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(0f32, f32::max)
    };
    println!("same image: max |diff| {}", diff(&a, &b));
    println!("other image: max |diff| {}", diff(&a, &c));
    let huge = MtmdBitmap::from_image_data(0, 0, &[]);
    println!("a 0x0 image: {:?}", huge.is_err());
    Ok(())
}
