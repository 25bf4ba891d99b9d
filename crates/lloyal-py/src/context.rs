//! `lloyal._lloyal.NativeContext`: the context handle. Conversions and GIL
//! handling only; the engine lives in `lloyal_core::Context`.

use std::path::PathBuf;
use std::sync::Arc;

use lloyal_core::params::GpuLayers;
use lloyal_core::{chat, Base, Context, ContextParams, KvType, Pooling};
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::arrays::f32_slice;
use crate::errors::IntoPyResult;
use crate::registry::Registry;
use crate::reply::{none, py_reply};
use crate::sampling::params_from_py;

#[pyclass(name = "NativeContext", module = "lloyal._lloyal", frozen)]
pub struct PyContext {
    pub(crate) inner: Arc<Context>,
    /// The object of each of its branches (see `crate::branch`).
    pub(crate) objects: Arc<Registry>,
}

/// Keeps a context's worker busy until released (or garbage collected).
#[pyclass(name = "Hold", module = "lloyal._lloyal", frozen)]
pub struct PyHold {
    hold: std::sync::Mutex<Option<lloyal_core::Hold>>,
}

#[pymethods]
impl PyHold {
    /// Let the worker go on with what queued up behind the hold.
    fn release(&self) {
        drop(self.hold.lock().unwrap_or_else(|p| p.into_inner()).take());
    }
}

fn parse<T: std::str::FromStr<Err = lloyal_core::Error>>(s: &str) -> PyResult<T> {
    s.parse().py_err()
}

fn wrap_context(py: Python<'_>, ctx: Context) -> PyResult<Py<PyAny>> {
    Ok(Py::new(
        py,
        PyContext {
            inner: Arc::new(ctx),
            objects: Arc::default(),
        },
    )?
    .into_any())
}

impl PyContext {
    fn logits_arg<'a>(
        logits: &'a Option<PyReadonlyArray1<'_, f32>>,
    ) -> PyResult<Option<&'a [f32]>> {
        logits.as_ref().map(f32_slice).transpose()
    }
}

#[pymethods]
impl PyContext {
    /// Load the model and create the context on a new worker thread, then
    /// call ``done(error, context)`` from that thread.
    #[staticmethod]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (model_path, done, *, n_ctx, n_batch, n_seq_max, n_threads, embeddings, pooling, type_k, type_v, n_gpu_layers, fit_margin, deterministic=false))]
    fn open(
        model_path: PathBuf,
        done: Py<PyAny>,
        n_ctx: u32,
        n_batch: u32,
        n_seq_max: u32,
        n_threads: Option<u32>,
        embeddings: bool,
        pooling: &str,
        type_k: Option<&str>,
        type_v: Option<&str>,
        n_gpu_layers: Option<i64>,
        fit_margin: Option<u64>,
        deterministic: bool,
    ) -> PyResult<()> {
        let params = context_params(
            n_ctx,
            n_batch,
            n_seq_max,
            n_threads,
            embeddings,
            pooling,
            [type_k, type_v],
            n_gpu_layers,
            fit_margin,
            deterministic,
        )?;
        Context::open(model_path, params, py_reply(done, wrap_context));
        Ok(())
    }

    fn decode(&self, tokens: Vec<i32>, pos: i32, seq_id: i32, done: Py<PyAny>) {
        self.inner.decode(tokens, pos, seq_id, py_reply(done, none));
    }

    /// Occupy the worker until ``release()`` (tests: see
    /// ``lloyal_core::Context::hold``).
    fn hold(&self) -> PyHold {
        PyHold {
            hold: std::sync::Mutex::new(Some(self.inner.hold())),
        }
    }

    fn close(&self, done: Py<PyAny>) {
        self.inner.close(py_reply(done, none));
    }

    /// Close and wait for the worker thread (GIL released meanwhile).
    fn close_sync(&self, py: Python<'_>) {
        let inner = Arc::clone(&self.inner);
        py.detach(move || inner.close_blocking());
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    #[getter]
    fn vocab_size(&self) -> u32 {
        self.inner.model().vocab_size()
    }

    #[getter]
    fn n_ctx(&self) -> u32 {
        self.inner.n_ctx()
    }

    #[getter]
    fn n_batch(&self) -> u32 {
        self.inner.params().n_batch
    }

    /// The layers offloaded to the GPU, ``n_gpu_layers="auto"`` resolved:
    /// ``-1`` every layer, ``0`` none.
    #[getter]
    fn n_gpu_layers(&self) -> i32 {
        self.inner.params().n_gpu_layers.to_llama()
    }

    #[getter]
    fn decode_threads(&self) -> u32 {
        self.inner.decode_threads()
    }

    #[getter]
    fn step_tokens(&self) -> Option<u32> {
        self.inner.step_tokens()
    }

    #[setter]
    fn set_step_tokens(&self, tokens: Option<u32>) -> PyResult<()> {
        self.inner.set_step_tokens(tokens).py_err()
    }

    #[getter]
    fn n_seq_max(&self) -> u32 {
        self.inner.params().n_seq_max
    }

    #[getter]
    fn n_threads(&self) -> u32 {
        self.inner.params().effective_threads()
    }

    #[getter]
    fn embedding_dim(&self) -> u32 {
        if self.inner.ranks() {
            self.inner.model().n_cls_out()
        } else {
            self.inner.model().info().n_embd
        }
    }

    #[getter]
    fn memory_size(&self) -> u64 {
        self.inner.memory_size()
    }

    #[getter]
    fn eog_token(&self) -> i32 {
        self.inner.model().eog_token()
    }

    #[getter]
    fn bos_token(&self) -> Option<i32> {
        self.inner.model().bos_token()
    }

    /// The fill-in-the-middle tokens by role (`None`: the model has none).
    fn fim_tokens<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let fim = self.inner.model().fim_tokens();
        let d = PyDict::new(py);
        d.set_item("prefix", fim.prefix)?;
        d.set_item("suffix", fim.suffix)?;
        d.set_item("middle", fim.middle)?;
        d.set_item("pad", fim.pad)?;
        d.set_item("repo", fim.repo)?;
        d.set_item("file_sep", fim.file_sep)?;
        Ok(d)
    }

    #[getter]
    fn chat_template(&self) -> Option<String> {
        self.inner.model().chat_template().map(str::to_owned)
    }

    fn model_info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let info = self.inner.model().info();
        let d = PyDict::new(py);
        d.set_item("path", &info.path)?;
        d.set_item("name", &info.name)?;
        d.set_item("architecture", &info.architecture)?;
        d.set_item("n_params", info.n_params)?;
        d.set_item("size_bytes", info.size_bytes)?;
        d.set_item("n_ctx_train", info.n_ctx_train)?;
        d.set_item("n_embd", info.n_embd)?;
        d.set_item("n_layer", info.n_layer)?;
        d.set_item("vocab_size", info.vocab_size)?;
        d.set_item("has_chat_template", info.has_chat_template)?;
        Ok(d)
    }

    /// Whether the GGUF declares a reranker (what rank pooling needs).
    fn is_reranker(&self) -> bool {
        self.inner.model().is_reranker()
    }

    fn meta(&self, key: &str) -> Option<String> {
        self.inner.model().meta(key)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("decode_calls", s.decode_calls)?;
        d.set_item("tokens_decoded", s.tokens_decoded)?;
        d.set_item("decode_seconds", s.decode_seconds)?;
        d.set_item("tombstone_purges", s.tombstone_purges)?;
        d.set_item("media_encodes", s.media_encodes)?;
        Ok(d)
    }

    #[pyo3(signature = (text, add_special, parse_special))]
    fn tokenize(
        &self,
        py: Python<'_>,
        text: &str,
        add_special: Option<bool>,
        parse_special: bool,
    ) -> PyResult<Vec<i32>> {
        let model = Arc::clone(self.inner.model());
        let text = text.to_owned();
        py.detach(move || model.tokenize(&text, add_special, parse_special))
            .py_err()
    }

    #[pyo3(signature = (tokens, render_special))]
    fn detokenize(
        &self,
        py: Python<'_>,
        tokens: Vec<i32>,
        render_special: bool,
    ) -> PyResult<String> {
        let model = Arc::clone(self.inner.model());
        py.detach(move || model.detokenize(&tokens, render_special))
            .py_err()
    }

    fn token_bytes<'py>(
        &self,
        py: Python<'py>,
        token: i32,
        render_special: bool,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self
            .inner
            .model()
            .token_bytes(token, render_special)
            .py_err()?;
        Ok(PyBytes::new(py, &bytes))
    }

    fn is_stop_token(&self, token: i32) -> PyResult<bool> {
        self.inner.model().is_stop_token(token).py_err()
    }

    fn kv_seq_pos_max(&self, seq_id: i32) -> PyResult<i32> {
        self.inner.kv_seq_pos_max(seq_id).py_err()
    }

    fn get_logits<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let logits = self.inner.logits().py_err()?;
        Ok(PyArray1::from_slice(py, &logits))
    }

    #[pyo3(signature = (params, logits=None))]
    fn sample(
        &self,
        params: &Bound<'_, PyAny>,
        logits: Option<PyReadonlyArray1<'_, f32>>,
    ) -> PyResult<i32> {
        let params = params_from_py(params)?;
        let logits = Self::logits_arg(&logits)?;
        self.inner.sample(&params, logits).py_err()
    }

    fn greedy_sample(&self) -> PyResult<i32> {
        self.inner.greedy_sample().py_err()
    }

    fn reset_sampler(&self) {
        self.inner.reset_sampler();
    }

    #[pyo3(signature = (base, logits=None))]
    fn model_entropy(
        &self,
        base: &str,
        logits: Option<PyReadonlyArray1<'_, f32>>,
    ) -> PyResult<f64> {
        let base = parse::<Base>(base)?;
        self.inner
            .model_entropy(base, Self::logits_arg(&logits)?)
            .py_err()
    }

    #[pyo3(signature = (token, base, logits=None))]
    fn model_surprisal(
        &self,
        token: i32,
        base: &str,
        logits: Option<PyReadonlyArray1<'_, f32>>,
    ) -> PyResult<f64> {
        let base = parse::<Base>(base)?;
        self.inner
            .model_surprisal(token, base, Self::logits_arg(&logits)?)
            .py_err()
    }

    /// Render a conversation; returns ``(prompt, stop_tokens, template_source)``.
    #[pyo3(signature = (messages_json, add_generation_prompt, template, extra_json))]
    fn format_chat(
        &self,
        py: Python<'_>,
        messages_json: &str,
        add_generation_prompt: bool,
        template: Option<&str>,
        extra_json: Option<&str>,
    ) -> PyResult<(String, Vec<i32>, String)> {
        // Rendering runs bounded, on a thread of its own; other Python
        // threads run meanwhile.
        let model = self.inner.model();
        let p = py
            .detach(|| {
                chat::format_chat(
                    model,
                    template,
                    messages_json,
                    add_generation_prompt,
                    extra_json,
                )
            })
            .py_err()?;
        Ok((p.prompt, p.stop_tokens, p.template_source))
    }

    #[pyo3(signature = (template=None))]
    fn turn_separator(&self, py: Python<'_>, template: Option<&str>) -> PyResult<Vec<i32>> {
        let model = self.inner.model();
        py.detach(|| chat::turn_separator(model, template)).py_err()
    }
}

/// Whether ``source`` parses as a Jinja chat template.
#[pyfunction]
pub fn validate_chat_template(py: Python<'_>, source: &str) -> bool {
    py.detach(|| chat::validate_template(source))
}

/// Names of the built-in chat templates.
#[pyfunction]
pub fn builtin_chat_templates() -> Vec<&'static str> {
    chat::BUILTIN_TEMPLATES.iter().map(|(n, _)| *n).collect()
}

/// Wait (without the GIL) for every worker thread to exit; called at
/// interpreter exit after the live contexts are closed.
#[pyfunction]
pub fn join_workers(py: Python<'_>) {
    py.detach(lloyal_core::join_workers);
}

/// ``ContextParams`` from ``create_context``'s arguments, validated.
/// ``n_gpu_layers``: ``None`` fits (auto), ``-1`` every layer, else a count.
#[allow(clippy::too_many_arguments)]
fn context_params(
    n_ctx: u32,
    n_batch: u32,
    n_seq_max: u32,
    n_threads: Option<u32>,
    embeddings: bool,
    pooling: &str,
    [type_k, type_v]: [Option<&str>; 2],
    n_gpu_layers: Option<i64>,
    fit_margin: Option<u64>,
    deterministic: bool,
) -> PyResult<ContextParams> {
    let kv = |name: Option<&str>| -> PyResult<KvType> {
        name.map_or(Ok(KvType::default_for(deterministic)), parse::<KvType>)
    };
    let n_gpu_layers = match n_gpu_layers {
        None => GpuLayers::Auto,
        Some(-1) => GpuLayers::All,
        Some(n) => GpuLayers::Count(u32::try_from(n).map_err(|_| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "n_gpu_layers must be \"auto\", -1 (every layer) or a count >= 0, got {n}"
            ))
        })?),
    };
    let params = ContextParams {
        n_ctx,
        n_batch,
        n_seq_max,
        n_threads,
        embeddings,
        pooling: parse::<Pooling>(pooling)?,
        type_k: kv(type_k)?,
        type_v: kv(type_v)?,
        n_gpu_layers,
        fit_margin: fit_margin.unwrap_or(lloyal_core::params::DEFAULT_FIT_MARGIN),
        deterministic,
    };
    params.validate().py_err()?;
    Ok(params)
}

/// What ``n_gpu_layers="auto"`` chooses for this model and context (see
/// ``lloyal_core::fit_gpu_layers``): ``-1`` every layer, else a count. Runs
/// without the GPU; reads the model file.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (model_path, *, n_ctx, n_batch, n_seq_max, embeddings, pooling, type_k, type_v, fit_margin, deterministic=false))]
pub fn fit_gpu_layers(
    py: Python<'_>,
    model_path: PathBuf,
    n_ctx: u32,
    n_batch: u32,
    n_seq_max: u32,
    embeddings: bool,
    pooling: &str,
    type_k: Option<&str>,
    type_v: Option<&str>,
    fit_margin: Option<u64>,
    deterministic: bool,
) -> PyResult<i32> {
    let params = context_params(
        n_ctx,
        n_batch,
        n_seq_max,
        None,
        embeddings,
        pooling,
        [type_k, type_v],
        None,
        fit_margin,
        deterministic,
    )?;
    let fitted = py.detach(|| lloyal_core::fit_gpu_layers(&model_path, &params));
    Ok(fitted.py_err()?.to_llama())
}

/// Whether this build can offload layers to a GPU.
#[pyfunction]
pub fn supports_gpu_offload() -> bool {
    lloyal_core::supports_gpu_offload()
}
