//! Images and audio in a branch, through llama.cpp's libmtmd: a projector
//! (mmproj GGUF) loaded on the worker, and one medium at a time prefilled
//! into a branch's sequence at its position, so that forks made after it
//! share the medium's cells (no second encode).
//!
//! A medium is evaluated as libmtmd tokenizes the [`marker`] alone: the
//! model's own opening and closing tokens around the image or audio
//! embeddings, if it has any. Text between media is ordinary tokens, so a
//! prompt is a run of token lists and media, each medium taking
//! [`Context::media_positions`] positions.

mod check;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use llama_cpp_2::mtmd::{
    mtmd_default_marker, MtmdBitmap, MtmdContext, MtmdContextParams, MtmdEvalError,
    MtmdInputChunkType, MtmdInputChunks, MtmdInputText,
};

use crate::engine::{Context, Job, Reply, Task, Worker};
use crate::error::{Error, Result};
use crate::state::BranchId;
use crate::sync::lock;

/// The largest side of an image, in pixels, checked before it is decoded.
pub const MAX_SIDE: u32 = 8192;

/// One image or audio clip.
#[derive(Debug, Clone)]
pub enum Media {
    /// RGB pixels, `width * height * 3` bytes, row by row.
    Rgb {
        width: u32,
        height: u32,
        pixels: Vec<u8>,
    },
    /// An encoded file, decoded by libmtmd: an image (PNG, JPEG, BMP, GIF,
    /// ...) or audio (WAV, MP3, FLAC), told apart by its first bytes.
    Encoded(Vec<u8>),
}

/// What a loaded projector takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProjectorInfo {
    pub vision: bool,
    pub audio: bool,
    /// The sample rate audio is resampled to (`None` without audio).
    pub audio_sample_rate: Option<u32>,
}

/// The text libmtmd replaces by a medium (`<__media__>`).
pub fn marker() -> &'static str {
    mtmd_default_marker()
}

fn bad(message: impl Into<String>) -> Error {
    Error::Media(message.into())
}

struct LoadProjector {
    path: PathBuf,
    reply: Reply<ProjectorInfo>,
}

impl Task for LoadProjector {
    fn run(self: Box<Self>, worker: &mut Worker<'_>) {
        let LoadProjector { path, reply } = *self;
        reply.send(worker.load_projector(path));
    }

    fn fail(self: Box<Self>, error: Error) {
        self.reply.send(Err(error));
    }
}

struct Positions {
    media: Media,
    reply: Reply<MediaLayout>,
}

/// What [`Context::media_positions`] tells of a medium.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaLayout {
    /// The positions it takes in a sequence.
    pub positions: i32,
    /// A 128-bit hash of its decoded pixels or samples: the same picture
    /// as PNG, JPEG or raw pixels hashes the same.
    pub content: u128,
}

impl Task for Positions {
    fn run(self: Box<Self>, worker: &mut Worker<'_>) {
        let Positions { media, reply } = *self;
        reply.send(
            worker
                .tokenize_media(&media)
                .map(|(chunks, content)| MediaLayout {
                    positions: chunks.total_positions(),
                    content,
                }),
        );
    }

    fn fail(self: Box<Self>, error: Error) {
        self.reply.send(Err(error));
    }
}

struct PrefillMedia {
    id: BranchId,
    media: Media,
    reply: Reply<i32>,
}

impl Task for PrefillMedia {
    fn run(self: Box<Self>, worker: &mut Worker<'_>) {
        let PrefillMedia { id, media, reply } = *self;
        reply.send(worker.prefill_media(id, &media));
    }

    fn fail(self: Box<Self>, error: Error) {
        self.reply.send(Err(error));
    }
}

/// Load `mmproj` for the model at `model_path` (its vocabulary and sizes
/// only) with libmtmd, as a context would, and let it go: what a probe
/// process runs, so that a projector libmtmd crashes on (a tensor its graph
/// needs missing, a size it asserts on) kills the probe, not the caller.
/// See `lloyal._probe`.
pub fn probe_projector(model_path: &Path, mmproj: &Path) -> Result<ProjectorInfo> {
    check::check_projector(mmproj)?;
    let refuse = |reason: String| Error::ProjectorLoad {
        path: mmproj.to_path_buf(),
        reason,
    };
    let backend = crate::backend::backend()?;
    let params = llama_cpp_2::model::params::LlamaModelParams::default().with_vocab_only(true);
    let model = llama_cpp_2::model::LlamaModel::load_from_file(backend, model_path, &params)
        .map_err(|e| Error::ModelLoad {
            path: model_path.to_path_buf(),
            reason: e.to_string(),
        })?;
    let utf8 = mmproj
        .to_str()
        .ok_or_else(|| refuse("the path is not valid UTF-8".into()))?;
    let params = MtmdContextParams {
        n_threads: 1,
        use_gpu: false,
        print_timings: false,
        ..MtmdContextParams::default()
    };
    let loaded = MtmdContext::init_from_file(utf8, &model, &params)
        .map_err(|e| refuse(format!("libmtmd refused it ({e})")))?;
    Ok(ProjectorInfo {
        vision: loaded.support_vision(),
        audio: loaded.support_audio(),
        audio_sample_rate: loaded.get_audio_sample_rate(),
    })
}

impl Worker<'_> {
    fn load_projector(&mut self, path: PathBuf) -> Result<ProjectorInfo> {
        check::check_projector(&path)?;
        let refuse = |reason: String| Error::ProjectorLoad {
            path: path.clone(),
            reason,
        };
        let utf8 = path
            .to_str()
            .ok_or_else(|| refuse("the path is not valid UTF-8".into()))?;
        let params = MtmdContextParams {
            n_threads: self.params.effective_threads() as i32,
            use_gpu: self.params.n_gpu_layers.offloads(),
            print_timings: false,
            ..MtmdContextParams::default()
        };
        // llama.cpp's own message (another model's width, a missing tensor)
        // goes to its log; the error says where to look.
        let loaded =
            MtmdContext::init_from_file(utf8, &self.model.llama, &params).map_err(|e| {
                refuse(format!(
                    "libmtmd refused it ({e}): a projector made for another model, or a file it \
                 cannot read (llama.cpp's log has the reason)"
                ))
            })?;
        let info = ProjectorInfo {
            vision: loaded.support_vision(),
            audio: loaded.support_audio(),
            audio_sample_rate: loaded.get_audio_sample_rate(),
        };
        self.mtmd = Some(loaded);
        Ok(info)
    }

    /// The chunks libmtmd makes of the marker alone with `media`, and the
    /// hash of its decoded content.
    fn tokenize_media(&self, media: &Media) -> Result<(MtmdInputChunks, u128)> {
        let mtmd = self.mtmd.as_ref().ok_or_else(|| {
            Error::InvalidArgument(
                "no projector is loaded: pass mmproj= to create_context or call load_projector"
                    .into(),
            )
        })?;
        let bitmap = bitmap(mtmd, media)?;
        let kind = if bitmap.is_audio() { "audio" } else { "images" };
        let takes = if bitmap.is_audio() {
            mtmd.support_audio()
        } else {
            mtmd.support_vision()
        };
        if !takes {
            return Err(bad(format!("this projector does not take {kind}")));
        }
        let input = MtmdInputText {
            text: marker().to_owned(),
            add_special: false,
            parse_special: true,
        };
        let content = content_hash(&bitmap);
        let chunks = mtmd
            .tokenize(input, &[&bitmap])
            .map_err(|e| bad(format!("libmtmd could not prepare the {kind}: {e}")))?;
        Ok((chunks, content))
    }

    fn prefill_media(&mut self, id: BranchId, media: &Media) -> Result<i32> {
        let (seq, start, set) = {
            let branches = lock(&self.shared.branches);
            let b = branches.get(id)?;
            if b.is_busy() {
                return Err(Error::BranchBusy);
            }
            (b.seq, b.position, b.adapters().clone())
        };
        let (chunks, _) = self.tokenize_media(media)?;
        self.finish_background();
        self.use_adapters(&set)?;
        let ends_in_text = chunks
            .get(chunks.len().saturating_sub(1))
            .is_some_and(|c| c.chunk_type() == MtmdInputChunkType::Text);
        self.shared
            .stats
            .media_encodes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let n_batch = self.n_batch as i32;
        let mut result = self.eval(&chunks, start, seq, n_batch);
        if matches!(result, Err(MtmdEvalError::EvalFailure(1))) && self.purge_tombstones() {
            // A full cache frees the deterministic mode's tombstones and
            // tries once more, as a text decode does.
            result = self.eval(&chunks, start, seq, n_batch);
        }
        let end = match result {
            Ok(end) => end,
            Err(e) => {
                return Err(match e {
                    MtmdEvalError::EvalFailure(1) => {
                        Error::KvCacheFull("no room for the medium's cells".into())
                    }
                    e => Error::Decode(format!("the medium could not be evaluated: {e}")),
                });
            }
        };
        let logits: Option<Arc<[f32]>> =
            ends_in_text.then(|| Arc::from(self.ctx.get_logits_ith(-1)));
        self.refresh_seq(seq);
        let mut branches = lock(&self.shared.branches);
        let b = branches.get_mut(id)?;
        b.position = end;
        match logits {
            Some(l) => b.set_logits(l),
            None => b.clear_logits(),
        }
        Ok(end - start)
    }
}

impl Worker<'_> {
    /// Evaluate `chunks` into `seq` from `start`; on an error, nothing of
    /// them stays (the cells they took go back).
    fn eval(
        &mut self,
        chunks: &MtmdInputChunks,
        start: i32,
        seq: i32,
        n_batch: i32,
    ) -> std::result::Result<i32, MtmdEvalError> {
        let mtmd = self.mtmd.as_mut().expect("tokenize_media checked it");
        let result = chunks.eval_chunks(mtmd, &mut self.ctx, start, seq, n_batch, true);
        if result.is_err() {
            let _ = self.remove_cells(seq, u32::try_from(start).ok(), None);
            self.refresh_seq(seq);
        }
        result
    }
}

fn bitmap(mtmd: &MtmdContext, m: &Media) -> Result<MtmdBitmap> {
    match m {
        Media::Rgb {
            width,
            height,
            pixels,
        } => {
            check_sides(*width, *height)?;
            if pixels.len() != (*width as usize) * (*height as usize) * 3 {
                return Err(bad(format!(
                    "an RGB image of {width}x{height} has {} bytes, not {}",
                    (*width as usize) * (*height as usize) * 3,
                    pixels.len()
                )));
            }
            MtmdBitmap::from_image_data(*width, *height, pixels)
                .map_err(|e| bad(format!("libmtmd refused the pixels: {e}")))
        }
        Media::Encoded(bytes) => {
            if bytes.is_empty() {
                return Err(bad("the media is empty"));
            }
            // The header alone first (no pixel decoded), so that a huge
            // image is refused before it takes memory.
            let head = MtmdBitmap::from_buffer(mtmd, bytes, true).map_err(|_| {
                bad(
                    "the media could not be read: not an image or audio format libmtmd reads \
                     (PNG, JPEG, BMP, GIF, TGA, WAV, MP3, FLAC), or corrupt",
                )
            })?;
            if !head.is_audio() {
                check_sides(head.nx(), head.ny())?;
            }
            MtmdBitmap::from_buffer(mtmd, bytes, false)
                .map_err(|_| bad("the media could not be decoded (truncated or corrupt)"))
        }
    }
}

/// Two SipHash passes with different prefixes: 128 bits, so that two
/// different pictures never share a prefix-cache entry in practice.
fn content_hash(bitmap: &MtmdBitmap) -> u128 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let half = |salt: u8| {
        let mut h = DefaultHasher::new();
        (
            salt,
            bitmap.is_audio(),
            bitmap.nx(),
            bitmap.ny(),
            bitmap.data(),
        )
            .hash(&mut h);
        h.finish()
    };
    (u128::from(half(0)) << 64) | u128::from(half(1))
}

fn check_sides(width: u32, height: u32) -> Result<()> {
    if width == 0 || height == 0 || width > MAX_SIDE || height > MAX_SIDE {
        return Err(bad(format!(
            "an image must be 1 to {MAX_SIDE} pixels a side, got {width}x{height}"
        )));
    }
    Ok(())
}

impl Context {
    /// Load a projector (mmproj GGUF) for this context's model, replacing
    /// any loaded before (media already in branches stay). Replies with
    /// what it takes.
    pub fn load_projector(&self, path: impl Into<PathBuf>, reply: Reply<ProjectorInfo>) {
        self.submit(Job::task(LoadProjector {
            path: path.into(),
            reply,
        }));
    }

    /// How many positions `media` takes in a sequence (its embeddings and
    /// the model's tokens around them), and its content hash, without
    /// encoding it.
    pub fn media_positions(&self, media: Media, reply: Reply<MediaLayout>) {
        self.submit(Job::task(Positions { media, reply }));
    }

    /// The body of [`Branch::prefill_media`](crate::Branch::prefill_media).
    pub(crate) fn branch_prefill_media(&self, id: BranchId, media: Media, reply: Reply<i32>) {
        self.submit(Job::task(PrefillMedia { id, media, reply }));
    }
}
