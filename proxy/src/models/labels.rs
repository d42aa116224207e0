//! [`ModelLabels`]: the `model` label of the request and decision metrics, kept to a bounded
//! set: the models served here (by name), `other` for any other name, `none` for a request
//! that names no model (or was refused before its body was read).

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

use crate::metrics::{DecisionMetrics, Metrics, RouteMetrics};
use crate::route::Route;

/// The label of requests that name no model.
pub(super) const NO_MODEL: &str = "none";
/// The label of requests for a model not served here, or past [`MAX_LABELS`].
pub(super) const OTHER_MODEL: &str = "other";
/// The most model labels the metrics take; later models are counted as `other`.
pub(super) const MAX_LABELS: usize = 64;

/// The handles of one model label.
pub(crate) struct ModelHandles {
    routes: [Arc<RouteMetrics>; 3],
    /// Its routing decision counters.
    pub decisions: DecisionMetrics,
}

impl ModelHandles {
    /// The handles of `route`.
    pub(crate) fn route(&self, route: Route) -> &Arc<RouteMetrics> {
        &self.routes[route as usize]
    }
}

/// The handles of every model label, made on first use.
pub(crate) struct ModelLabels {
    metrics: Arc<Metrics>,
    labels: RwLock<HashMap<Box<str>, Arc<ModelHandles>>>,
    none: Arc<ModelHandles>,
    other: Arc<ModelHandles>,
}

impl ModelLabels {
    /// The labels of `metrics`' families.
    pub(crate) fn new(metrics: Arc<Metrics>) -> Self {
        let handles = |label: &str| Arc::new(make(&metrics, label));
        ModelLabels {
            none: handles(NO_MODEL),
            other: handles(OTHER_MODEL),
            labels: RwLock::default(),
            metrics,
        }
    }

    /// The handles of requests that name no model.
    pub(crate) fn none(&self) -> &Arc<ModelHandles> {
        &self.none
    }

    /// The handles of `model`: its own when it has them, or when `served` says it is served
    /// here (asked only then) and the labels are not all taken; else `other`'s.
    pub(crate) fn of(&self, model: &str, served: impl FnOnce() -> bool) -> Arc<ModelHandles> {
        if model == NO_MODEL || model == OTHER_MODEL {
            return self.other.clone();
        }
        let labels = self.labels.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(handles) = labels.get(model) {
            return handles.clone();
        }
        drop(labels);
        if !served() {
            return self.other.clone();
        }
        let mut labels = self.labels.write().unwrap_or_else(PoisonError::into_inner);
        if labels.len() >= MAX_LABELS && !labels.contains_key(model) {
            return self.other.clone();
        }
        labels
            .entry(model.into())
            .or_insert_with(|| Arc::new(make(&self.metrics, model)))
            .clone()
    }
}

fn make(metrics: &Metrics, model: &str) -> ModelHandles {
    let route = |route: &str| Arc::new(metrics.route(route, model));
    ModelHandles {
        routes: [
            route("/v1/completions"),
            route("/v1/chat/completions"),
            route("/generate"),
        ],
        decisions: metrics.decisions(model),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_bounded() {
        let labels = ModelLabels::new(Arc::new(Metrics::new()));
        let a = labels.of("a", || true);
        assert!(Arc::ptr_eq(&a, &labels.of("a", || unreachable!())));
        assert!(Arc::ptr_eq(&labels.of("b", || false), &labels.other));
        for i in 0..MAX_LABELS + 5 {
            labels.of(&format!("m{i}"), || true);
        }
        assert!(Arc::ptr_eq(&labels.of("late", || true), &labels.other));
        assert!(Arc::ptr_eq(&labels.of("a", || true), &a));
        a.route(Route::Generate).start();
        let text = labels.metrics.render();
        assert!(text.contains(r#"pd_proxy_requests_in_flight{model="a",route="/generate"} 1"#));
    }
}
