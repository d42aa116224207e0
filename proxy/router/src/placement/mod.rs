//! Placing one request: a request's facts in ([`Facts`]), a [`Placement`] out (a decode, and a
//! (prefill, dp rank) pair unless the request goes to the decode alone, with the decision and
//! its reason), or why it cannot be placed ([`Unplaced`]). The front doors word the refusals in
//! their own protocol (pd-proxy: OpenAI's error bodies; pd-epp: Envoy's immediate responses).
//!
//! In order: the decode-only rules that need no prefill (a short prompt, a prefix a decode
//! holds); a missing LoRA adapter loaded where the request needs it (`--lora-load-on-demand`);
//! the prefill pick; the decision once it is known; the decode pick. A model nobody serves is
//! told from one whose engines are all down or drained.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use http::HeaderValue;

pub mod forecast;
mod targets;

pub use forecast::{Forecast, Watch};

use crate::admission::RequestClass;
use crate::backend::{Backend, Pair};
use crate::models::lora::AdapterLoader;
use crate::routing::decision::{self, Decision, Path, Reason};
use crate::routing::RequestInfo;
use crate::Router;

/// What placement reads of a request.
pub struct Facts<'a> {
    /// The request: its body, headers and, when a policy needs them, its prompt's tokens.
    pub request: &'a RequestInfo<'a>,
    /// The model it asks for (after aliases), if any.
    pub model: Option<&'a str>,
    /// The client's `Authorization`, passed on to an adapter load.
    pub authorization: Option<&'a HeaderValue>,
    /// When the whole request must be over (bounds an adapter load).
    pub deadline: Instant,
    /// The decodes the request may go to, when it is limited to some (an endpoint picker's
    /// subset hint); `None`: any.
    pub decodes: Option<&'a (dyn Fn(&Backend) -> bool + Sync)>,
    /// Its priority, tenant and latency targets.
    pub class: &'a RequestClass,
}

/// Where a request goes.
pub struct Placement {
    /// Through P and D, or to D alone, and why.
    pub decision: Decision,
    /// The (prefill, dp rank) pair, unless the request goes to the decode alone.
    pub prefill: Option<Arc<Pair>>,
    /// The decode.
    pub decode: Arc<Backend>,
    /// Its predicted latencies there, for its answer to check and teach.
    pub forecast: Forecast,
}

/// Which side of the fleet could not take a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The prefills.
    Prefill,
    /// The decodes.
    Decode,
}

impl Side {
    /// `prefill` or `decode`.
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        }
    }
}

/// Why a request cannot be placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unplaceable {
    /// No (prefill, dp rank) pair can take it; `none_known`: none was ever discovered.
    NoPrefill {
        /// No pair is known at all (nothing discovered yet).
        none_known: bool,
    },
    /// No healthy decode can take it.
    NoDecode,
    /// The model is served here, but none of its `side` engines can take a request now.
    ModelUnavailable {
        /// The model.
        model: String,
        /// The side that cannot.
        side: Side,
    },
    /// No engine serves the model (every engine's models are known).
    ModelNotFound {
        /// The model.
        model: String,
        /// What is served.
        served: BTreeSet<String>,
    },
    /// The prefill picked serves a model no healthy decode serves: P and D of different
    /// models are never paired.
    ModelMismatch {
        /// The prefill's model.
        model: String,
        /// The prefill's URL.
        prefill: String,
        /// Its dp rank.
        dp_rank: u32,
    },
    /// The prefill a gateway named is not one of the fleet's (a sidecar is no open relay).
    NotInFleet {
        /// The `host:port` named.
        address: String,
    },
    /// The adapter could not be loaded on a ready prefill and decode.
    AdapterNotLoaded {
        /// The adapter.
        model: String,
        /// What failed.
        reason: String,
    },
    /// The request is sheddable and no engine is predicted to meet its latency targets.
    TargetsUnmet,
}

/// A request that cannot be placed: why, and the decision made before that was known (none when
/// it failed before the decision, on its model).
#[derive(Debug, Clone)]
pub struct Unplaced {
    /// The decision, when one was made.
    pub decision: Option<Decision>,
    /// Why.
    pub why: Unplaceable,
}

impl From<Unplaceable> for Unplaced {
    fn from(why: Unplaceable) -> Self {
        Unplaced {
            decision: None,
            why,
        }
    }
}

impl Router {
    /// Places the request of `facts`.
    pub async fn place(&self, facts: &Facts<'_>) -> Result<Placement, Unplaced> {
        let (request, model) = (facts.request, facts.model);
        let pairs = self.pool.pairs();
        let early = match self.is_aggregated() {
            true => Some(Decision::AGGREGATED),
            false => decision::before_pick(self.decode_only(), request, || {
                self.decode_share(model, request)
            }),
        };
        let pair = match (early, model) {
            (Some(_), _) => None,
            (None, None) => self.pair_with_targets(&pairs, None, facts),
            (None, Some(model)) => {
                self.load_if_missing(&pairs, model, facts).await?;
                let pair = self.pair_with_targets(&pairs, Some(model), facts);
                if pair.is_none() {
                    self.check_served(&pairs, model)?;
                }
                pair
            }
        };
        let decision =
            early.unwrap_or_else(|| decision::after_pick(self.decode_only(), pair.is_some()));
        let decided = |why| Unplaced {
            decision: Some(decision),
            why,
        };
        match (decision.path, pair) {
            (Path::Disaggregated, Some(pair)) => {
                let decode = (self.decode_for(&pair, model, facts)).map_err(decided)?;
                self.placed(decision, Some(pair), decode, facts)
            }
            (Path::DecodeOnly, _) => {
                if decision.reason == Reason::NoPrefillHealthy {
                    tracing::warn!(
                        "no prefill can take the request: serving it on a decode alone \
                         (--fallback decode-only)"
                    );
                }
                let decode = (self.decode_with_targets(model, facts, true)).ok_or_else(|| {
                    decided(match model {
                        Some(model) => unavailable(model, Side::Decode),
                        None => Unplaceable::NoDecode,
                    })
                })?;
                self.placed(decision, None, decode, facts)
            }
            _ => Err(decided(match model {
                Some(model) => unavailable(model, Side::Prefill),
                None => Unplaceable::NoPrefill {
                    none_known: pairs.is_empty(),
                },
            })),
        }
    }

    /// Places a request whose path a gateway's endpoint picker chose (pd-proxy as a decode's
    /// sidecar): through the fleet's prefill at `named` (`host:port`, and its dp rank when
    /// given), or to a decode alone when it named none or the request asks for several samples.
    pub fn place_named(
        &self,
        facts: &Facts<'_>,
        named: Option<(&str, Option<u32>)>,
    ) -> Result<Placement, Unplaced> {
        let (request, model) = (facts.request, facts.model);
        // Several samples never go through P, whatever the picker named (see `before_pick`).
        let several = request.samples_several();
        let (Some((address, dp_rank)), false) = (named, several) else {
            let reason = match several {
                true => Reason::ParallelSampling,
                false => Reason::Gateway,
            };
            let decision = Decision::new(Path::DecodeOnly, reason);
            let decode = self.pick_decode(None, model, request).ok_or(Unplaced {
                decision: Some(decision),
                why: match model {
                    Some(model) => unavailable(model, Side::Decode),
                    None => Unplaceable::NoDecode,
                },
            })?;
            return self.placed(decision, None, decode, facts);
        };
        let decision = Decision::new(Path::Disaggregated, Reason::Gateway);
        let decided = |why| Unplaced {
            decision: Some(decision),
            why,
        };
        let pairs = self.pool.pairs();
        let named: Vec<&Arc<Pair>> = (pairs.iter())
            .filter(|pair| pair.backend.address() == address)
            .collect();
        if named.is_empty() {
            // A prefill of the fleet whose dp ranks are not discovered yet is not ready (503),
            // unlike an address that is no prefill of the fleet (403).
            let prefills = self.pool.prefills();
            let known = prefills.iter().any(|p| p.backend.address() == address);
            return Err(decided(match known {
                true => Unplaceable::NoPrefill { none_known: true },
                false => Unplaceable::NotInFleet {
                    address: address.to_owned(),
                },
            }));
        }
        let pair = (named.into_iter())
            .filter(|pair| dp_rank.is_none_or(|rank| pair.dp_rank == rank))
            .filter(|pair| pair.takes_requests() && pair.serves(model))
            .min_by_key(|pair| pair.load())
            .ok_or_else(|| {
                decided(match model {
                    Some(model) => unavailable(model, Side::Prefill),
                    None => Unplaceable::NoPrefill { none_known: false },
                })
            })?;
        let decode = (self.decode_for(pair, model, facts)).map_err(decided)?;
        self.placed(decision, Some(pair.clone()), decode, facts)
    }

    /// The placement on `prefill` (when through P) and `decode`, with its forecast; a
    /// sheddable request whose targets the forecast misses is refused (the candidates were
    /// chosen for the most headroom: none would meet them).
    fn placed(
        &self,
        decision: Decision,
        prefill: Option<Arc<Pair>>,
        decode: Arc<Backend>,
        facts: &Facts<'_>,
    ) -> Result<Placement, Unplaced> {
        self.versions.check(prefill.as_ref(), &decode);
        let targets = facts.class.targets;
        let mut forecast = self.forecast(facts.request, prefill.as_ref(), &decode, targets);
        if facts.class.sheddable() && forecast.misses_targets() {
            return Err(Unplaced {
                decision: Some(decision),
                why: Unplaceable::TargetsUnmet,
            });
        }
        if let Some(planner) = &self.planner {
            let request = facts.request;
            let prompt =
                (request.tokens()).map_or_else(|| request.prompt_tokens_estimate(), <[u32]>::len);
            let uncached = prefill.is_some().then(|| forecast.uncached_tokens());
            planner.arrived(facts.model, prompt, uncached);
            forecast.tell(planner.clone(), facts.model);
        }
        Ok(Placement {
            decision,
            prefill,
            decode,
            forecast,
        })
    }

    /// A healthy decode for the request's model (else `pair`'s), or why there is none: the
    /// model's decodes are all down or drained, or no decode serves it (a model mismatch).
    fn decode_for(
        &self,
        pair: &Pair,
        model: Option<&str>,
        facts: &Facts<'_>,
    ) -> Result<Arc<Backend>, Unplaceable> {
        let model = model.or(pair.model.as_deref());
        self.decode_with_targets(model, facts, false)
            .ok_or_else(|| {
                let decodes = &self.pool.decodes();
                if let Some(model) =
                    model.filter(|m| decodes.iter().any(|d| d.lists(m) == Some(true)))
                {
                    // Decodes of the model exist: they are down or drained.
                    return unavailable(model, Side::Decode);
                }
                let healthy = decodes.iter().any(|d| d.is_healthy());
                match model {
                    Some(model) if healthy => Unplaceable::ModelMismatch {
                        model: model.to_owned(),
                        prefill: pair.backend.url().to_owned(),
                        dp_rank: pair.dp_rank,
                    },
                    _ => Unplaceable::NoDecode,
                }
            })
    }

    /// When `model` is an adapter that may be loaded and no ready pair, or no ready decode,
    /// has loaded: loads it on the least loaded ready engine of its base model on each side that
    /// lacks it (both at once), so that the request then finds a pair and a decode that both have
    /// it. Nothing to do otherwise.
    async fn load_if_missing(
        &self,
        pairs: &[Arc<Pair>],
        model: &str,
        facts: &Facts<'_>,
    ) -> Result<(), Unplaceable> {
        if !self.config.models.load_on_demand {
            return Ok(());
        }
        let decodes = &self.pool.decodes();
        let ready = |backend: &Backend| backend.takes_requests(None);
        let pair_has = pairs
            .iter()
            .any(|pair| pair.takes_requests() && pair.backend.lists(model) == Some(true));
        let decode_has = decodes
            .iter()
            .any(|decode| ready(decode) && decode.lists(model) == Some(true));
        if pair_has && decode_has {
            return Ok(());
        }
        let Some(source) = AdapterLoader::source(&self.config.models, &self.pool, model) else {
            return Ok(());
        };
        let base = Some(source.base.as_str());
        let prefill = match pair_has {
            true => None,
            false => Some(
                (pairs.iter())
                    .filter(|pair| pair.takes_requests() && pair.serves(base))
                    .min_by_key(|pair| pair.backend.load())
                    .map(|pair| pair.backend.clone())
                    .ok_or_else(|| unavailable(&source.base, Side::Prefill))?,
            ),
        };
        let decode = match decode_has {
            true => None,
            false => Some(
                (decodes.iter())
                    .filter(|decode| ready(decode) && decode.serves(base))
                    .min_by_key(|decode| decode.load())
                    .cloned()
                    .ok_or_else(|| unavailable(&source.base, Side::Decode))?,
            ),
        };
        let load = |backend: Option<Arc<Backend>>| {
            let source = &source;
            async move {
                match backend {
                    Some(backend) => {
                        (self.lora)
                            .ensure(&backend, model, source, facts.authorization, facts.deadline)
                            .await
                    }
                    None => Ok(()),
                }
            }
        };
        let (prefill, decode) = tokio::join!(load(prefill), load(decode));
        prefill
            .and(decode)
            .map_err(|err| Unplaceable::AdapterNotLoaded {
                model: model.to_owned(),
                reason: err.to_string(),
            })
    }

    /// No ready pair serves `model`: not found when no engine serves it at all (and every
    /// engine's models are known), else nothing (the caller tells it is unavailable).
    fn check_served(&self, pairs: &[Arc<Pair>], model: &str) -> Result<(), Unplaceable> {
        let pool = &self.pool;
        if crate::models::anyone_serves(pool, pairs, model) || !crate::models::all_known(pool) {
            return Ok(());
        }
        Err(Unplaceable::ModelNotFound {
            model: model.to_owned(),
            served: crate::models::served_names(pool, pairs),
        })
    }
}

/// `model`'s `side` engines cannot take the request now.
fn unavailable(model: &str, side: Side) -> Unplaceable {
    Unplaceable::ModelUnavailable {
        model: model.to_owned(),
        side,
    }
}
