//! `Watch`: the registry's changes as an iterator and an async iterator.

use std::sync::Arc;

use futures_util::stream::{BoxStream, StreamExt};
use pyo3::exceptions::{PyStopAsyncIteration, PyStopIteration};
use pyo3::prelude::*;
use serde::Serialize;
use worker_client::{BootstrapClient, ClientError, WatchUpdate};

use crate::errors::to_py;
use crate::runtime::{block, Wire};

type Updates = BoxStream<'static, Result<WatchUpdate, ClientError>>;

/// One update as Python sees it: the wire shape with its kind.
#[derive(Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
enum Update {
    Snapshot(pd_protocol::native::WorkerList),
    Events(pd_protocol::native::WatchBatch),
}

/// The registry's worker changes: a snapshot first (unless started from a revision), then
/// batches of events; again a snapshot whenever the watch fell behind the server's history.
/// Each `next()` waits (GIL released) until something changes; transient failures are retried
/// inside with backoff, and a refusal ends the iteration with its exception.
#[pyclass(module = "pd_bootstrap", frozen)]
pub struct Watch {
    updates: Arc<tokio::sync::Mutex<Updates>>,
}

impl Watch {
    /// The watch of `client` from `since`.
    pub fn new(client: BootstrapClient, since: Option<u64>) -> Self {
        Watch {
            updates: Arc::new(tokio::sync::Mutex::new(client.watch(since))),
        }
    }
}

/// The next update, skipping the transient failures the stream retries by itself; `None` at
/// the end.
async fn next_update(
    updates: Arc<tokio::sync::Mutex<Updates>>,
) -> Result<Option<Update>, ClientError> {
    let mut updates = updates.lock().await;
    loop {
        match updates.next().await {
            None => return Ok(None),
            Some(Ok(WatchUpdate::Snapshot(list))) => return Ok(Some(Update::Snapshot(list))),
            Some(Ok(WatchUpdate::Events(batch))) => return Ok(Some(Update::Events(batch))),
            Some(Err(err)) if err.is_retryable() => continue,
            Some(Err(err)) => return Err(err),
        }
    }
}

#[pymethods]
impl Watch {
    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match block(py, next_update(self.updates.clone()))? {
            Some(update) => Ok(pythonize::pythonize(py, &update)?.unbind()),
            None => Err(PyStopIteration::new_err(())),
        }
    }

    fn __aiter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __anext__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let updates = self.updates.clone();
        crate::runtime::runtime()?;
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            match next_update(updates).await {
                Ok(Some(update)) => Ok(Wire(update)),
                Ok(None) => Err(PyStopAsyncIteration::new_err(())),
                Err(err) => Err(to_py(&err)),
            }
        })
    }
}
