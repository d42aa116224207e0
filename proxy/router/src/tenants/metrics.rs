//! The metrics of tenants (`--api-key`, `--api-keys-file`): requests let in and refused by
//! their limits, by tenant (a label bounded by the keys file, at most
//! [`MAX_TENANTS`](super::file::MAX_TENANTS) names), in the front door's registry.

use prometheus::{IntCounterVec, Opts, Registry};

use super::LimitKind;

/// The handles of the tenants' metrics.
#[derive(Clone)]
pub struct TenantMetrics {
    requests: IntCounterVec,
    limited: IntCounterVec,
}

impl TenantMetrics {
    /// Creates and registers the metrics in `registry`.
    pub fn new(registry: &Registry) -> Self {
        let requests = IntCounterVec::new(
            Opts::new(
                "tenant_requests_total",
                "Requests whose key named a tenant and that its limits let in",
            ),
            &["tenant"],
        )
        .expect("valid metric");
        let limited = IntCounterVec::new(
            Opts::new(
                "tenant_rate_limited_total",
                "Requests refused with 429 by their tenant's limits, by limit",
            ),
            &["tenant", "limit"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(requests.clone()))
            .expect("metric registered once");
        registry
            .register(Box::new(limited.clone()))
            .expect("metric registered once");
        TenantMetrics { requests, limited }
    }

    /// Creates `tenant`'s series at 0 (dashboards and alerts see them before any request).
    pub fn known(&self, tenant: &str) {
        self.requests.with_label_values(&[tenant]);
        for limit in LimitKind::ALL {
            self.limited.with_label_values(&[tenant, limit.as_str()]);
        }
    }

    /// Counts a request of `tenant` let in.
    pub fn admitted(&self, tenant: &str) {
        self.requests.with_label_values(&[tenant]).inc();
    }

    /// Counts a request of `tenant` refused by `limit`.
    pub fn limited(&self, tenant: &str, limit: LimitKind) {
        (self.limited)
            .with_label_values(&[tenant, limit.as_str()])
            .inc();
    }
}
