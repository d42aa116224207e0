//! `EngineDirectory`: D's cached, single-flight, incarnation-aware lookups, awaited, blocking,
//! or submitted and polled from a scheduler loop that must never wait on the network.

use std::sync::{Arc, OnceLock};

use pd_protocol::Rank;
use pyo3::prelude::*;
use pyo3::types::PyList;
use worker_client::{ClientError, EngineDirectory, EngineInfo};

use crate::client::{seconds, PyBootstrapClient};
use crate::errors::to_py;
use crate::runtime::{awaitable, block, check_process, runtime};

/// Where a remote engine's workers are, cached per bootstrap address: one fetch serves every
/// lookup waiting for it, the cache follows the server's watch and drops an engine whose
/// incarnation changed (a restarted P), and an unknown engine id is fetched once more before
/// `NotFound`. With `meta`, every engine found is checked against this D's layout
/// (`Incompatible` on the first field that differs).
#[pyclass(name = "EngineDirectory", module = "pd_bootstrap", frozen)]
pub struct PyEngineDirectory {
    directory: Arc<EngineDirectory>,
    pid: u32,
}

/// One remote engine: its id, incarnation, registered layout and worker addresses.
#[pyclass(name = "EngineInfo", module = "pd_bootstrap", frozen)]
pub struct PyEngineInfo(Arc<EngineInfo>);

/// A lookup submitted with `EngineDirectory.submit_lookup`; `EngineDirectory.poll` tells
/// whether it is done, never waiting.
#[pyclass(module = "pd_bootstrap", frozen)]
pub struct LookupHandle {
    outcome: Arc<OnceLock<Result<Arc<EngineInfo>, ClientError>>>,
    bootstrap_addr: String,
    engine_id: String,
}

impl LookupHandle {
    /// The engine once found, the exception once failed, None before.
    fn outcome(&self, py: Python<'_>) -> PyResult<Option<Py<PyEngineInfo>>> {
        match self.outcome.get() {
            None => Ok(None),
            Some(Ok(engine)) => Ok(Some(Py::new(py, PyEngineInfo(engine.clone()))?)),
            Some(Err(err)) => Err(to_py(err)),
        }
    }
}

#[pymethods]
impl LookupHandle {
    /// Whether the lookup has finished (found or failed).
    fn done(&self) -> bool {
        self.outcome.get().is_some()
    }

    fn __repr__(&self) -> String {
        format!(
            "LookupHandle({:?} at {:?}, done={})",
            self.engine_id,
            self.bootstrap_addr,
            self.done()
        )
    }
}

#[pymethods]
impl PyEngineDirectory {
    #[new]
    #[pyo3(signature = (client, *, meta=None))]
    fn new(client: &PyBootstrapClient, meta: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let layout = match meta {
            None => Default::default(),
            Some(meta) => pythonize::depythonize(meta)
                .map_err(|err| crate::errors::InvalidInput::new_err(format!("meta: {err}")))?,
        };
        Ok(PyEngineDirectory {
            directory: Arc::new(EngineDirectory::new(client.client()?).with_layout(layout)),
            pid: std::process::id(),
        })
    }

    /// The engine `engine_id` registered at `bootstrap_addr`, from the cache or one fetch.
    fn engine(
        &self,
        py: Python<'_>,
        bootstrap_addr: String,
        engine_id: String,
    ) -> PyResult<PyEngineInfo> {
        check_process(self.pid)?;
        if let Some(found) = self.directory.cached(&bootstrap_addr, &engine_id) {
            return found.map(PyEngineInfo).map_err(|err| to_py(&err));
        }
        let directory = self.directory.clone();
        let engine = block(py, async move {
            directory.engine(&bootstrap_addr, &engine_id).await
        })?;
        Ok(PyEngineInfo(engine))
    }

    /// `engine`, awaitable.
    fn aengine<'py>(
        &self,
        py: Python<'py>,
        bootstrap_addr: String,
        engine_id: String,
    ) -> PyResult<Bound<'py, PyAny>> {
        check_process(self.pid)?;
        let directory = self.directory.clone();
        awaitable(py, async move {
            directory
                .engine(&bootstrap_addr, &engine_id)
                .await
                .map(PyEngineInfo)
        })
    }

    /// Starts looking `engine_id` up at `bootstrap_addr` on the binding's own threads and
    /// returns at once (microseconds, never the network); an engine already cached is in the
    /// handle before it returns, and a lookup fails with `Timeout` after `timeout` seconds at
    /// the latest. Poll the handle from the scheduler loop.
    #[pyo3(signature = (bootstrap_addr, engine_id, *, timeout=5.0))]
    fn submit_lookup(
        &self,
        bootstrap_addr: String,
        engine_id: String,
        timeout: f64,
    ) -> PyResult<LookupHandle> {
        check_process(self.pid)?;
        let deadline = seconds("timeout", timeout)?;
        let outcome = Arc::new(OnceLock::new());
        let handle = LookupHandle {
            outcome: outcome.clone(),
            bootstrap_addr: bootstrap_addr.clone(),
            engine_id: engine_id.clone(),
        };
        if let Some(found) = self.directory.cached(&bootstrap_addr, &engine_id) {
            let _ = outcome.set(found);
            return Ok(handle);
        }
        let directory = self.directory.clone();
        runtime()?.spawn(async move {
            let looked_up =
                tokio::time::timeout(deadline, directory.engine(&bootstrap_addr, &engine_id))
                    .await
                    .unwrap_or_else(|_| {
                        Err(ClientError::Timeout {
                            url: bootstrap_addr.clone(),
                            timeout: deadline,
                        })
                    });
            let _ = outcome.set(looked_up);
        });
        Ok(handle)
    }

    /// The handle's engine once found, None while the lookup runs; raises its exception once
    /// it failed. Never waits: it reads what the lookup left.
    fn poll(&self, py: Python<'_>, handle: &LookupHandle) -> PyResult<Option<Py<PyEngineInfo>>> {
        handle.outcome(py)
    }

    /// `poll` of each handle, in order, without raising: an `EngineInfo`, None (still
    /// running) or the exception instance of a failed lookup.
    fn poll_many<'py>(
        &self,
        py: Python<'py>,
        handles: Vec<Py<LookupHandle>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let outcomes = handles.iter().map(|handle| match handle.get().outcome(py) {
            Ok(Some(engine)) => engine.into_any(),
            Ok(None) => py.None(),
            Err(err) => err.into_value(py).into_any(),
        });
        PyList::new(py, outcomes)
    }

    /// Forgets what is cached for `bootstrap_addr` (e.g. after a transfer from it failed).
    fn invalidate(&self, bootstrap_addr: &str) {
        self.directory.invalidate(bootstrap_addr);
    }
}

#[pymethods]
impl PyEngineInfo {
    /// The engine id.
    #[getter]
    fn engine_id(&self) -> &str {
        &self.0.engine_id
    }

    /// Its incarnation (grows on every takeover or re-registration at new addresses), or None
    /// from a server that does not report it.
    #[getter]
    fn incarnation(&self) -> Option<u64> {
        self.0.incarnation
    }

    /// dp rank -> tp rank -> pp rank -> transfer address.
    #[getter]
    fn dp_ranks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(pythonize::pythonize(py, &self.0.dp_ranks)?)
    }

    /// Its registered layout (`model`, `kv_cache_dtype`, ... as registered; empty if none).
    #[getter]
    fn meta<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(pythonize::pythonize(py, &self.0.meta)?)
    }

    /// P's tp size as registered.
    #[getter]
    fn tp_size(&self) -> usize {
        self.0.tp_size()
    }

    /// The addresses (in pp order) of worker (dp_rank, tp_rank), or None.
    fn worker(&self, dp_rank: Rank, tp_rank: Rank) -> Option<Vec<String>> {
        self.0
            .worker(dp_rank, tp_rank)
            .map(|addrs| addrs.into_iter().map(str::to_owned).collect())
    }

    fn __repr__(&self) -> String {
        format!(
            "EngineInfo(engine_id={:?}, incarnation={:?}, dp_ranks={})",
            self.0.engine_id,
            self.0.incarnation,
            self.0.dp_ranks.len()
        )
    }
}
