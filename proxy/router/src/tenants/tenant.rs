//! One tenant and what it may still send: its token buckets (requests per second, prompt and
//! output tokens per minute) and its requests in flight, and what a refusal tells the client.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::bucket::Bucket;
use super::file::Limits;
use crate::sync::lock;

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    /// Requests per second.
    Requests,
    /// Requests in flight.
    Concurrency,
    /// Prompt tokens per minute.
    PromptTokens,
    /// Output tokens per minute.
    OutputTokens,
}

impl LimitKind {
    /// Every kind, in label order.
    pub const ALL: [LimitKind; 4] = [
        LimitKind::Requests,
        LimitKind::Concurrency,
        LimitKind::PromptTokens,
        LimitKind::OutputTokens,
    ];

    /// The `limit` label, and the word of messages.
    pub fn as_str(self) -> &'static str {
        match self {
            LimitKind::Requests => "requests",
            LimitKind::Concurrency => "concurrency",
            LimitKind::PromptTokens => "prompt_tokens",
            LimitKind::OutputTokens => "output_tokens",
        }
    }
}

/// Where a tenant stands against one limit: its size, what is left, when it is whole again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Standing {
    /// The limit (per second for requests, per minute for tokens).
    pub limit: f64,
    /// What is left now.
    pub remaining: f64,
    /// How long until it is whole again.
    pub reset: Duration,
}

/// Where a tenant stands: what OpenAI's `x-ratelimit-*` headers say.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RateStatus {
    /// Against its requests per second.
    pub requests: Option<Standing>,
    /// Against its tightest token limit (the one with the least left).
    pub tokens: Option<Standing>,
}

/// A request refused by its tenant's limits.
#[derive(Debug, Clone, PartialEq)]
pub struct Limited {
    /// Which limit.
    pub kind: LimitKind,
    /// When to try again (none: this request never fits, it asks more than the limit).
    pub retry_after: Option<Duration>,
    /// Where the tenant stands.
    pub status: RateStatus,
    /// What the request asked and the limit it went over, for the message.
    pub asked: f64,
    /// The limit.
    pub limit: f64,
}

impl Limited {
    /// What the client is told.
    pub fn message(&self, tenant: &str) -> String {
        let limit = self.limit;
        match (self.kind, self.retry_after) {
            (LimitKind::Requests, _) => {
                format!("tenant {tenant} is over its limit of {limit} requests per second")
            }
            (LimitKind::Concurrency, _) => format!(
                "tenant {tenant} has {limit} requests in flight, its limit: wait for one to end"
            ),
            (kind, None) => format!(
                "this request needs {} {} tokens, over tenant {tenant}'s limit of {limit} per \
                 minute: ask for fewer (max_tokens)",
                self.asked.ceil(),
                kind.as_str().trim_end_matches("_tokens")
            ),
            (kind, Some(_)) => format!(
                "tenant {tenant} is over its limit of {limit} {} tokens per minute",
                kind.as_str().trim_end_matches("_tokens")
            ),
        }
    }
}

/// A tenant's buckets.
#[derive(Debug)]
struct Buckets {
    requests: Option<Bucket>,
    prompt: Option<Bucket>,
    output: Option<Bucket>,
}

/// One tenant: its name, limits and where it stands against them.
#[derive(Debug)]
pub struct Tenant {
    name: Arc<str>,
    limits: Limits,
    buckets: Mutex<Buckets>,
    /// Its requests in flight (shared with the tenant it replaces when its limits change).
    in_flight: Arc<AtomicU32>,
}

/// A bucket's size and rate for a limit: requests per second (bursts of a second's worth, at
/// least one request).
fn requests_bucket(rate: f64) -> (f64, f64) {
    (rate.max(1.0), rate)
}

/// A bucket's size and rate for tokens per minute.
fn tokens_bucket(per_minute: f64) -> (f64, f64) {
    (per_minute, per_minute / 60.0)
}

impl Tenant {
    pub(super) fn new(name: &str, limits: Limits, now: Instant) -> Self {
        let bucket = |(capacity, rate): (f64, f64)| Bucket::new(capacity, rate, now);
        Tenant {
            name: Arc::from(name),
            limits,
            buckets: Mutex::new(Buckets {
                requests: limits.requests_per_second.map(requests_bucket).map(bucket),
                prompt: limits
                    .prompt_tokens_per_minute
                    .map(tokens_bucket)
                    .map(bucket),
                output: limits
                    .output_tokens_per_minute
                    .map(tokens_bucket)
                    .map(bucket),
            }),
            in_flight: Arc::default(),
        }
    }

    /// `old` under new `limits`: its requests in flight still count, and each limit it had
    /// keeps what was used of it (up to the new size).
    pub(super) fn after(old: &Tenant, limits: Limits, now: Instant) -> Self {
        let mut before = lock(&old.buckets);
        let carry = |old: &mut Option<Bucket>, sized: Option<(f64, f64)>| {
            let (capacity, rate) = sized?;
            Some(match old {
                Some(bucket) => bucket.resized(capacity, rate, now),
                None => Bucket::new(capacity, rate, now),
            })
        };
        let requests = limits.requests_per_second.map(requests_bucket);
        let prompt = limits.prompt_tokens_per_minute.map(tokens_bucket);
        let output = limits.output_tokens_per_minute.map(tokens_bucket);
        let buckets = Buckets {
            requests: carry(&mut before.requests, requests),
            prompt: carry(&mut before.prompt, prompt),
            output: carry(&mut before.output, output),
        };
        Tenant {
            name: old.name.clone(),
            limits,
            buckets: Mutex::new(buckets),
            in_flight: old.in_flight.clone(),
        }
    }

    /// Its name.
    pub fn name(&self) -> &Arc<str> {
        &self.name
    }

    /// Its limits.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// A request arrives: it must fit the requests per second and the requests in flight; it
    /// then holds a place in flight until the returned [`InFlight`] is dropped.
    pub fn arrive(self: &Arc<Self>, now: Instant) -> Result<InFlight, Limited> {
        if let Some(max) = self.limits.max_concurrent_requests {
            let taken = self
                .in_flight
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < max).then_some(n + 1)
                });
            if taken.is_err() {
                return Err(Limited {
                    kind: LimitKind::Concurrency,
                    retry_after: Some(Duration::from_secs(1)),
                    status: self.status(now),
                    asked: 1.0,
                    limit: f64::from(max),
                });
            }
        }
        let held = InFlight((self.limits.max_concurrent_requests).map(|_| self.in_flight.clone()));
        let mut buckets = lock(&self.buckets);
        if let Some(requests) = &mut buckets.requests {
            if let Err(short) = requests.check(1.0, now) {
                let limit = self.limits.requests_per_second.unwrap_or_default();
                drop(buckets);
                return Err(Limited {
                    kind: LimitKind::Requests,
                    retry_after: short.wait,
                    status: self.status(now),
                    asked: 1.0,
                    limit,
                });
            }
            requests.take(1.0);
        }
        Ok(held)
    }

    /// Charges a request's tokens (`prompt` estimated, `output` its `max_tokens`): both must
    /// fit, or neither is taken.
    pub fn charge(&self, prompt: f64, output: f64, now: Instant) -> Result<RateStatus, Limited> {
        // A cost is never negative (that would fill the bucket).
        let (prompt, output) = (prompt.max(0.0), output.max(0.0));
        let mut buckets = lock(&self.buckets);
        let limits = [
            (
                LimitKind::PromptTokens,
                self.limits.prompt_tokens_per_minute,
                prompt,
            ),
            (
                LimitKind::OutputTokens,
                self.limits.output_tokens_per_minute,
                output,
            ),
        ];
        for (kind, limit, cost) in limits {
            let bucket = match kind {
                LimitKind::PromptTokens => &mut buckets.prompt,
                _ => &mut buckets.output,
            };
            if let (Some(bucket), Some(limit)) = (bucket, limit) {
                if let Err(short) = bucket.check(cost, now) {
                    drop(buckets);
                    return Err(Limited {
                        kind,
                        retry_after: short.wait,
                        status: self.status(now),
                        asked: cost,
                        limit,
                    });
                }
            }
        }
        if let Some(bucket) = &mut buckets.prompt {
            bucket.take(prompt);
        }
        if let Some(bucket) = &mut buckets.output {
            bucket.take(output);
        }
        drop(buckets);
        Ok(self.status(now))
    }

    /// Where it stands now.
    pub fn status(&self, now: Instant) -> RateStatus {
        let mut buckets = lock(&self.buckets);
        let standing = |bucket: &mut Bucket, limit: f64| Standing {
            limit,
            remaining: bucket.remaining(now),
            reset: bucket.until_full(now),
        };
        let limits = &self.limits;
        let requests = (buckets.requests.as_mut())
            .zip(limits.requests_per_second)
            .map(|(bucket, limit)| standing(bucket, limit));
        let prompt = (buckets.prompt.as_mut())
            .zip(limits.prompt_tokens_per_minute)
            .map(|(bucket, limit)| standing(bucket, limit));
        let output = (buckets.output.as_mut())
            .zip(limits.output_tokens_per_minute)
            .map(|(bucket, limit)| standing(bucket, limit));
        let tokens = match (prompt, output) {
            (Some(p), Some(o)) if o.remaining / o.limit < p.remaining / p.limit => Some(o),
            (p, o) => p.or(o),
        };
        RateStatus { requests, tokens }
    }
}

/// A request's place among its tenant's requests in flight, given back when dropped.
#[derive(Debug)]
pub struct InFlight(Option<Arc<AtomicU32>>);

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(in_flight) = &self.0 {
            in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
