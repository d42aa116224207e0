//! `pd_bootstrap._native`: the worker client as a Python extension module. The Python package
//! `pd_bootstrap` re-exports it; `python/pd_bootstrap/_native.pyi` types it.
//!
//! - [`client`]: `BootstrapClient`, every call blocking (GIL released) and awaitable.
//! - [`lease`]: `Lease`, a registration kept alive on the runtime's threads.
//! - [`watch`]: `Watch`, the registry's changes as an (async) iterator.
//! - [`directory`]: `EngineDirectory`, D's cached lookups, with `submit_lookup` / `poll` for
//!   scheduler loops that must never wait.
//! - [`errors`]: one exception class per kind of failure.
//! - [`runtime`]: the Tokio runtime (two threads, created at first use) and how Python waits.

mod client;
mod directory;
mod errors;
mod lease;
mod runtime;
mod watch;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    runtime::configure();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<client::PyBootstrapClient>()?;
    m.add_class::<lease::Lease>()?;
    m.add_class::<watch::Watch>()?;
    m.add_class::<directory::PyEngineDirectory>()?;
    m.add_class::<directory::PyEngineInfo>()?;
    m.add_class::<directory::LookupHandle>()?;
    errors::register(m)?;
    Ok(())
}
