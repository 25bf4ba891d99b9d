//! Work that recurses on user input (template and grammar compilers) runs on
//! a thread of its own, with a stack sized for the deepest input the limits
//! admit, so that a deep input can neither overflow the caller's stack nor
//! hold the caller for ever.

use std::time::Duration;

use crate::error::{Error, Result};

/// Run `f` on a new thread named `lloyal-{what}` with `stack_bytes` of
/// stack and wait for it, at most `timeout` when given (the thread's result
/// is then dropped; `f` must bound its own work, so it ends soon after).
/// Failing to start the thread or timing out is `error(message)`; a panic
/// in `f` is [`Error::Internal`].
pub(crate) fn on_thread<T: Send + 'static>(
    what: &str,
    stack_bytes: usize,
    timeout: Option<Duration>,
    error: fn(String) -> Error,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::Builder::new()
        .name(format!("lloyal-{what}"))
        .stack_size(stack_bytes)
        .spawn(move || {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
                .unwrap_or_else(|p| Err(Error::from_panic(p)));
            let _ = tx.send(result);
        })
        .map_err(|e| error(format!("could not start the {what} thread: {e}")))?;
    match timeout {
        Some(limit) => rx.recv_timeout(limit).unwrap_or_else(|_| {
            Err(error(format!(
                "the {what} did not finish within {} s",
                limit.as_secs()
            )))
        }),
        None => rx
            .recv()
            .unwrap_or_else(|_| Err(Error::Internal(format!("the {what} thread vanished")))),
    }
}
