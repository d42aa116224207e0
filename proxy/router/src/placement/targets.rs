//! Placement for requests that carry latency targets: the candidate predicted to meet them
//! with the most headroom ([`crate::latency`]), instead of the policy's pick; the policy's
//! pick when no candidate's model has learnt enough to predict. The forecast of every placed
//! request, so that its answer teaches the models.

use std::sync::Arc;

use crate::admission::Targets;
use crate::backend::{Backend, Pair};
use crate::latency::{headroom, most_headroom};
use crate::placement::Forecast;
use crate::routing::RequestInfo;
use crate::saturation::mixed;
use crate::{Facts, Router};

impl Router {
    /// A pair for the request of `facts` serving `model`: by its TTFT target when it sets one
    /// and predictions exist, else by the policy.
    pub(crate) fn pair_with_targets(
        &self,
        pairs: &[Arc<Pair>],
        model: Option<&str>,
        facts: &Facts<'_>,
    ) -> Option<Arc<Pair>> {
        let serving = |pair: &Arc<Pair>| pair.takes_requests() && pair.serves(model);
        let saturated = |pair: &Arc<Pair>| pair.backend.is_saturated();
        let avoid = mixed(pairs, serving, saturated);
        let usable = |pair: &Arc<Pair>| serving(pair) && !(avoid && saturated(pair));
        let targets = &facts.class.targets;
        (self.pair_for_targets(pairs, usable, facts.request, targets))
            .or_else(|| self.pick_pair(pairs, model, facts.request))
    }

    /// A decode for the request of `facts` serving `model` (among those `facts` allows): by
    /// its targets when it sets some and predictions exist, else by the policy; `alone`: it
    /// also computes the prompt.
    pub(crate) fn decode_with_targets(
        &self,
        model: Option<&str>,
        facts: &Facts<'_>,
        alone: bool,
    ) -> Option<Arc<Backend>> {
        let allowed = facts.decodes;
        let eligible = |decode: &Arc<Backend>| {
            decode.takes_requests(model) && allowed.is_none_or(|allowed| allowed(decode))
        };
        let decodes = self.pool.decodes();
        let avoid = mixed(&decodes, eligible, |decode| decode.is_saturated());
        let usable = |decode: &Arc<Backend>| eligible(decode) && !(avoid && decode.is_saturated());
        let targets = &facts.class.targets;
        (self.decode_for_targets(&decodes, usable, facts.request, targets, alone))
            .or_else(|| self.pick_decode_among(None, model, facts.request, allowed))
    }

    /// The prompt's tokens `engine` (of policy identity `owner`) would compute: those it does
    /// not hold by the KV events' index, when followed and the tokens are known; else the
    /// prompt's estimated size.
    pub(crate) fn uncached_tokens(&self, request: &RequestInfo<'_>, owner: u64) -> usize {
        let (Some(kv), Some(tokens)) = (&self.kv, request.tokens()) else {
            return request.prompt_tokens_estimate();
        };
        let held = request.held(|| kv.holders(&request.kv_key(), tokens));
        let cached = (held.iter())
            .filter(|held| held.owner == owner)
            .map(|held| held.cached_tokens)
            .max()
            .unwrap_or(0);
        tokens.len().saturating_sub(cached)
    }

    /// The usable pair predicted to meet the TTFT target with the most headroom (when the
    /// request sets one and a prediction exists).
    pub(crate) fn pair_for_targets(
        &self,
        pairs: &[Arc<Pair>],
        usable: impl Fn(&Arc<Pair>) -> bool,
        request: &RequestInfo<'_>,
        targets: &Targets,
    ) -> Option<Arc<Pair>> {
        let target = targets.ttft?;
        let ttft = |pair: &Arc<Pair>| {
            let uncached = self.uncached_tokens(request, pair.id());
            pair.backend.latency.ttft(uncached, pair.backend.load())
        };
        let (pair, _) = most_headroom(pairs.iter().filter(|p| usable(p)), target, ttft)?;
        Some(pair.clone())
    }

    /// The usable decode predicted to meet the targets with the most headroom: its TPOT, and
    /// its TTFT too when it computes the prompt itself (`alone`).
    pub(crate) fn decode_for_targets(
        &self,
        decodes: &[Arc<Backend>],
        usable: impl Fn(&Arc<Backend>) -> bool,
        request: &RequestInfo<'_>,
        targets: &Targets,
        alone: bool,
    ) -> Option<Arc<Backend>> {
        let ttft_target = targets.ttft.filter(|_| alone);
        if ttft_target.is_none() && targets.tpot.is_none() {
            return None;
        }
        let room = |decode: &Arc<Backend>| -> Option<f64> {
            let load = decode.load();
            let ttft = match ttft_target {
                Some(target) => {
                    let uncached = self.uncached_tokens(request, decode.id());
                    Some(headroom(decode.latency.ttft(uncached, load)?, target))
                }
                None => None,
            };
            let tpot = match targets.tpot {
                Some(target) => Some(headroom(decode.latency.tpot(load)?, target)),
                None => None,
            };
            ttft.into_iter().chain(tpot).reduce(f64::min)
        };
        let best = (decodes.iter().filter(|d| usable(d)))
            .filter_map(|decode| Some((decode, room(decode)?)))
            .max_by(|a, b| a.1.total_cmp(&b.1))?;
        Some(best.0.clone())
    }

    /// The forecast of a request placed on `prefill` (when it goes through P) and `decode`.
    pub(crate) fn forecast(
        &self,
        request: &RequestInfo<'_>,
        prefill: Option<&Arc<Pair>>,
        decode: &Arc<Backend>,
        targets: Targets,
    ) -> Forecast {
        let (engine, owner) = match prefill {
            Some(pair) => (&pair.backend, pair.id()),
            None => (decode, decode.id()),
        };
        let uncached = self.uncached_tokens(request, owner);
        Forecast::new(
            engine,
            uncached,
            decode,
            targets,
            self.latency_metrics.clone(),
        )
    }
}
