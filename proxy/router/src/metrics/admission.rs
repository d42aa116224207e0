//! The admission's metrics: the queue's length by priority and by tenant, the waits, the
//! requests let in (at once or after waiting), the requests shed by reason, and the retries
//! the retry budget allowed or denied. Priority and tenant labels are bounded: priorities
//! beyond ±10 share `low`/`high`, tenants past the first 32 seen share `other`.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
};

use crate::sync::lock;

/// The most tenants with a label of their own.
const TENANT_LABELS: usize = 32;
/// The tenants past the bound.
const OTHER_TENANT: &str = "other";

/// The priority label of `priority`.
fn priority_label(priority: i32) -> String {
    match priority {
        p if p > 10 => "high".into(),
        p if p < -10 => "low".into(),
        p => p.to_string(),
    }
}

/// The handles of the admission's metrics.
#[derive(Clone)]
pub struct AdmissionMetrics {
    queue_length: IntGaugeVec,
    tenant_queue_length: IntGaugeVec,
    wait: HistogramVec,
    tenant_wait: prometheus::CounterVec,
    /// Admitted at once, after waiting.
    admitted: [IntCounter; 2],
    shed: IntCounterVec,
    tenant_shed: IntCounterVec,
    retries: IntCounterVec,
    tenants: Arc<Mutex<HashSet<Arc<str>>>>,
    /// The priority and tenant labels the queue's gauges were ever set for (set to 0 when
    /// nothing of theirs waits, so their series stay).
    shown: Arc<Mutex<(HashSet<String>, HashSet<String>)>>,
}

impl AdmissionMetrics {
    /// Registers them in `registry`.
    pub fn new(registry: &Registry) -> Self {
        let gauge = |name: &str, help: &str, label: &str| {
            IntGaugeVec::new(Opts::new(name, help), &[label]).expect("valid metric")
        };
        let counter = |name: &str, help: &str, labels: &[&str]| {
            IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
        };
        let admitted = counter(
            "admission_admitted_total",
            "Requests admitted: at once (`direct`) or after waiting (`queued`)",
            &["path"],
        );
        let metrics = AdmissionMetrics {
            queue_length: gauge(
                "admission_queue_length",
                "Requests waiting to be admitted, by priority",
                "priority",
            ),
            tenant_queue_length: gauge(
                "admission_queue_tenant_length",
                "Requests waiting to be admitted, by tenant",
                "tenant",
            ),
            wait: HistogramVec::new(
                HistogramOpts::new(
                    "admission_wait_seconds",
                    "Time requests waited in the admission queue (let in or shed), by priority",
                )
                .buckets(vec![
                    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                ]),
                &["priority"],
            )
            .expect("valid metric"),
            tenant_wait: prometheus::CounterVec::new(
                Opts::new(
                    "admission_tenant_wait_seconds_total",
                    "Time requests waited in the admission queue, summed by tenant",
                ),
                &["tenant"],
            )
            .expect("valid metric"),
            admitted: ["direct", "queued"].map(|path| admitted.with_label_values(&[path])),
            shed: counter(
                "admission_shed_total",
                "Requests refused under overload (429), by reason and priority",
                &["reason", "priority"],
            ),
            tenant_shed: counter(
                "admission_tenant_shed_total",
                "Requests refused under overload (429), by tenant",
                &["tenant"],
            ),
            retries: counter(
                "retries_total",
                "Retries on another engine, allowed or denied by the retry budget, by kind",
                &["kind", "outcome"],
            ),
            tenants: Arc::default(),
            shown: Arc::default(),
        };
        for collector in [
            Box::new(metrics.queue_length.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(metrics.tenant_queue_length.clone()),
            Box::new(metrics.wait.clone()),
            Box::new(metrics.tenant_wait.clone()),
            Box::new(admitted.clone()),
            Box::new(metrics.shed.clone()),
            Box::new(metrics.tenant_shed.clone()),
            Box::new(metrics.retries.clone()),
        ] {
            registry
                .register(collector)
                .expect("admission metrics registered once");
        }
        metrics.queue_lengths(&[(0, 0)], &BTreeMap::new());
        metrics
    }

    /// `tenant`, or `other` past the bound of tenants with a label of their own.
    pub fn tenant_label(&self, tenant: &Arc<str>) -> Arc<str> {
        let mut tenants = lock(&self.tenants);
        if tenants.contains(tenant) {
            return tenant.clone();
        }
        if tenants.len() < TENANT_LABELS {
            tenants.insert(tenant.clone());
            return tenant.clone();
        }
        Arc::from(OTHER_TENANT)
    }

    /// Counts a request admitted, after waiting (`queued`) or not.
    pub fn admitted(&self, queued: bool) {
        self.admitted[usize::from(queued)].inc();
    }

    /// Shows a refusal `reason` at 0 until the first one (so its series exists from the start).
    pub fn shed_reason(&self, reason: &str) {
        self.shed.with_label_values(&[reason, "0"]);
    }

    /// Counts a request refused for `reason`.
    pub fn shed(&self, reason: &str, priority: i32, tenant: &str) {
        let priority = priority_label(priority);
        self.shed.with_label_values(&[reason, &priority]).inc();
        self.tenant_shed.with_label_values(&[tenant]).inc();
    }

    /// Counts one wait in the queue.
    pub fn waited(&self, priority: i32, tenant: &str, waited: Duration) {
        let seconds = waited.as_secs_f64();
        self.wait
            .with_label_values(&[&priority_label(priority)])
            .observe(seconds);
        self.tenant_wait
            .with_label_values(&[tenant])
            .inc_by(seconds);
    }

    /// Sets the queue's lengths (by priority and by tenant); bands and tenants no longer
    /// waiting read 0.
    pub fn queue_lengths(&self, priorities: &[(i32, usize)], tenants: &BTreeMap<Arc<str>, usize>) {
        let mut by_priority: BTreeMap<String, i64> = BTreeMap::new();
        for (priority, n) in priorities {
            *by_priority.entry(priority_label(*priority)).or_default() += *n as i64;
        }
        let known = lock(&self.tenants).clone();
        let mut by_tenant: BTreeMap<String, i64> = BTreeMap::new();
        for (tenant, n) in tenants {
            let label = match known.contains(tenant) {
                true => tenant.to_string(),
                false => OTHER_TENANT.to_owned(),
            };
            *by_tenant.entry(label).or_default() += *n as i64;
        }
        let mut shown = lock(&self.shown);
        let (priorities_shown, tenants_shown) = &mut *shown;
        for (gauge, now, shown) in [
            (&self.queue_length, by_priority, priorities_shown),
            (&self.tenant_queue_length, by_tenant, tenants_shown),
        ] {
            for label in shown.iter() {
                if !now.contains_key(label) {
                    gauge.with_label_values(&[label]).set(0);
                }
            }
            for (label, n) in now {
                gauge.with_label_values(&[&label]).set(n);
                shown.insert(label);
            }
        }
    }

    /// Counts a retry of `kind` the budget allowed or denied.
    pub fn retry(&self, kind: &str, allowed: bool) {
        let outcome = if allowed { "allowed" } else { "denied" };
        self.retries.with_label_values(&[kind, outcome]).inc();
    }
}
