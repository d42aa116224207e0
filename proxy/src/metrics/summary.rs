//! [`Gathered`]: one reading of the proxy's metrics, summed across labels for the live page.

use std::collections::BTreeMap;

use prometheus::proto::{Metric, MetricFamily};

/// Every metric family, read at one instant.
pub(crate) struct Gathered(Vec<MetricFamily>);

impl Gathered {
    pub(super) fn new(families: Vec<MetricFamily>) -> Self {
        Gathered(families)
    }

    fn series<'a>(&'a self, family: &'a str) -> impl Iterator<Item = &'a Metric> {
        (self.0.iter())
            .filter(move |f| f.name() == family)
            .flat_map(|f| f.get_metric())
    }

    /// The counter `family`'s values summed by the `labels` given (over every other label),
    /// the largest first: e.g. the routing decisions by decision and reason.
    pub(crate) fn totals_by(&self, family: &str, labels: &[&str]) -> Vec<(Vec<String>, u64)> {
        let mut totals: BTreeMap<Vec<String>, f64> = BTreeMap::new();
        for metric in self.series(family) {
            let key = (labels.iter())
                .map(|name| {
                    let pair = metric.get_label().iter().find(|pair| pair.name() == *name);
                    pair.map(|pair| pair.value().to_owned()).unwrap_or_default()
                })
                .collect();
            *totals.entry(key).or_default() += metric.get_counter().get_value();
        }
        let mut totals: Vec<(Vec<String>, u64)> = (totals.into_iter())
            .filter(|(_, value)| *value > 0.0)
            .map(|(key, value)| (key, value as u64))
            .collect();
        totals.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        totals
    }

    /// The histogram `family`'s buckets summed over all its series: (upper bound, requests at
    /// or under it), cumulative as Prometheus keeps them, `+Inf` last (as `f64::INFINITY`).
    pub(crate) fn buckets_of(&self, family: &str) -> Vec<(f64, u64)> {
        let mut buckets: Vec<(f64, u64)> = Vec::new();
        for metric in self.series(family) {
            let histogram = metric.get_histogram();
            for (i, bucket) in histogram.get_bucket().iter().enumerate() {
                match buckets.get_mut(i) {
                    Some(sum) => sum.1 += bucket.cumulative_count(),
                    None => buckets.push((bucket.upper_bound(), bucket.cumulative_count())),
                }
            }
            let total = histogram.get_sample_count();
            let last = histogram.get_bucket().len();
            match buckets.get_mut(last) {
                Some(sum) => sum.1 += total,
                None => buckets.push((f64::INFINITY, total)),
            }
        }
        buckets
    }
}
