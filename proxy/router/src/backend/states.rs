//! The fleet's state as the operators' API shows it (`GET /admin/backends`, the live pages,
//! `POST /admin/drain`'s answer): each backend's health, drain marks and calls in flight, a
//! prefill's with its dp ranks.

use pd_protocol::proxy_admin::{BackendState, RankState};

use super::{Backend, Pool, Prefill};

/// A backend's state, with its dp ranks if it is a prefill.
pub fn state_of(backend: &Backend, dp_ranks: Vec<RankState>, leaving: bool) -> BackendState {
    let in_flight = backend.outstanding();
    BackendState {
        role: backend.role().as_str().to_owned(),
        url: backend.url().to_owned(),
        healthy: backend.is_healthy(),
        drained: backend.is_drained(),
        in_flight,
        idle: in_flight == 0,
        leaving,
        dp_ranks,
        version: backend.version().map(|v| v.to_string()),
    }
}

/// A prefill's state; the dp ranks of one `leaving` the pool take no new requests either.
fn prefill_state(prefill: &Prefill, leaving: bool) -> BackendState {
    let ranks = (prefill.pairs().iter())
        .map(|pair| RankState {
            dp_rank: pair.dp_rank,
            engine_id: pair.engine_id.as_deref().map(str::to_owned),
            draining: leaving || pair.is_draining(),
            in_flight: pair.outstanding(),
        })
        .collect();
    state_of(&prefill.backend, ranks, leaving)
}

/// Every backend's state, the pool's then those that left it with calls in flight, each
/// passed with its backend through `view`: (prefills, decodes). What `GET /admin/backends`
/// answers and the live page shows.
pub fn states<T>(pool: &Pool, view: impl Fn(&Backend, BackendState) -> T) -> (Vec<T>, Vec<T>) {
    let departed = pool.departed();
    let prefills = (pool.prefills().iter().map(|p| (p, false)))
        .chain(departed.prefills.iter().map(|p| (p, true)))
        .map(|(p, leaving)| view(&p.backend, prefill_state(p, leaving)))
        .collect();
    let decodes = (pool.decodes().iter().map(|d| (d, false)))
        .chain(departed.decodes.iter().map(|d| (d, true)))
        .map(|(d, leaving)| view(d, state_of(d, Vec::new(), leaving)))
        .collect();
    (prefills, decodes)
}

/// The backend configured at `url` (a trailing slash ignored), prefill or decode.
pub fn find(pool: &Pool, url: &str) -> Option<std::sync::Arc<Backend>> {
    let url = url.trim_end_matches('/');
    pool.backends()
        .into_iter()
        .find(|backend| backend.url() == url)
}
