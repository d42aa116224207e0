//! The metrics of answers continued on another decode after theirs failed mid-answer.

use std::time::Duration;

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts, Registry};

/// Why a streamed answer's decode failed mid-answer (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Break {
    /// The connection closed or was reset before the answer's end.
    Broken,
    /// The decode sent an error event mid-answer.
    ErrorEvent,
    /// No token came within `--decode-stall-timeout`.
    Stalled,
    /// A whole (non-streamed) answer's decode failed after its prefill answered.
    Failed,
}

impl Break {
    /// Every reason.
    const ALL: [Break; 4] = [
        Break::Broken,
        Break::ErrorEvent,
        Break::Stalled,
        Break::Failed,
    ];

    /// The label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Break::Broken => "broken",
            Break::ErrorEvent => "error_event",
            Break::Stalled => "stalled",
            Break::Failed => "failed",
        }
    }
}

/// How a migration ended (the `outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Migrated {
    /// The answer went on on another decode.
    Resumed,
    /// The continuation could not be started (no decode left, or it failed too).
    Failed,
    /// The request had used its `--migration-limit`.
    Limit,
    /// The request's deadline had passed.
    Deadline,
    /// The retry budget was spent.
    Budget,
    /// The answer could not be continued exactly (see docs/proxy.md).
    Inexact,
}

impl Migrated {
    /// Every outcome.
    const ALL: [Migrated; 6] = [
        Migrated::Resumed,
        Migrated::Failed,
        Migrated::Limit,
        Migrated::Deadline,
        Migrated::Budget,
        Migrated::Inexact,
    ];

    /// The label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Migrated::Resumed => "resumed",
            Migrated::Failed => "failed",
            Migrated::Limit => "limit",
            Migrated::Deadline => "deadline",
            Migrated::Budget => "budget",
            Migrated::Inexact => "inexact",
        }
    }
}

/// The handles of the migration metrics.
#[derive(Clone)]
pub(crate) struct MigrationMetrics {
    migrations: IntCounterVec,
    reprefilled: IntCounter,
    resume: Histogram,
}

impl MigrationMetrics {
    /// Creates and registers the metrics in `registry`.
    pub(crate) fn new(registry: &Registry) -> Self {
        let migrations = IntCounterVec::new(
            Opts::new(
                "migrations_total",
                "Answers whose decode failed mid-answer, by why and by what became of them",
            ),
            &["reason", "outcome"],
        )
        .expect("valid metric");
        let reprefilled = IntCounter::new(
            "migration_reprefilled_tokens_total",
            "Tokens computed again as the prompt of continued answers",
        )
        .expect("valid metric");
        let resume = Histogram::with_opts(
            HistogramOpts::new(
                "migration_resume_seconds",
                "From a decode's failure to the continuation's first byte",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
        )
        .expect("valid metric");
        // Every series exists from the start, at 0 (dashboards and alerts see them).
        for reason in Break::ALL {
            for outcome in Migrated::ALL {
                migrations.with_label_values(&[reason.as_str(), outcome.as_str()]);
            }
        }
        for metric in [
            Box::new(migrations.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(reprefilled.clone()),
            Box::new(resume.clone()),
        ] {
            registry.register(metric).expect("metric registered once");
        }
        MigrationMetrics {
            migrations,
            reprefilled,
            resume,
        }
    }

    /// Counts a migration of an answer broken by `reason` that ended as `outcome`.
    pub(crate) fn count(&self, reason: Break, outcome: Migrated) {
        (self.migrations)
            .with_label_values(&[reason.as_str(), outcome.as_str()])
            .inc();
    }

    /// Counts a continuation's prompt tokens computed again, started `after` its decode failed.
    pub(crate) fn resumed(&self, reason: Break, tokens: usize, after: Duration) {
        self.count(reason, Migrated::Resumed);
        self.reprefilled.inc_by(tokens as u64);
        self.resume.observe(after.as_secs_f64());
    }
}
