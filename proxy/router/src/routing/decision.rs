//! Conditional disaggregation: whether a request goes through P and D, to a decode alone, or
//! nowhere, and why. Every decision is counted (`pd_proxy_route_decisions_total`) and, when the
//! client asks with an `x-pd-route` header, told in the answer's `x-pd-route` header.

use http::{HeaderName, HeaderValue};

use super::settings::{DecodeOnlyRules, Fallback};
use super::RequestInfo;

/// `x-pd-route`: sent by a client to ask why its request went where it went; answered with the
/// decision.
pub static X_PD_ROUTE: HeaderName = HeaderName::from_static("x-pd-route");

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// P computes the prompt's KV, D pulls it and generates.
    Disaggregated,
    /// D alone computes the prompt and generates; no KV moves.
    DecodeOnly,
    /// Nowhere: the client gets an error.
    Refused,
}

/// Why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Conditional disaggregation is off: every request goes through P and D.
    Unconditional,
    /// The prompt is long enough and no decode holds enough of it.
    LongPrompt,
    /// The prompt is shorter than `--decode-only-below-chars`.
    ShortPrompt,
    /// A decode already holds `--decode-only-prefix-share` of the prompt.
    PrefixHit,
    /// No prefill can take the request (none discovered, or none healthy).
    NoPrefillHealthy,
    /// The fleet has no prefills: its engines serve whole requests (an endpoint picker in
    /// front of aggregated engines).
    Aggregated,
    /// A gateway's endpoint picker chose (pd-proxy as a decode's sidecar): through the prefill
    /// it named, or the decode alone when it named none.
    Gateway,
    /// Several samples of one prompt (`n` or `best_of` above 1): vLLM's connectors key P's KV
    /// by the request, and D's samples each pull it, so the first pull to finish frees what
    /// the others still wait for.
    ParallelSampling,
}

/// A routing decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Where the request goes.
    pub path: Path,
    /// Why.
    pub reason: Reason,
}

impl Decision {
    /// Every decision that can be made, in the order of [`Decision::slot`].
    pub const ALL: [Decision; 10] = [
        Decision::new(Path::Disaggregated, Reason::Unconditional),
        Decision::new(Path::Disaggregated, Reason::LongPrompt),
        Decision::new(Path::DecodeOnly, Reason::ShortPrompt),
        Decision::new(Path::DecodeOnly, Reason::PrefixHit),
        Decision::new(Path::DecodeOnly, Reason::NoPrefillHealthy),
        Decision::new(Path::Refused, Reason::NoPrefillHealthy),
        Decision::AGGREGATED,
        Decision::new(Path::Disaggregated, Reason::Gateway),
        Decision::new(Path::DecodeOnly, Reason::Gateway),
        Decision::new(Path::DecodeOnly, Reason::ParallelSampling),
    ];

    /// To an engine alone, in a fleet without prefills.
    pub const AGGREGATED: Decision = Decision::new(Path::DecodeOnly, Reason::Aggregated);

    /// `path`, for `reason`.
    pub const fn new(path: Path, reason: Reason) -> Self {
        Decision { path, reason }
    }

    /// This decision's index in [`Decision::ALL`].
    pub fn slot(self) -> usize {
        Decision::ALL
            .iter()
            .position(|d| *d == self)
            .expect("ALL lists every decision")
    }

    /// The `decision` label.
    pub fn path_label(self) -> &'static str {
        match self.path {
            Path::Disaggregated => "disaggregated",
            Path::DecodeOnly => "decode_only",
            Path::Refused => "refused",
        }
    }

    /// The `reason` label.
    pub fn reason_label(self) -> &'static str {
        match self.reason {
            Reason::Unconditional => "unconditional",
            Reason::LongPrompt => "long_prompt",
            Reason::ShortPrompt => "short_prompt",
            Reason::PrefixHit => "prefix_hit",
            Reason::NoPrefillHealthy => "no_prefill_healthy",
            Reason::Aggregated => "aggregated",
            Reason::Gateway => "gateway",
            Reason::ParallelSampling => "parallel_sampling",
        }
    }

    /// The `x-pd-route` answer: the decision, the reason, the backends and `notes` (the picks
    /// made on the engines' KV events), e.g. `decision=disaggregated; reason=long_prompt;
    /// prefill=http://p:8100; dp_rank=1; decode=http://d:8200`.
    pub fn header(
        self,
        prefill: Option<(&str, u32)>,
        decode: Option<&str>,
        notes: &str,
    ) -> HeaderValue {
        let mut text = format!(
            "decision={}; reason={}",
            self.path_label(),
            self.reason_label()
        );
        if let Some((url, dp_rank)) = prefill {
            text.push_str(&format!("; prefill={url}; dp_rank={dp_rank}"));
        }
        if let Some(url) = decode {
            text.push_str(&format!("; decode={url}"));
        }
        text.push_str(notes);
        HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static("decision=?"))
    }
}

/// The rules that may send a request to a decode alone before any prefill is picked: always
/// when it asks for several samples, else the operator's (`decode_share` is what the decode
/// policy knows of the prompt, called only when a prefix rule is set).
pub fn before_pick(
    rules: &DecodeOnlyRules,
    request: &RequestInfo<'_>,
    decode_share: impl FnOnce() -> Option<f64>,
) -> Option<Decision> {
    if request.samples_several() {
        return Some(Decision::new(Path::DecodeOnly, Reason::ParallelSampling));
    }
    if rules.below_chars > 0 && request.prompt_chars() < rules.below_chars {
        return Some(Decision::new(Path::DecodeOnly, Reason::ShortPrompt));
    }
    let wanted = rules.prefix_share?;
    match decode_share() {
        Some(share) if share >= wanted && share > 0.0 => {
            Some(Decision::new(Path::DecodeOnly, Reason::PrefixHit))
        }
        _ => None,
    }
}

/// The decision once the prefill pick is known: through P and D when there is a prefill; when
/// there is none, to a decode alone only if the operator allowed it (`--fallback decode-only`).
pub fn after_pick(rules: &DecodeOnlyRules, found_prefill: bool) -> Decision {
    let conditional = rules.below_chars > 0 || rules.prefix_share.is_some();
    match (found_prefill, rules.fallback) {
        (true, _) if conditional => Decision::new(Path::Disaggregated, Reason::LongPrompt),
        (true, _) => Decision::new(Path::Disaggregated, Reason::Unconditional),
        (false, Fallback::DecodeOnly) => Decision::new(Path::DecodeOnly, Reason::NoPrefillHealthy),
        (false, Fallback::None) => Decision::new(Path::Refused, Reason::NoPrefillHealthy),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;

    fn rules(below_chars: usize, prefix_share: Option<f64>, fallback: Fallback) -> DecodeOnlyRules {
        DecodeOnlyRules {
            below_chars,
            prefix_share,
            fallback,
        }
    }

    #[test]
    fn short_prompts_and_held_prefixes_skip_prefill() {
        let body = crate::body::Body::parse(br#"{"prompt":"hello there"}"#).unwrap();
        let headers = HeaderMap::new();
        let request = RequestInfo::new(&body, &headers);
        let short = before_pick(&rules(20, None, Fallback::None), &request, || None);
        assert_eq!(short.map(Decision::reason_label), Some("short_prompt"));
        assert_eq!(
            before_pick(&rules(5, None, Fallback::None), &request, || None),
            None
        );
        let held = before_pick(&rules(0, Some(0.8), Fallback::None), &request, || Some(0.9));
        assert_eq!(held.map(Decision::reason_label), Some("prefix_hit"));
        let cold = before_pick(&rules(0, Some(0.8), Fallback::None), &request, || Some(0.5));
        assert_eq!(cold, None);
        // Off by default: nothing is asked of the decode policy.
        let off = before_pick(&DecodeOnlyRules::default(), &request, || unreachable!());
        assert_eq!(off, None);
    }

    #[test]
    fn several_samples_of_a_prompt_go_to_a_decode_alone_whatever_the_rules() {
        let decide = |raw: &str| {
            let body = crate::body::Body::parse(raw.as_bytes()).unwrap();
            let headers = HeaderMap::new();
            let request = RequestInfo::new(&body, &headers);
            let decision = before_pick(&DecodeOnlyRules::default(), &request, || None);
            decision.map(Decision::reason_label)
        };
        for several in [r#"{"n": 2}"#, r#"{"n": "3"}"#, r#"{"best_of": 2, "n": 1}"#] {
            assert_eq!(decide(several), Some("parallel_sampling"), "{several}");
        }
        for one in [
            r#"{"n": 1}"#,
            r#"{"n": null}"#,
            r#"{"best_of": 1}"#,
            r#"{}"#,
        ] {
            assert_eq!(decide(one), None, "{one}");
        }
    }

    #[test]
    fn without_a_prefill_only_the_fallback_allows_decode_only() {
        let refused = after_pick(&DecodeOnlyRules::default(), false);
        assert_eq!(refused.path, Path::Refused);
        let fallback = after_pick(&rules(0, None, Fallback::DecodeOnly), false);
        assert_eq!(
            (fallback.path_label(), fallback.reason_label()),
            ("decode_only", "no_prefill_healthy")
        );
        assert_eq!(
            after_pick(&DecodeOnlyRules::default(), true).reason,
            Reason::Unconditional
        );
        assert_eq!(
            after_pick(&rules(100, None, Fallback::None), true).reason,
            Reason::LongPrompt
        );
        for (slot, decision) in Decision::ALL.iter().enumerate() {
            assert_eq!(decision.slot(), slot);
        }
    }

    #[test]
    fn the_header_names_the_backends() {
        let decision = after_pick(&DecodeOnlyRules::default(), true);
        let header = decision.header(Some(("http://p:1", 1)), Some("http://d:2"), "");
        assert_eq!(
            header,
            "decision=disaggregated; reason=unconditional; prefill=http://p:1; dp_rank=1; decode=http://d:2"
        );
    }
}
