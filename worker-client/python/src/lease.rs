//! `Lease`: a registration kept alive in the background by the runtime's threads (no Python
//! thread, no GIL) until it is released or this object goes.

use std::sync::Mutex;

use pyo3::prelude::*;
use worker_client::{LeaseKeeper, LeaseState};

use crate::runtime::{awaitable, block};

/// A registration kept alive under a lease. `release()` (or leaving a `with` / `async with`
/// block) revokes it, which removes the registration at once; dropping it without release stops
/// the keepalives, and the registration leaves one ttl later. Neither ever blocks interpreter
/// exit.
#[pyclass(module = "pd_bootstrap", frozen)]
pub struct Lease {
    keeper: Mutex<Option<LeaseKeeper>>,
}

impl Lease {
    /// Wraps a running keeper.
    pub fn new(keeper: LeaseKeeper) -> Self {
        Lease {
            keeper: Mutex::new(Some(keeper)),
        }
    }

    fn take(&self) -> Option<LeaseKeeper> {
        self.keeper.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    fn read<T>(&self, read: impl FnOnce(&LeaseKeeper) -> T) -> Option<T> {
        self.keeper
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(read)
    }
}

#[pymethods]
impl Lease {
    /// The current lease id; None once released, or while the registration is lost and being
    /// made again.
    #[getter]
    fn lease_id(&self) -> Option<i64> {
        self.read(LeaseKeeper::lease_id).flatten()
    }

    /// `"alive"`, `"lost"` (being registered again), `"failed"` (the server refused to register
    /// it again; the keeper stopped) or `"released"`.
    #[getter]
    fn state(&self) -> &'static str {
        match self.read(LeaseKeeper::state) {
            None => "released",
            Some(LeaseState::Alive { .. }) => "alive",
            Some(LeaseState::Lost { .. }) => "lost",
            Some(LeaseState::Failed { .. }) => "failed",
        }
    }

    /// True while the registration is live.
    #[getter]
    fn alive(&self) -> bool {
        self.read(LeaseKeeper::is_alive).unwrap_or(false)
    }

    /// Stops the keepalives and revokes the lease; returns whether it was live. A second call
    /// returns False.
    fn release(&self, py: Python<'_>) -> PyResult<bool> {
        match self.take() {
            Some(keeper) => block(py, keeper.release()),
            None => Ok(false),
        }
    }

    /// `release`, awaitable.
    fn arelease<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let keeper = self.take();
        awaitable(py, async move {
            match keeper {
                Some(keeper) => keeper.release().await,
                None => Ok(false),
            }
        })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _traceback: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        self.release(py)?;
        Ok(false)
    }

    fn __aenter__<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let lease = slf.clone().unbind();
        pyo3_async_runtimes::tokio::future_into_py(slf.py(), async move { Ok(lease) })
    }

    fn __aexit__<'py>(
        &self,
        py: Python<'py>,
        _exc_type: Option<&Bound<'py, PyAny>>,
        _exc: Option<&Bound<'py, PyAny>>,
        _traceback: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.arelease(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "Lease(state={:?}, lease_id={:?})",
            self.state(),
            self.lease_id()
        )
    }
}
