//! Applying adapter sets to the llama.cpp context and loading adapters on
//! the worker (the types and file checks are in `adapter`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{Context, Job, Reply, Task, Worker};
use crate::adapter::{load, Adapters, Lora, RawLora};
use crate::error::{Error, Result};
use crate::sync::lock;

impl Worker<'_> {
    /// [`Worker::use_adapters`] with the context's default set (the flat
    /// API, embeddings).
    pub(crate) fn use_default_adapters(&mut self) -> Result<()> {
        let want = lock(&self.shared.default_adapters).clone();
        self.use_adapters(&want)
    }

    /// Make `want` the set the next decode runs under (a no-op when it is
    /// already). Each change makes llama.cpp rebuild its compute graph on
    /// the next decode, which is why a step decodes each set's tokens
    /// together.
    pub(crate) fn use_adapters(&mut self, want: &Adapters) -> Result<()> {
        if *want == self.adapters {
            return Ok(());
        }
        let raw = self.raw_ctx.map(|r| r.0).ok_or_else(|| {
            Error::Internal(
                "this build of llama-cpp-2 hides the llama.cpp context, which adapters need".into(),
            )
        })?;
        if want.control != self.adapters.control {
            let status = match &want.control {
                // SAFETY: `raw` is this worker's context; the data outlives the call.
                Some(cv) => unsafe {
                    let (data, n_embd) = cv.data();
                    let (first, last) = cv.layers();
                    llama_cpp_sys_2::llama_set_adapter_cvec(
                        raw.as_ptr(),
                        data.as_ptr(),
                        data.len(),
                        n_embd as i32,
                        first,
                        last,
                    )
                },
                // SAFETY: a null buffer turns the control vector off.
                None => unsafe {
                    llama_cpp_sys_2::llama_set_adapter_cvec(
                        raw.as_ptr(),
                        std::ptr::null(),
                        0,
                        self.model.info().n_embd as i32,
                        -1,
                        -1,
                    )
                },
            };
            if status != 0 {
                return Err(Error::Internal(
                    "llama.cpp could not apply the control vector".into(),
                ));
            }
            self.adapters.control = want.control.clone();
        }
        let mut loras: Vec<*mut llama_cpp_sys_2::llama_adapter_lora> =
            want.loras.iter().map(|(l, _)| l.raw()).collect();
        let mut scales: Vec<f32> = want.loras.iter().map(|(_, s)| *s).collect();
        let (adapters, scales_ptr) = if loras.is_empty() {
            (std::ptr::null_mut(), std::ptr::null_mut())
        } else {
            (loras.as_mut_ptr(), scales.as_mut_ptr())
        };
        // SAFETY: the adapters belong to this context's model (checked when
        // the set was given) and both arrays hold `loras.len()` entries.
        unsafe {
            llama_cpp_sys_2::llama_set_adapters_lora(
                raw.as_ptr(),
                adapters,
                loras.len(),
                scales_ptr,
            );
        }
        self.adapters.loras = want.loras.clone();
        Ok(())
    }
}

/// Loading an adapter: llama.cpp adds it to the model, so it runs on the
/// worker, between decodes.
struct LoadLora {
    path: PathBuf,
    pairs: usize,
    alpha: f32,
    reply: Reply<Lora>,
}

impl Task for LoadLora {
    fn run(self: Box<Self>, worker: &mut Worker<'_>) {
        let LoadLora {
            path,
            pairs,
            alpha,
            reply,
        } = *self;
        let model = Arc::clone(&worker.model);
        let loaded = load::init_lora(&model, &path);
        reply.send(
            loaded.map(|raw| Lora::new(RawLora(raw), Arc::clone(&model), path, alpha, pairs)),
        );
    }

    fn fail(self: Box<Self>, error: Error) {
        self.reply.send(Err(error));
    }
}

impl Context {
    /// Load a LoRA adapter (GGUF, as llama.cpp's `convert_lora_to_gguf.py`
    /// writes) into this context's model. The file is checked against the
    /// model first: its type, architecture, and every tensor's name and
    /// shape; a bad one fails with [`Error::AdapterLoad`] (a missing file
    /// with [`Error::AdapterNotFound`]) and changes nothing. Loading the
    /// same file again gives the same adapter, loaded once.
    pub fn load_lora(&self, path: impl AsRef<Path>, reply: Reply<Lora>) {
        let path = path.as_ref().to_path_buf();
        match load::check_lora(self.model(), &path) {
            Ok((pairs, alpha)) => self.submit(Job::task(LoadLora {
                path,
                pairs,
                alpha,
                reply,
            })),
            Err(e) => reply.send(Err(e)),
        }
    }

    /// The set new branches start with and the flat API and embeddings
    /// decode under (empty at first). Branches made before keep theirs.
    pub fn set_default_adapters(&self, adapters: Adapters) -> Result<()> {
        self.check_open()?;
        *lock(&self.shared.default_adapters) = adapters.checked(self.model())?;
        Ok(())
    }

    /// See [`Context::set_default_adapters`].
    pub fn default_adapters(&self) -> Adapters {
        lock(&self.shared.default_adapters).clone()
    }
}
