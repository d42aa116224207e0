//! Is the engine D was told to pull from still registered? Asked when D fails before its first
//! byte, because vLLM 0.32's D says no more than "Internal server error" when it cannot find the
//! remote engine on the bootstrap server: the usual cause is a P restarted under a new engine
//! id that discovery has not learnt yet. The restarted P answered the request (it is the
//! process at the prefill's URL) and holds its KV under the request's transfer id, so D can be
//! asked again, once, with the engine id the registry lists now.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_protocol::vllm::Topology;

use crate::state::Shared;
use pd_router::backend::Pair;

/// The longest the registry is asked for (within the request's deadline).
const REGISTRY_TIMEOUT: Duration = Duration::from_secs(2);

/// The engine id the pair's bootstrap server lists for its dp rank now, when it is another
/// than the pair's (discovery is then woken to learn it too). `None` when it is the same, the
/// pair has no engine id or bootstrap server, or the registry cannot tell in time.
pub(super) async fn registered_instead(
    state: &Shared,
    pair: &Pair,
    deadline: Instant,
) -> Option<Arc<str>> {
    let (known, bootstrap) = (pair.engine_id.as_deref()?, pair.bootstrap_addr.as_deref()?);
    let timeout = deadline
        .saturating_duration_since(Instant::now())
        .min(REGISTRY_TIMEOUT);
    let answer = state
        .upstream
        .client
        .get(format!("{bootstrap}/query"))
        .timeout(timeout)
        .send()
        .await
        .ok()?;
    let topology: Topology = answer.error_for_status().ok()?.json().await.ok()?;
    let listed = topology
        .get(&pair.dp_rank)
        .and_then(|group| group.engine_id.as_deref());
    if listed == Some(known) {
        return None;
    }
    tracing::info!(
        prefill = pair.backend.url(),
        dp_rank = pair.dp_rank,
        known,
        listed,
        "the engine D was told to pull from is no longer registered; rediscovering"
    );
    if let Some(prefill) = state.pool().prefill_of(&pair.backend) {
        prefill.refresh.notify_one();
    }
    listed.map(Arc::from)
}
