//! The metrics of DNS discovery (`dns://` backends).

use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};

/// The handles of the DNS discovery metrics.
#[derive(Clone)]
pub struct DnsMetrics {
    resolutions: IntCounterVec,
    backends: IntGaugeVec,
}

impl DnsMetrics {
    /// Registers them in `registry`.
    pub fn new(registry: &Registry) -> Self {
        let resolutions = IntCounterVec::new(
            Opts::new(
                "dns_resolutions_total",
                "Resolutions of a dns:// backend name, by outcome (ok; else nxdomain, no_records, \
                 timeout or error, and the last set of backends is kept)",
            ),
            &["name", "outcome"],
        )
        .expect("valid metric");
        let backends = IntGaugeVec::new(
            Opts::new(
                "dns_backends",
                "Backends a dns:// name resolves to (as of its last successful resolution)",
            ),
            &["name"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(resolutions.clone()))
            .expect("metric names are unique");
        registry
            .register(Box::new(backends.clone()))
            .expect("metric names are unique");
        DnsMetrics {
            resolutions,
            backends,
        }
    }

    /// Counts one resolution of `name` that ended with `outcome` (`ok`, or why it failed).
    pub fn resolved(&self, name: &str, outcome: &str) {
        self.resolutions.with_label_values(&[name, outcome]).inc();
    }

    /// Records how many backends `name` resolves to.
    pub fn backends(&self, name: &str, count: usize) {
        self.backends.with_label_values(&[name]).set(count as i64);
    }
}
