//! An operator's duties (`POST /admin/duties`): the engines named take the duties given, all
//! at once, once every path each one uses in its new duty (in the new split) is warmed up; the
//! planner's own moves then wait a `--duty-dwell`. Refused, with nothing changed, when an engine
//! is not one of both roles, when a duty would be left with no engine, or when a warm-up fails.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use super::live::{DualSnapshot, DutyController};
use super::{warmup, Dual, Duty};
use crate::sync::lock;

/// Why an operator's duties were refused.
#[derive(Debug, thiserror::Error)]
pub enum AssignError {
    /// A URL that is no engine of both roles.
    #[error("`duties`: {0:?} is not an engine of both roles (--dual): see GET /ui/state's duals")]
    NotDual(String),
    /// No engine would be left on a duty.
    #[error("`duties`: no engine would be left on {0} duty (each duty keeps one at least)")]
    Empty(&'static str),
    /// A path of a new direction did not answer.
    #[error("the warm-up of a new direction failed, no duty changed: {0}")]
    WarmUp(String),
}

/// `POST /admin/duties`' body (pd-proxy, pd-epp): the engines of both roles to move, by URL.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DutiesRequest {
    /// Each engine's URL and the duty it takes (`prefill` or `decode`).
    pub duties: BTreeMap<String, Duty>,
}

impl AssignError {
    /// The HTTP status a front door answers it with.
    pub fn status(&self) -> http::StatusCode {
        match self {
            AssignError::NotDual(_) => http::StatusCode::NOT_FOUND,
            AssignError::Empty(_) => http::StatusCode::CONFLICT,
            AssignError::WarmUp(_) => http::StatusCode::BAD_GATEWAY,
        }
    }
}

impl DutyController {
    /// Puts each engine of `wanted` (its URL) on its duty; the others keep theirs. Answers the
    /// duals as they then are.
    pub async fn assign(
        &self,
        wanted: &BTreeMap<String, Duty>,
    ) -> Result<Vec<DualSnapshot>, AssignError> {
        let _changing = self.changing().lock().await;
        let duals = self.pool().duals();
        // By address: each dual is one allocation, alive in the pool for the proxy's life.
        let mut next: HashMap<usize, Duty> = HashMap::new();
        for (url, duty) in wanted {
            let url = url.trim_end_matches('/');
            let dual = (duals.iter().find(|d| d.url() == url))
                .ok_or_else(|| AssignError::NotDual(url.to_owned()))?;
            next.insert(Arc::as_ptr(dual) as usize, *duty);
        }
        let duty_of = |d: &Dual| {
            let at = d as *const Dual as usize;
            next.get(&at).copied().unwrap_or(d.duty().0)
        };
        let pool = self.pool();
        for duty in [Duty::Prefill, Duty::Decode] {
            let fixed = match duty {
                Duty::Prefill => (pool.prefills().iter())
                    .any(|p| !pool.is_dual(&p.backend) && p.backend.takes_requests(None)),
                Duty::Decode => {
                    (pool.decodes().iter()).any(|d| !pool.is_dual(d) && d.takes_requests(None))
                }
            };
            if !fixed && !duals.iter().any(|d| duty_of(d) == duty) {
                return Err(AssignError::Empty(duty.as_str()));
            }
        }
        let moving: Vec<&Arc<Dual>> = (duals.iter())
            .filter(|d| duty_of(d) != d.duty().0)
            .collect();
        for dual in &moving {
            let model = dual.model();
            let to = duty_of(dual);
            let paths = warmup::paths(pool, dual, to, model.as_deref(), &duty_of);
            (self.warm(&paths, model.as_deref()).await).map_err(AssignError::WarmUp)?;
        }
        for dual in moving {
            let (from, to) = (dual.duty().0, duty_of(dual));
            dual.set_duty(to);
            self.changed(dual.model().as_deref().unwrap_or(""), to);
            tracing::info!(
                engine = dual.url(),
                from = from.as_str(),
                to = to.as_str(),
                by = "operator",
                "engine duty changed"
            );
        }
        *lock(self.operator_changed()) = Some(Instant::now());
        Ok(self.snapshot())
    }
}
