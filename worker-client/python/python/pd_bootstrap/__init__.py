"""pd-bootstrap's worker client for vLLM and SGLang P/D workers.

The client side of a pd-bootstrap server, from Python: registration with bounded retries,
leases kept alive in the background, the registry's watch, and D's cached lookups, blocking
(the GIL released while waiting) or as asyncio awaitables, plus ``submit_lookup``/``poll`` for
scheduler loops that must never wait on the network. Built from the Rust ``worker-client``
crate; see docs/python.md.
"""

from ._native import (
    BootstrapClient,
    EngineDirectory,
    EngineInfo,
    ForkError,
    Incompatible,
    InvalidInput,
    Lease,
    LookupHandle,
    NotFound,
    PdBootstrapError,
    ProtocolError,
    Rejected,
    Timeout,
    Unauthorized,
    Unavailable,
    Watch,
    __version__,
)

__all__ = [
    "BootstrapClient",
    "EngineDirectory",
    "EngineInfo",
    "ForkError",
    "Incompatible",
    "InvalidInput",
    "Lease",
    "LookupHandle",
    "NotFound",
    "PdBootstrapError",
    "ProtocolError",
    "Rejected",
    "Timeout",
    "Unauthorized",
    "Unavailable",
    "Watch",
    "__version__",
]
