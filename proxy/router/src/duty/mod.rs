//! Engines that serve both roles (`--dual`: vLLM with `"kv_role": "kv_both"`, each with its
//! bootstrap server): one pool whose engines are each on prefill or on decode duty at a time,
//! the split between the two following the capacity planner at run time. An engine's duty is
//! which of its two [`Backend`]s (its prefill's and its decode's) takes new requests: a request's
//! P and D are then never the same engine, and a change applies to new requests while the
//! answers in flight finish. Before an engine takes its new duty, the transfer paths of its new
//! direction are warmed up ([`warmup`]), so that no client pays their first use.

mod assign;
mod live;
pub mod settings;
mod split;
mod warmup;

use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::backend::{Backend, Prefill};
use crate::sync::lock;

pub use assign::{AssignError, DutiesRequest};
pub use live::{DualSnapshot, DutyController};
pub use settings::DutyConfig;
pub use split::{dual_prefills, step_toward, Needs};

/// The duty an engine of both roles serves now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Duty {
    /// It computes prompts' KV for decodes to pull.
    Prefill,
    /// It pulls prompts' KV from prefills and generates the answers.
    Decode,
}

impl Duty {
    /// Its metric label value and log word.
    pub fn as_str(self) -> &'static str {
        match self {
            Duty::Prefill => "prefill",
            Duty::Decode => "decode",
        }
    }
}

/// One engine that serves both roles: its prefill (with its bootstrap server) and its decode,
/// both in the pool, one of them on duty.
pub struct Dual {
    /// The engine as a prefill.
    pub prefill: Arc<Prefill>,
    /// The engine as a decode.
    pub decode: Arc<Backend>,
    state: Mutex<(Duty, Instant)>,
}

impl Dual {
    /// The engine of `prefill` and `decode` (one server), on `duty`.
    pub fn new(prefill: Arc<Prefill>, decode: Arc<Backend>, duty: Duty) -> Self {
        let dual = Dual {
            prefill,
            decode,
            state: Mutex::new((duty, Instant::now())),
        };
        dual.apply(duty);
        dual
    }

    /// Its base URL.
    pub fn url(&self) -> &str {
        self.decode.url()
    }

    /// Its duty now, and since when.
    pub fn duty(&self) -> (Duty, Instant) {
        *lock(&self.state)
    }

    /// Puts it on `duty` from now on (new requests; those in flight finish).
    pub fn set_duty(&self, duty: Duty) {
        *lock(&self.state) = (duty, Instant::now());
        self.apply(duty);
    }

    fn apply(&self, duty: Duty) {
        self.prefill.backend.set_on_duty(duty == Duty::Prefill);
        self.decode.set_on_duty(duty == Duty::Decode);
    }

    /// Whether it serves `model` (when known) and is healthy in both roles' checks.
    pub fn serves(&self, model: Option<&str>) -> bool {
        let usable = |b: &Backend| b.is_healthy() && !b.is_drained() && b.serves(model);
        usable(&self.prefill.backend) && usable(&self.decode)
    }

    /// The model it serves (its first card's), once known: what its warm-ups ask for.
    pub fn model(&self) -> Option<String> {
        let cards = self.decode.models()?;
        cards.first().map(|card| card.id.clone())
    }

    /// Calls in flight through this proxy on it in the role of `duty` (a prefill's counted on
    /// its dp ranks).
    pub fn outstanding(&self, duty: Duty) -> usize {
        match duty {
            Duty::Prefill => (self.prefill.pairs().iter())
                .map(|pair| pair.outstanding())
                .sum(),
            Duty::Decode => self.decode.outstanding(),
        }
    }
}
