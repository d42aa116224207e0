"""Types of the native module (the Rust worker client). Re-exported by ``pd_bootstrap``."""

import os
from types import TracebackType
from typing import Any, Awaitable, Dict, List, Mapping, Optional, Sequence, Type, Union

__version__: str

Json = Dict[str, Any]
"""A wire answer as plain Python objects, shaped as docs/protocol.md shows its JSON."""

class PdBootstrapError(Exception):
    """Base of every error pd_bootstrap raises."""

    url: Optional[str]
    """The server called, if any."""
    status: Optional[int]
    """Its HTTP status, if it answered."""
    detail: Optional[str]
    """Its message, if it answered with one."""
    retryable: bool
    """Whether trying again later can succeed."""

class Unavailable(PdBootstrapError):
    """Unreachable, or answered 5xx/503/408/429: retryable."""

class Timeout(PdBootstrapError):
    """No answer in time, or retries ran out of their deadline."""

class Rejected(PdBootstrapError):
    """Refused (4xx): not retryable as is."""

class Unauthorized(Rejected):
    """Refused for its credentials (401) or origin (403)."""

class NotFound(PdBootstrapError):
    """Not registered (an unknown engine id, or a 404)."""

class Incompatible(PdBootstrapError):
    """A remote engine's registered layout differs from this D's."""

    field: str
    local: str
    remote: str

class InvalidInput(PdBootstrapError):
    """An argument cannot be sent as given; nothing was sent."""

class ProtocolError(PdBootstrapError):
    """The server's answer was not what the protocol says."""

class ForkError(PdBootstrapError):
    """Used in a child forked after the parent used the binding (or made this object)."""

class BootstrapClient:
    """A client of one bootstrap server; every call bounded by a timeout or deadline."""

    def __init__(
        self,
        url: str,
        *,
        token: Optional[str] = None,
        connect_timeout: float = 3.0,
        request_timeout: float = 5.0,
        register_deadline: float = 600.0,
        call_deadline: float = 30.0,
        ca_file: Optional[Union[str, "os.PathLike[str]"]] = None,
        cert_file: Optional[Union[str, "os.PathLike[str]"]] = None,
        key_file: Optional[Union[str, "os.PathLike[str]"]] = None,
    ) -> None:
        """``ca_file``: CA certificates (PEM) trusted for an ``https://`` server, beside the
        system's; ``cert_file`` and ``key_file``: the client certificate a server with
        ``--tls-client-ca`` lets writers in by. An unusable file raises ``InvalidInput``
        naming it."""
    @property
    def url(self) -> str: ...
    def register(
        self,
        engine_id: str,
        dp_rank: int,
        tp_rank: int,
        pp_rank: int,
        addr: str,
        *,
        replace: Optional[bool] = None,
        lease_ttl: Optional[int] = None,
        meta: Optional[Mapping[str, Any]] = None,
    ) -> Json:
        """Registers one P worker (``POST /register``); retried until the register deadline."""
    def aregister(
        self,
        engine_id: str,
        dp_rank: int,
        tp_rank: int,
        pp_rank: int,
        addr: str,
        *,
        replace: Optional[bool] = None,
        lease_ttl: Optional[int] = None,
        meta: Optional[Mapping[str, Any]] = None,
    ) -> Awaitable[Json]: ...
    def register_leased(
        self,
        engine_id: str,
        dp_rank: int,
        tp_rank: int,
        pp_rank: int,
        addr: str,
        ttl: int,
        *,
        replace: Optional[bool] = None,
        meta: Optional[Mapping[str, Any]] = None,
    ) -> "Lease":
        """Registers under a lease of ``ttl`` seconds kept alive in the background."""
    def aregister_leased(
        self,
        engine_id: str,
        dp_rank: int,
        tp_rank: int,
        pp_rank: int,
        addr: str,
        ttl: int,
        *,
        replace: Optional[bool] = None,
        meta: Optional[Mapping[str, Any]] = None,
    ) -> Awaitable["Lease"]: ...
    def deregister(
        self,
        engine_id: str,
        *,
        dp_rank: Optional[int] = None,
        tp_rank: Optional[int] = None,
        pp_rank: Optional[int] = None,
    ) -> int:
        """Removes an engine's registrations; returns how many."""
    def aderegister(
        self,
        engine_id: str,
        *,
        dp_rank: Optional[int] = None,
        tp_rank: Optional[int] = None,
        pp_rank: Optional[int] = None,
    ) -> Awaitable[int]: ...
    def drain(self, engine_id: str, draining: bool = True) -> int:
        """Marks an engine draining (routers send it no new requests), or lifts the mark."""
    def adrain(self, engine_id: str, draining: bool = True) -> Awaitable[int]: ...
    def query(self, engine_id: str) -> Json:
        """One engine as vLLM's D reads it (``GET /query?engine_id=``)."""
    def aquery(self, engine_id: str) -> Awaitable[Json]: ...
    def topology(self) -> Json:
        """Every engine (``GET /query``)."""
    def atopology(self) -> Awaitable[Json]: ...
    def workers(self) -> Json:
        """Every worker with lease and incarnation (``GET /workers``)."""
    def aworkers(self) -> Awaitable[Json]: ...
    def wait_ready(self, timeout: float) -> Json:
        """Waits up to ``timeout`` seconds until every expected rank registered."""
    def await_ready(self, timeout: float) -> Awaitable[Json]: ...
    def register_request(self, req_id: str, dp_rank: int) -> None: ...
    def release_request(self, req_id: str) -> bool: ...
    def watch(self, since: Optional[int] = None) -> "Watch":
        """The registry's changes as an iterator and async iterator."""
    def register_route(self, row: Mapping[str, Any]) -> None:
        """SGLang: one prefill rank's row (``PUT /route``)."""
    def sglang_topology(self) -> Json:
        """SGLang: the prefill deployment's topology."""
    def sglang_rank(self, dp: int, tp: int, *, cp: int = 0, pp: int = 0) -> Json:
        """SGLang: ``{"rank_ip", "rank_port"}`` of one prefill rank."""
    def register_dp_rank(self, bootstrap_room: int, dp_rank: int) -> None: ...
    def query_dp_ranks(self, bootstrap_rooms: Sequence[int]) -> Dict[int, int]: ...

class Lease:
    """A registration kept alive under a lease; a (async) context manager that releases it."""

    @property
    def lease_id(self) -> Optional[int]: ...
    @property
    def state(self) -> str:
        """``"alive"``, ``"lost"``, ``"failed"`` or ``"released"``."""
    @property
    def alive(self) -> bool: ...
    def release(self) -> bool:
        """Revokes the lease; returns whether it was live."""
    def arelease(self) -> Awaitable[bool]: ...
    def __enter__(self) -> "Lease": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> bool: ...
    async def __aenter__(self) -> "Lease": ...
    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> bool: ...

class Watch:
    """Snapshots and event batches: ``{"kind": "snapshot"|"events", "revision", ...}``."""

    def __iter__(self) -> "Watch": ...
    def __next__(self) -> Json: ...
    def __aiter__(self) -> "Watch": ...
    def __anext__(self) -> Awaitable[Json]: ...

class EngineInfo:
    """One remote engine."""

    @property
    def engine_id(self) -> str: ...
    @property
    def incarnation(self) -> Optional[int]: ...
    @property
    def dp_ranks(self) -> Dict[int, Dict[int, Dict[int, str]]]:
        """dp rank -> tp rank -> pp rank -> transfer address."""
    @property
    def meta(self) -> Json: ...
    @property
    def tp_size(self) -> int: ...
    def worker(self, dp_rank: int, tp_rank: int) -> Optional[List[str]]:
        """The addresses (in pp order) of worker (dp_rank, tp_rank)."""

class LookupHandle:
    """A lookup submitted with ``EngineDirectory.submit_lookup``."""

    def done(self) -> bool: ...

class EngineDirectory:
    """D's cached, single-flight, incarnation-aware lookups."""

    def __init__(
        self, client: BootstrapClient, *, meta: Optional[Mapping[str, Any]] = None
    ) -> None: ...
    def engine(self, bootstrap_addr: str, engine_id: str) -> EngineInfo: ...
    def aengine(self, bootstrap_addr: str, engine_id: str) -> Awaitable[EngineInfo]: ...
    def submit_lookup(
        self, bootstrap_addr: str, engine_id: str, *, timeout: float = 5.0
    ) -> LookupHandle:
        """Starts a lookup on the binding's threads; returns at once."""
    def poll(self, handle: LookupHandle) -> Optional[EngineInfo]:
        """The engine once found, None before; raises once failed. Never waits."""
    def poll_many(
        self, handles: Sequence[LookupHandle]
    ) -> List[Union[EngineInfo, PdBootstrapError, None]]: ...
    def invalidate(self, bootstrap_addr: str) -> None: ...
