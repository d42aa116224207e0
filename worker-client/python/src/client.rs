//! `BootstrapClient`: every call of the Rust client, each blocking (`query`) and as an asyncio
//! awaitable (`aquery`). The blocking forms release the GIL while they wait.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use pd_protocol::native::{Deregister, EngineMeta, ReadyStatus};
use pd_protocol::sglang::RouteRow;
use pd_protocol::vllm::RegisterWorker;
use pd_protocol::Rank;
use pyo3::prelude::*;
use worker_client::{BootstrapClient, ClientError, ClientTls, LeaseKeeper, PrefillRank};

use crate::errors::{to_py, InvalidInput, Timeout};
use crate::lease::Lease;
use crate::runtime::{awaitable, block, check_process, Wire};
use crate::watch::Watch;

/// A client of one bootstrap server. Every call has a timeout, and every retried call a
/// deadline: `register*` retries connection failures, timeouts and 5xx until
/// `register_deadline`; lookups and writes other than registration until `call_deadline`.
#[pyclass(name = "BootstrapClient", module = "pd_bootstrap", frozen)]
pub struct PyBootstrapClient {
    pub(crate) inner: BootstrapClient,
    /// The process it was made in (its connection pool belongs there).
    pub(crate) pid: u32,
}

/// A seconds argument as a duration, refused when negative, NaN or absurd.
pub fn seconds(name: &str, value: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value).map_err(|_| {
        InvalidInput::new_err(format!(
            "{name} must be a number of seconds >= 0, not {value}"
        ))
    })
}

/// The registered layout from a `meta` dict (`model`, `kv_cache_dtype`, `block_size`,
/// `tp_size`, `pp_size`, `protocol_version`; every key optional).
fn engine_meta(meta: Option<&Bound<'_, PyAny>>) -> PyResult<EngineMeta> {
    match meta {
        None => Ok(EngineMeta::default()),
        Some(meta) => pythonize::depythonize(meta)
            .map_err(|err| InvalidInput::new_err(format!("meta: {err}"))),
    }
}

impl PyBootstrapClient {
    /// The Rust client, checked to belong to this process.
    pub(crate) fn client(&self) -> PyResult<BootstrapClient> {
        check_process(self.pid)?;
        Ok(self.inner.clone())
    }

    #[allow(clippy::too_many_arguments)]
    fn worker(
        engine_id: String,
        dp_rank: Rank,
        tp_rank: Rank,
        pp_rank: Rank,
        addr: String,
        replace: Option<bool>,
        lease_ttl: Option<u32>,
        meta: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<RegisterWorker> {
        Ok(RegisterWorker {
            engine_id,
            dp_rank,
            tp_rank,
            pp_rank,
            addr,
            replace,
            lease_ttl,
            meta: engine_meta(meta)?,
        })
    }

    fn leased(
        &self,
        worker: RegisterWorker,
        ttl: u32,
    ) -> PyResult<impl Future<Output = Result<Lease, ClientError>> + Send + 'static> {
        let client = self.client()?;
        Ok(async move {
            let keeper: LeaseKeeper = client.register_leased(&worker, ttl).await?;
            Ok(Lease::new(keeper))
        })
    }
}

/// The readiness once the topology is complete; `Timeout` if it is not within `timeout`.
async fn ready_within(client: &BootstrapClient, timeout: Duration) -> PyResult<ReadyStatus> {
    let status = client
        .wait_ready(timeout)
        .await
        .map_err(|err| to_py(&err))?;
    if status.status == "ready" {
        return Ok(status);
    }
    let expected = status.expected.map_or("?".to_owned(), |n| n.to_string());
    Err(Timeout::new_err(format!(
        "{} is not ready after {timeout:?}: {} of {expected} ranks registered",
        client.url(),
        status.registered
    )))
}

/// One call of the Rust client, made from a clone of it (so the future owns what it needs).
macro_rules! call {
    ($self:ident, |$client:ident| $body:expr) => {{
        let $client = $self.client()?;
        async move { $body }
    }};
}

#[pymethods]
impl PyBootstrapClient {
    #[new]
    #[pyo3(signature = (url, *, token=None, connect_timeout=3.0, request_timeout=5.0,
                        register_deadline=600.0, call_deadline=30.0, ca_file=None,
                        cert_file=None, key_file=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        url: &str,
        token: Option<String>,
        connect_timeout: f64,
        request_timeout: f64,
        register_deadline: f64,
        call_deadline: f64,
        ca_file: Option<PathBuf>,
        cert_file: Option<PathBuf>,
        key_file: Option<PathBuf>,
    ) -> PyResult<Self> {
        let tls = ClientTls::load(
            ca_file.as_deref(),
            cert_file.as_deref(),
            key_file.as_deref(),
        )
        .map_err(|err| InvalidInput::new_err(err.to_string()))?;
        let mut builder = BootstrapClient::builder(url)
            .tls(tls)
            .connect_timeout(seconds("connect_timeout", connect_timeout)?)
            .request_timeout(seconds("request_timeout", request_timeout)?)
            .register_deadline(seconds("register_deadline", register_deadline)?)
            .call_deadline(seconds("call_deadline", call_deadline)?);
        if let Some(token) = token {
            builder = builder.token(token);
        }
        let inner = builder.build().map_err(|err| to_py(&err))?;
        Ok(PyBootstrapClient {
            inner,
            pid: std::process::id(),
        })
    }

    /// The server's base URL.
    #[getter]
    fn url(&self) -> &str {
        self.inner.url()
    }

    fn __repr__(&self) -> String {
        format!("BootstrapClient({:?})", self.inner.url())
    }

    /// Registers one P worker (`POST /register`, vLLM's dialect with pd-bootstrap's optional
    /// fields): retried until the register deadline; a refusal raises `Rejected` at once.
    #[pyo3(signature = (engine_id, dp_rank, tp_rank, pp_rank, addr, *, replace=None, lease_ttl=None, meta=None))]
    #[allow(clippy::too_many_arguments)]
    fn register(
        &self,
        py: Python<'_>,
        engine_id: String,
        dp_rank: Rank,
        tp_rank: Rank,
        pp_rank: Rank,
        addr: String,
        replace: Option<bool>,
        lease_ttl: Option<u32>,
        meta: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let worker = Self::worker(
            engine_id, dp_rank, tp_rank, pp_rank, addr, replace, lease_ttl, meta,
        )?;
        let answer = block(py, call!(self, |c| c.register_worker(&worker).await))?;
        Ok(pythonize::pythonize(py, &answer)?.unbind())
    }

    /// `register`, awaitable.
    #[pyo3(signature = (engine_id, dp_rank, tp_rank, pp_rank, addr, *, replace=None, lease_ttl=None, meta=None))]
    #[allow(clippy::too_many_arguments)]
    fn aregister<'py>(
        &self,
        py: Python<'py>,
        engine_id: String,
        dp_rank: Rank,
        tp_rank: Rank,
        pp_rank: Rank,
        addr: String,
        replace: Option<bool>,
        lease_ttl: Option<u32>,
        meta: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let worker = Self::worker(
            engine_id, dp_rank, tp_rank, pp_rank, addr, replace, lease_ttl, meta,
        )?;
        awaitable(
            py,
            call!(self, |c| c.register_worker(&worker).await.map(Wire)),
        )
    }

    /// Registers one P worker under a lease of `ttl` seconds kept alive in the background;
    /// returns the `Lease` (a context manager that releases it). If this process dies, the
    /// registration leaves the registry one ttl after the last keepalive.
    #[pyo3(signature = (engine_id, dp_rank, tp_rank, pp_rank, addr, ttl, *, replace=None, meta=None))]
    #[allow(clippy::too_many_arguments)]
    fn register_leased(
        &self,
        py: Python<'_>,
        engine_id: String,
        dp_rank: Rank,
        tp_rank: Rank,
        pp_rank: Rank,
        addr: String,
        ttl: u32,
        replace: Option<bool>,
        meta: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Lease> {
        let worker = Self::worker(
            engine_id, dp_rank, tp_rank, pp_rank, addr, replace, None, meta,
        )?;
        block(py, self.leased(worker, ttl)?)
    }

    /// `register_leased`, awaitable.
    #[pyo3(signature = (engine_id, dp_rank, tp_rank, pp_rank, addr, ttl, *, replace=None, meta=None))]
    #[allow(clippy::too_many_arguments)]
    fn aregister_leased<'py>(
        &self,
        py: Python<'py>,
        engine_id: String,
        dp_rank: Rank,
        tp_rank: Rank,
        pp_rank: Rank,
        addr: String,
        ttl: u32,
        replace: Option<bool>,
        meta: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let worker = Self::worker(
            engine_id, dp_rank, tp_rank, pp_rank, addr, replace, None, meta,
        )?;
        awaitable(py, self.leased(worker, ttl)?)
    }

    /// Removes an engine's registrations (`DELETE /register`), narrowed by the ranks given;
    /// returns how many were removed.
    #[pyo3(signature = (engine_id, *, dp_rank=None, tp_rank=None, pp_rank=None))]
    fn deregister(
        &self,
        py: Python<'_>,
        engine_id: String,
        dp_rank: Option<Rank>,
        tp_rank: Option<Rank>,
        pp_rank: Option<Rank>,
    ) -> PyResult<usize> {
        let selection = Deregister {
            engine_id,
            dp_rank,
            tp_rank,
            pp_rank,
        };
        block(py, call!(self, |c| c.deregister(&selection).await))
    }

    /// `deregister`, awaitable.
    #[pyo3(signature = (engine_id, *, dp_rank=None, tp_rank=None, pp_rank=None))]
    fn aderegister<'py>(
        &self,
        py: Python<'py>,
        engine_id: String,
        dp_rank: Option<Rank>,
        tp_rank: Option<Rank>,
        pp_rank: Option<Rank>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let selection = Deregister {
            engine_id,
            dp_rank,
            tp_rank,
            pp_rank,
        };
        awaitable(py, call!(self, |c| c.deregister(&selection).await))
    }

    /// Marks an engine draining (routers following the registry's watch send it no new
    /// requests) or, with `draining=False`, lifts the mark; returns how many workers the engine
    /// has. An unknown engine raises `NotFound`.
    #[pyo3(signature = (engine_id, draining=true))]
    fn drain(&self, py: Python<'_>, engine_id: String, draining: bool) -> PyResult<usize> {
        block(py, call!(self, |c| c.drain(&engine_id, draining).await))
    }

    /// `drain`, awaitable.
    #[pyo3(signature = (engine_id, draining=true))]
    fn adrain<'py>(
        &self,
        py: Python<'py>,
        engine_id: String,
        draining: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, call!(self, |c| c.drain(&engine_id, draining).await))
    }

    /// One engine as vLLM's D reads it (`GET /query?engine_id=`): `{engine_id: {"engine_id",
    /// "dp_rank_to_tp_addrs" ...}}`; one attempt. An incomplete topology raises `Unavailable`.
    fn query(&self, py: Python<'_>, engine_id: String) -> PyResult<Py<PyAny>> {
        let topology = block(py, call!(self, |c| c.topology(Some(&engine_id)).await))?;
        Ok(pythonize::pythonize(py, &topology)?.unbind())
    }

    /// `query`, awaitable.
    fn aquery<'py>(&self, py: Python<'py>, engine_id: String) -> PyResult<Bound<'py, PyAny>> {
        awaitable(
            py,
            call!(self, |c| c.topology(Some(&engine_id)).await.map(Wire)),
        )
    }

    /// Every engine (`GET /query`); one attempt.
    fn topology(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let topology = block(py, call!(self, |c| c.topology(None).await))?;
        Ok(pythonize::pythonize(py, &topology)?.unbind())
    }

    /// `topology`, awaitable.
    fn atopology<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, call!(self, |c| c.topology(None).await.map(Wire)))
    }

    /// Every registered worker with its lease and incarnation (`GET /workers`):
    /// `{"revision", "workers": [...]}`.
    fn workers(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let list = block(py, call!(self, |c| c.workers().await))?;
        Ok(pythonize::pythonize(py, &list)?.unbind())
    }

    /// `workers`, awaitable.
    fn aworkers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        awaitable(py, call!(self, |c| c.workers().await.map(Wire)))
    }

    /// Waits until every expected rank has registered (`GET /ready` polled), at most `timeout`
    /// seconds; returns the readiness `{"status": "ready", "registered", "expected", "missing"}`,
    /// or raises `Timeout` if the topology is still incomplete then.
    fn wait_ready(&self, py: Python<'_>, timeout: f64) -> PyResult<Py<PyAny>> {
        let timeout = seconds("timeout", timeout)?;
        let status = block(py, call!(self, |c| ready_within(&c, timeout).await))?;
        Ok(pythonize::pythonize(py, &status)?.unbind())
    }

    /// `wait_ready`, awaitable.
    fn await_ready<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Bound<'py, PyAny>> {
        let timeout = seconds("timeout", timeout)?;
        awaitable(
            py,
            call!(self, |c| ready_within(&c, timeout).await.map(Wire)),
        )
    }

    /// P side of the request-keyed API: the dp rank holding a request's KV
    /// (`POST /register_request`), retried until the call deadline.
    fn register_request(&self, py: Python<'_>, req_id: String, dp_rank: Rank) -> PyResult<()> {
        block(
            py,
            call!(self, |c| c.register_request(&req_id, dp_rank).await),
        )
    }

    /// Forgets a request id (`DELETE /requests/{id}`); returns whether it was live.
    fn release_request(&self, py: Python<'_>, req_id: String) -> PyResult<bool> {
        block(py, call!(self, |c| c.release_request(&req_id).await))
    }

    /// The registry's changes from `since` (a revision; default: a snapshot first) as an
    /// iterator and async iterator of `{"kind": "snapshot", "revision", "workers"}` and
    /// `{"kind": "events", "revision", "events"}` dicts. Transient failures are retried inside.
    #[pyo3(signature = (since=None))]
    fn watch(&self, since: Option<u64>) -> PyResult<Watch> {
        Ok(Watch::new(self.client()?, since))
    }

    /// SGLang: registers one prefill rank's row (`PUT /route`, a dict of SGLang's fields),
    /// retried like `register`.
    fn register_route(&self, py: Python<'_>, row: &Bound<'_, PyAny>) -> PyResult<()> {
        let row: RouteRow = pythonize::depythonize(row)
            .map_err(|err| InvalidInput::new_err(format!("row: {err}")))?;
        block(py, call!(self, |c| c.register_route(&row).await))
    }

    /// SGLang: the prefill deployment's topology (`GET /route` with every rank -1); raises
    /// `Unavailable` until every rank has registered.
    fn sglang_topology(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let topology = block(py, call!(self, |c| c.sglang_topology().await))?;
        Ok(pythonize::pythonize(py, &topology)?.unbind())
    }

    /// SGLang: where one prefill rank serves its KV: `{"rank_ip", "rank_port"}`.
    #[pyo3(signature = (dp, tp, *, cp=0, pp=0))]
    fn sglang_rank(
        &self,
        py: Python<'_>,
        dp: Rank,
        tp: Rank,
        cp: Rank,
        pp: Rank,
    ) -> PyResult<Py<PyAny>> {
        let rank = PrefillRank { dp, cp, tp, pp };
        let info = block(py, call!(self, |c| c.sglang_rank(rank).await))?;
        Ok(pythonize::pythonize(py, &info)?.unbind())
    }

    /// SGLang: which prefill dp rank serves a bootstrap room (`POST /register_dp_rank`).
    fn register_dp_rank(&self, py: Python<'_>, bootstrap_room: u64, dp_rank: Rank) -> PyResult<()> {
        block(
            py,
            call!(self, |c| c.register_dp_rank(bootstrap_room, dp_rank).await),
        )
    }

    /// SGLang: the dp rank of each room the server knows (`POST /query_dp_ranks`).
    fn query_dp_ranks(
        &self,
        py: Python<'_>,
        bootstrap_rooms: Vec<u64>,
    ) -> PyResult<BTreeMap<u64, Rank>> {
        block(
            py,
            call!(self, |c| c.query_dp_ranks(&bootstrap_rooms).await),
        )
    }
}
