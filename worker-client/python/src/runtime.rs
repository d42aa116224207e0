//! The Tokio runtime the binding's work runs on, and the two ways Python waits for that work:
//! blocking with the GIL released ([`block`]) and as an asyncio awaitable ([`awaitable`]).

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::prelude::*;
use serde::Serialize;
use worker_client::ClientError;

use crate::errors::{to_py, ForkError, PdBootstrapError};

/// The process that made the runtime; its threads exist only there.
static OWNER: OnceLock<u32> = OnceLock::new();

/// How often a blocking call looks at Python's signals (Ctrl-C) while it waits.
const SIGNAL_CHECK: Duration = Duration::from_millis(100);

/// Sets up the runtime the first call will create: two worker threads named `pd-bootstrap`.
/// Creating it lazily lets a process import the module and fork before using it.
pub fn configure() {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder
        .worker_threads(2)
        .thread_name("pd-bootstrap")
        .enable_all();
    pyo3_async_runtimes::tokio::init(builder);
}

/// The runtime, created at first use; a [`ForkError`] in a child forked after that.
pub fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    let pid = std::process::id();
    if *OWNER.get_or_init(|| pid) != pid {
        return Err(ForkError::new_err(
            "pd_bootstrap was used before this process was forked, and its runtime threads do \
             not exist in the child: use it only after the fork (create clients in the child), \
             or start children with the 'spawn' method",
        ));
    }
    Ok(pyo3_async_runtimes::tokio::get_runtime())
}

/// Fails with a [`ForkError`] when the object made in process `made_in` is used in another.
pub fn check_process(made_in: u32) -> PyResult<()> {
    if made_in == std::process::id() {
        return Ok(());
    }
    Err(ForkError::new_err(
        "this object was made before the process forked; its connections belong to the parent: \
         make a new one in the child",
    ))
}

/// What a call can fail with: the client's error, or an exception made already.
pub trait Failure: Send + 'static {
    /// The Python exception.
    fn into_py_err(self) -> PyErr;
}

impl Failure for ClientError {
    fn into_py_err(self) -> PyErr {
        to_py(&self)
    }
}

impl Failure for PyErr {
    fn into_py_err(self) -> PyErr {
        self
    }
}

/// Runs `work` on the runtime and waits for it with the GIL released, so other Python threads
/// run meanwhile; Ctrl-C (any Python signal handler that raises) cancels it. Every network call
/// in `work` is bounded by the client's timeouts and deadlines.
pub fn block<T: Send + 'static, E: Failure>(
    py: Python<'_>,
    work: impl Future<Output = Result<T, E>> + Send + 'static,
) -> PyResult<T> {
    let runtime = runtime()?;
    let mut task = runtime.spawn(work);
    loop {
        let finished = py.detach(|| {
            runtime.block_on(async { tokio::time::timeout(SIGNAL_CHECK, &mut task).await })
        });
        match finished {
            Ok(Ok(result)) => return result.map_err(Failure::into_py_err),
            Ok(Err(failed)) => {
                return Err(PdBootstrapError::new_err(format!(
                    "the call's task failed: {failed}"
                )))
            }
            Err(_) => {
                if let Err(interrupted) = py.check_signals() {
                    task.abort();
                    return Err(interrupted);
                }
            }
        }
    }
}

/// Runs `work` on the runtime as an asyncio awaitable of the running event loop; the loop is
/// never blocked.
pub fn awaitable<'py, T, E: Failure>(
    py: Python<'py>,
    work: impl Future<Output = Result<T, E>> + Send + 'static,
) -> PyResult<Bound<'py, PyAny>>
where
    T: for<'a> IntoPyObject<'a> + Send + 'static,
{
    runtime()?;
    pyo3_async_runtimes::tokio::future_into_py(py, async move {
        work.await.map_err(Failure::into_py_err)
    })
}

/// A wire answer handed to Python as the plain objects its JSON would give (dicts, lists,
/// numbers, strings).
pub struct Wire<T>(pub T);

impl<'py, T: Serialize> IntoPyObject<'py> for Wire<T> {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> Result<Self::Output, Self::Error> {
        Ok(pythonize::pythonize(py, &self.0)?)
    }
}
