//! PyO3 bindings for lloyal: the `lloyal._lloyal` extension module.
//! Users import `lloyal`; this module is its native half.

mod adapter;
mod arrays;
mod backend;
mod branch;
mod context;
mod embed;
mod errors;
mod grammar;
mod kv;
mod media;
mod registry;
mod reply;
mod sampling;
mod store;

use pyo3::prelude::*;

#[pymodule]
fn _lloyal(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<context::PyContext>()?;
    m.add_class::<context::PyHold>()?;
    m.add_class::<branch::PyBranch>()?;
    m.add_class::<adapter::PyLora>()?;
    m.add_class::<adapter::PyControlVector>()?;
    m.add_class::<branch::BranchSeed>()?;
    m.add_class::<sampling::PyPerplexityTracker>()?;
    m.add_class::<sampling::PySamplingParams>()?;
    m.add_class::<reply::Completion>()?;
    m.add_class::<reply::ResultQueue>()?;
    m.add_class::<store::CancelFlag>()?;
    m.add_class::<grammar::PyGrammar>()?;
    m.add_function(wrap_pyfunction!(grammar::json_schema_to_grammar, m)?)?;
    m.add_function(wrap_pyfunction!(context::validate_chat_template, m)?)?;
    m.add_function(wrap_pyfunction!(context::builtin_chat_templates, m)?)?;
    m.add_function(wrap_pyfunction!(context::supports_gpu_offload, m)?)?;
    m.add_function(wrap_pyfunction!(context::fit_gpu_layers, m)?)?;
    m.add_function(wrap_pyfunction!(backend::backend_info, m)?)?;
    m.add_function(wrap_pyfunction!(media::probe_projector, m)?)?;
    m.add_function(wrap_pyfunction!(context::join_workers, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("LLAMA_CPP_2_VERSION", lloyal_core::LLAMA_CPP_2_VERSION)?;
    Ok(())
}
