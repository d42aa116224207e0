//! Which version each engine runs (vLLM's `GET /version`: `{"version": "0.33.0"}`), read at
//! its health checks, and the P/D pairs whose versions differ: a KV layout or a connector
//! that changed between releases makes such a pair's transfers fail or, worse, succeed wrong.
//! Each such pair is named once in a warning, every request placed on one is counted
//! (`mixed_version_pairs_total`), and each backend's version is in `GET /admin/backends` and on
//! the live page.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::Url;
use serde::Deserialize;

use crate::backend::{Backend, Pair};
use crate::metrics::VersionMetrics;
use crate::sync::lock;

/// The most pairs remembered as warned about (beyond, the warning is not repeated anyway:
/// the set is not cleared, new pairs are only counted).
const MAX_WARNED: usize = 4096;

#[derive(Deserialize)]
struct VersionAnswer {
    version: String,
}

/// The version `url` (a backend's `/version`) reports, or none (no such route, as on
/// SGLang's older servers, or no answer in time).
pub async fn read(client: &reqwest::Client, url: &Url, timeout: Duration) -> Option<String> {
    let answer = client.get(url.clone()).timeout(timeout).send().await.ok()?;
    if !answer.status().is_success() {
        return None;
    }
    let answer: VersionAnswer = answer.json().await.ok()?;
    Some(answer.version).filter(|v| !v.is_empty() && v.len() <= 64)
}

/// The pairs of different versions seen so far.
pub struct MixedVersions {
    metrics: VersionMetrics,
    warned: Mutex<HashSet<(u64, u64)>>,
}

impl MixedVersions {
    /// None seen yet; counted in `metrics`.
    pub fn new(metrics: VersionMetrics) -> Self {
        MixedVersions {
            metrics,
            warned: Mutex::new(HashSet::new()),
        }
    }

    /// Counts a request placed on `prefill` and `decode` when their versions differ (both
    /// known), warning once per pair.
    pub fn check(&self, prefill: Option<&Arc<Pair>>, decode: &Backend) {
        let Some(prefill) = prefill.map(|pair| &pair.backend) else {
            return;
        };
        let (Some(p), Some(d)) = (prefill.version(), decode.version()) else {
            return;
        };
        if p == d {
            return;
        }
        self.metrics.mixed.with_label_values(&[&p, &d]).inc();
        let mut warned = lock(&self.warned);
        if warned.len() < MAX_WARNED && warned.insert((prefill.id(), decode.id())) {
            tracing::warn!(
                prefill = prefill.url(),
                prefill_version = &*p,
                decode = decode.url(),
                decode_version = &*d,
                "a prefill and a decode of different engine versions serve requests together: \
                 run one version across a P/D pair"
            );
        }
    }
}
