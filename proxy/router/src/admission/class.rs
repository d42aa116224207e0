//! What a request says of how it should be treated under overload, read from its headers:
//! its priority (`x-pd-priority`, else its objective's priority from `--config`'s
//! `[objectives]`, else 0; negative: sheddable), its tenant (the gateway's fairness id, else
//! a hash of its API key, else one default tenant) and its latency targets (TTFT and time per
//! output token). Both header families are read: the Gateway API Inference Extension's
//! (`x-gateway-inference-*`) and llm-d's (`x-llm-d-inference-*`, `x-llm-d-slo-*`).

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::Duration;

use http::header::AUTHORIZATION;
use http::HeaderMap;

/// The request's priority, an integer (higher first; negative: sheddable).
pub const X_PD_PRIORITY: &str = "x-pd-priority";
/// The objective's name (an `InferenceObjective`), mapped to a priority in `[objectives]`.
pub const OBJECTIVE_HEADERS: [&str; 2] = [
    "x-gateway-inference-objective",
    "x-llm-d-inference-objective",
];
/// The tenant whose fair share the request counts against.
pub const FAIRNESS_HEADERS: [&str; 2] = [
    "x-gateway-inference-fairness-id",
    "x-llm-d-inference-fairness-id",
];
/// The time-to-first-token target, in milliseconds (pd-proxy's name, then llm-d's).
pub const TTFT_HEADERS: [&str; 3] = ["x-pd-slo-ttft-ms", "x-llm-d-slo-ttft-ms", "x-slo-ttft-ms"];
/// The time-per-output-token target, in milliseconds (pd-proxy's name, then llm-d's).
pub const TPOT_HEADERS: [&str; 3] = ["x-pd-slo-tpot-ms", "x-llm-d-slo-tpot-ms", "x-slo-tpot-ms"];

/// Priorities are kept within this range (a larger number is clamped).
const PRIORITY_RANGE: std::ops::RangeInclusive<i32> = -1000..=1000;

/// The longest latency target, in milliseconds (an hour).
const MAX_TARGET_MS: f64 = 3_600_000.0;

/// The tenant of requests that name none and carry no API key.
pub const DEFAULT_TENANT: &str = "default";

/// [`DEFAULT_TENANT`], made once (most requests' tenant: no allocation per request).
static DEFAULT: std::sync::LazyLock<Arc<str>> =
    std::sync::LazyLock::new(|| Arc::from(DEFAULT_TENANT));

/// The latency a request asks for; either may be absent.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Targets {
    /// Time to the first token.
    pub ttft: Option<Duration>,
    /// Time per output token after the first.
    pub tpot: Option<Duration>,
}

impl Targets {
    /// Whether the request set any target.
    pub fn any(&self) -> bool {
        self.ttft.is_some() || self.tpot.is_some()
    }
}

/// How the admission and placement treat a request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestClass {
    /// Higher first; negative: sheddable.
    pub priority: i32,
    /// Whose fair share it counts against.
    pub tenant: Arc<str>,
    /// Its latency targets.
    pub targets: Targets,
}

/// A header that says something it cannot mean.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("header {header}: {message}")]
pub struct ClassError {
    /// The header.
    pub header: &'static str,
    /// What is wrong.
    pub message: String,
}

impl Default for RequestClass {
    fn default() -> Self {
        RequestClass {
            priority: 0,
            tenant: DEFAULT.clone(),
            targets: Targets::default(),
        }
    }
}

impl RequestClass {
    /// Whether it may be refused at once when the pool is saturated.
    pub fn sheddable(&self) -> bool {
        self.priority < 0
    }

    /// The class `headers` give a request, objectives mapped by `objectives`.
    pub fn of(
        headers: &HeaderMap,
        objectives: &BTreeMap<String, i32>,
    ) -> Result<RequestClass, ClassError> {
        // Every header read below but `Authorization` is an `x-` one: most requests carry
        // none, and a glance over their few names spares the eleven lookups.
        if !headers.keys().any(|name| name.as_str().starts_with("x-")) {
            return Ok(RequestClass {
                tenant: tenant_of_key(headers),
                ..RequestClass::default()
            });
        }
        let text = |name: &'static str| -> Result<Option<&str>, ClassError> {
            match headers.get(name) {
                None => Ok(None),
                Some(value) => value
                    .to_str()
                    .map(|t| Some(t.trim()))
                    .map_err(|_| ClassError {
                        header: name,
                        message: "not text".into(),
                    }),
            }
        };
        let first = |names: &[&'static str]| -> Result<Option<(&'static str, &str)>, ClassError> {
            for name in names {
                if let Some(value) = text(name)?.filter(|v| !v.is_empty()) {
                    return Ok(Some((name, value)));
                }
            }
            Ok(None)
        };
        let priority = match text(X_PD_PRIORITY)?.filter(|v| !v.is_empty()) {
            Some(value) => value.parse::<i64>().map_err(|_| ClassError {
                header: X_PD_PRIORITY,
                message: format!("{value:?} is not an integer"),
            })?,
            None => match first(&OBJECTIVE_HEADERS)? {
                Some((_, objective)) => i64::from(objectives.get(objective).copied().unwrap_or(0)),
                None => 0,
            },
        };
        let priority = priority.clamp(
            i64::from(*PRIORITY_RANGE.start()),
            i64::from(*PRIORITY_RANGE.end()),
        ) as i32;
        let tenant = match first(&FAIRNESS_HEADERS)? {
            Some((_, id)) => Arc::from(id),
            None => tenant_of_key(headers),
        };
        let millis = |names: &[&'static str]| -> Result<Option<Duration>, ClassError> {
            let Some((header, value)) = first(names)? else {
                return Ok(None);
            };
            match value.parse::<f64>() {
                Ok(ms) if ms > 0.0 && ms <= MAX_TARGET_MS => {
                    Ok(Some(Duration::from_secs_f64(ms / 1e3)))
                }
                _ => Err(ClassError {
                    header,
                    message: format!(
                        "{value:?} is not a number of milliseconds above 0 and at most \
                         {MAX_TARGET_MS} (an hour)"
                    ),
                }),
            }
        };
        Ok(RequestClass {
            priority,
            tenant,
            targets: Targets {
                ttft: millis(&TTFT_HEADERS)?,
                tpot: millis(&TPOT_HEADERS)?,
            },
        })
    }
}

/// The tenant of a request that names none: its API key's, or [`DEFAULT_TENANT`].
fn tenant_of_key(headers: &HeaderMap) -> Arc<str> {
    match headers.get(AUTHORIZATION) {
        Some(key) => Arc::from(key_tenant(key.as_bytes())),
        None => DEFAULT.clone(),
    }
}

/// The tenant of an API key: `key-` and a hash of it (the key itself is never kept or shown).
fn key_tenant(authorization: &[u8]) -> String {
    let mut hasher = foldhash::fast::FixedState::with_seed(0x7e).build_hasher();
    hasher.write(authorization);
    format!("key-{:016x}", hasher.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(pairs: &[(&'static str, &str)]) -> Result<RequestClass, ClassError> {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.insert(*name, value.parse().unwrap());
        }
        let objectives = BTreeMap::from([("interactive".into(), 2), ("batch".into(), -1)]);
        RequestClass::of(&headers, &objectives)
    }

    #[test]
    fn priority_tenant_and_targets_from_either_family_of_headers() {
        assert_eq!(class(&[]).unwrap(), RequestClass::default());
        let c = class(&[
            ("x-gateway-inference-objective", "interactive"),
            ("x-llm-d-inference-fairness-id", "team-a"),
            ("x-llm-d-slo-ttft-ms", "500"),
            ("x-slo-tpot-ms", "20.5"),
        ])
        .unwrap();
        assert_eq!(c.priority, 2);
        assert_eq!(&*c.tenant, "team-a");
        assert_eq!(c.targets.ttft, Some(Duration::from_millis(500)));
        assert_eq!(c.targets.tpot, Some(Duration::from_micros(20_500)));
        // x-pd-priority wins over the objective; an unknown objective is 0.
        let c = class(&[
            ("x-pd-priority", "-3"),
            ("x-llm-d-inference-objective", "interactive"),
        ])
        .unwrap();
        assert!(c.sheddable() && c.priority == -3);
        assert_eq!(
            class(&[("x-gateway-inference-objective", "other")])
                .unwrap()
                .priority,
            0
        );
        assert_eq!(
            class(&[("x-pd-priority", "99999999")]).unwrap().priority,
            1000
        );
    }

    #[test]
    fn the_api_key_names_a_tenant_without_showing_the_key() {
        let a = class(&[("authorization", "Bearer sk-secret-a")]).unwrap();
        let b = class(&[("authorization", "Bearer sk-secret-b")]).unwrap();
        assert_ne!(a.tenant, b.tenant);
        assert!(a.tenant.starts_with("key-") && !a.tenant.contains("secret"));
        let gateway = class(&[
            ("authorization", "Bearer sk-secret-a"),
            ("x-gateway-inference-fairness-id", "t1"),
        ])
        .unwrap();
        assert_eq!(&*gateway.tenant, "t1");
        // The same key's tenant with other headers beside it, `x-` ones or not.
        let other = class(&[
            ("authorization", "Bearer sk-secret-a"),
            ("x-request-id", "r1"),
            ("content-type", "application/json"),
        ])
        .unwrap();
        assert_eq!(other.tenant, a.tenant);
    }

    #[test]
    fn headers_that_cannot_mean_anything_are_named() {
        let err = class(&[("x-pd-priority", "high")]).unwrap_err();
        assert_eq!(err.header, X_PD_PRIORITY);
        let err = class(&[("x-llm-d-slo-ttft-ms", "-5")]).unwrap_err();
        assert_eq!(err.header, "x-llm-d-slo-ttft-ms");
        assert!(class(&[("x-pd-slo-tpot-ms", "0")]).is_err());
        assert!(class(&[("x-pd-slo-ttft-ms", "1e30")]).is_err());
        assert!(class(&[("x-pd-slo-ttft-ms", "NaN")]).is_err());
    }
}
