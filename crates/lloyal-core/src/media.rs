//! Images and audio in a branch (llama.cpp's libmtmd, feature
//! `multimodal`). WIP for issue 29 item 1: a projector loaded on the worker,
//! and a prefill of text with media markers into a branch's sequence, so
//! that forks made after it share the media's cells.

use std::path::PathBuf;
use std::sync::Arc;

use llama_cpp_2::mtmd::{
    mtmd_default_marker, MtmdBitmap, MtmdContext, MtmdContextParams, MtmdInputText,
};

use crate::engine::{Context, Job, Reply, Task, Worker};
use crate::error::{invalid, Error, Result};
use crate::state::BranchId;
use crate::sync::lock;

/// The largest side of an image, in pixels, before it is decoded.
pub const MAX_SIDE: u32 = 8192;

/// One medium for a media marker of the text.
#[derive(Debug, Clone)]
pub enum Media {
    /// RGB pixels, `width * height * 3` bytes.
    Rgb {
        width: u32,
        height: u32,
        pixels: Vec<u8>,
    },
    /// An encoded file (PNG, JPEG, ... or WAV, MP3, FLAC): decoded by libmtmd.
    Encoded(Vec<u8>),
}

/// The text that stands for one medium in a prompt.
pub fn marker() -> &'static str {
    mtmd_default_marker()
}

struct LoadProjector {
    path: PathBuf,
    reply: Reply<()>,
}

impl Task for LoadProjector {
    fn run(self: Box<Self>, worker: &mut Worker<'_>) {
        let LoadProjector { path, reply } = *self;
        let result =
            (|| {
                let utf8 = path
                    .to_str()
                    .ok_or_else(|| invalid("the path is not valid UTF-8"))?;
                let params = MtmdContextParams::default();
                let loaded = MtmdContext::init_from_file(utf8, &worker.model.llama, &params)
                    .map_err(|e| Error::AdapterLoad {
                        path: path.clone(),
                        reason: format!("llama.cpp refused the projector: {e}"),
                    })?;
                worker.mtmd = Some(loaded);
                Ok(())
            })();
        reply.send(result);
    }

    fn fail(self: Box<Self>, error: Error) {
        self.reply.send(Err(error));
    }
}

struct PrefillMedia {
    id: BranchId,
    text: String,
    media: Vec<Media>,
    reply: Reply<i32>,
}

impl Task for PrefillMedia {
    fn run(self: Box<Self>, worker: &mut Worker<'_>) {
        let PrefillMedia {
            id,
            text,
            media,
            reply,
        } = *self;
        reply.send(worker.prefill_media(id, text, media));
    }

    fn fail(self: Box<Self>, error: Error) {
        self.reply.send(Err(error));
    }
}

impl Worker<'_> {
    fn prefill_media(&mut self, id: BranchId, text: String, media: Vec<Media>) -> Result<i32> {
        let (seq, start, set) = {
            let branches = lock(&self.shared.branches);
            let b = branches.get(id)?;
            (b.seq, b.position, b.adapters.clone())
        };
        self.use_adapters(&set)?;
        let mtmd = self
            .mtmd
            .as_mut()
            .ok_or_else(|| invalid("no projector loaded: call load_projector first"))?;
        let mut bitmaps = Vec::with_capacity(media.len());
        for m in &media {
            bitmaps.push(bitmap(mtmd, m)?);
        }
        let refs: Vec<&MtmdBitmap> = bitmaps.iter().collect();
        let input = MtmdInputText {
            text,
            add_special: false,
            parse_special: true,
        };
        let chunks = mtmd
            .tokenize(input, &refs)
            .map_err(|e| invalid(format!("the text and media do not match: {e}")))?;
        let n_batch = self.n_batch as i32;
        let result = chunks.eval_chunks(mtmd, &mut self.ctx, start, seq, n_batch, true);
        let end = match result {
            Ok(end) => end,
            Err(e) => {
                let _ = self.remove_cells(seq, u32::try_from(start).ok(), None);
                self.refresh_seq(seq);
                return Err(Error::Decode(format!("the media prefill failed: {e}")));
            }
        };
        let logits: Arc<[f32]> = Arc::from(self.ctx.get_logits_ith(-1));
        self.refresh_seq(seq);
        let mut branches = lock(&self.shared.branches);
        let b = branches.get_mut(id)?;
        b.position = end;
        b.set_logits(logits);
        Ok(end - start)
    }
}

fn bitmap(mtmd: &MtmdContext, m: &Media) -> Result<MtmdBitmap> {
    match m {
        Media::Rgb {
            width,
            height,
            pixels,
        } => {
            if *width == 0 || *height == 0 || *width > MAX_SIDE || *height > MAX_SIDE {
                return Err(invalid(format!(
                    "an image must be 1 to {MAX_SIDE} pixels a side, got {width}x{height}"
                )));
            }
            if pixels.len() != (*width as usize) * (*height as usize) * 3 {
                return Err(invalid("an RGB image has width * height * 3 bytes"));
            }
            MtmdBitmap::from_image_data(*width, *height, pixels)
                .map_err(|e| invalid(format!("bad image: {e}")))
        }
        Media::Encoded(bytes) => {
            // The header first: its size is checked before any pixel is decoded.
            let head = MtmdBitmap::from_buffer(mtmd, bytes, true)
                .map_err(|_| invalid("the media could not be read (format not supported?)"))?;
            if !head.is_audio() && (head.nx() > MAX_SIDE || head.ny() > MAX_SIDE) {
                return Err(invalid(format!(
                    "an image must be at most {MAX_SIDE} pixels a side, got {}x{}",
                    head.nx(),
                    head.ny()
                )));
            }
            MtmdBitmap::from_buffer(mtmd, bytes, false)
                .map_err(|_| invalid("the media could not be decoded"))
        }
    }
}

impl Context {
    /// Load a multimodal projector (mmproj GGUF) for this context's model.
    pub fn load_projector(&self, path: impl Into<PathBuf>, reply: Reply<()>) {
        let path = path.into();
        if !path.is_file() {
            return reply.send(Err(Error::AdapterNotFound(path)));
        }
        self.submit(Job::task(LoadProjector { path, reply }));
    }

    /// Prefill `text`, each [`marker`] in it standing for the next of
    /// `media`, into branch `id`; replies with the positions it took.
    pub fn branch_prefill_media(
        &self,
        id: BranchId,
        text: String,
        media: Vec<Media>,
        reply: Reply<i32>,
    ) {
        self.submit(Job::task(PrefillMedia {
            id,
            text,
            media,
            reply,
        }));
    }
}
