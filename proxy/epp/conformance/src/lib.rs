//! A black-box checker of the Gateway API Inference Extension's endpoint picker protocol (its
//! proposal 004, as Envoy and the reference picker run it). It plays Envoy against any picker
//! over ext_proc and checks the protocol's rules, one line per rule, with no cluster: the
//! picker only needs a pool of endpoints it considers ready.
//!
//! The rules: a request is routed once its body is complete, the endpoint in the
//! `x-gateway-destination-endpoint` header and the `envoy.lb` metadata alike, as one `ip:port`,
//! with the route cache cleared; the body comes back whole (split or not, small or large); a
//! bodyless request is routed at once; a subset hint binds the choice (as a list, and as the
//! comma-separated string Envoy's `header_to_metadata` makes), an empty or ineligible subset is
//! an immediate 503; a broken body an immediate 4xx; the answer phase goes through; gRPC health
//! answers for `liveness`, `readiness` and the ext_proc service.

mod exchange;
pub mod rules;

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::Value;
use tonic::transport::Channel;

pub use exchange::{connect, Exchange, ExchangeError};

/// A client of a picker's ext_proc service.
pub type Client = ExternalProcessorClient<Channel>;

/// The header and `envoy.lb` key of the picked endpoint.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata namespace of the destination.
pub const LB: &str = "envoy.lb";
/// The metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key of the subset hint.
pub const SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// The `envoy.lb` key of the endpoint that served the request.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";

/// An address nothing serves (TEST-NET-1): a subset of it has no eligible endpoint.
const NOWHERE: &str = "192.0.2.1:9";

fn string(text: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(text.to_owned())),
    }
}

/// The picker under test.
pub struct Checker {
    /// `http://host:port` of its ext_proc service.
    pub endpoint: String,
    /// The `model` of the requests sent (none: no `model` field).
    pub model: Option<String>,
    /// How long one answer may take.
    pub wait: Duration,
    client: ExternalProcessorClient<Channel>,
}

/// One rule's result.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// The rule.
    pub rule: &'static str,
    /// What was seen when it holds, why not when it fails.
    pub outcome: Result<String, String>,
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.outcome {
            Ok(note) => write!(f, "PASS  {}: {note}", self.rule),
            Err(why) => write!(f, "FAIL  {}: {why}", self.rule),
        }
    }
}

impl Checker {
    /// Connects to the picker at `addr` (`host:port`).
    pub async fn connect(
        addr: &str,
        model: Option<String>,
        wait: Duration,
    ) -> Result<Self, ExchangeError> {
        let endpoint = format!("http://{addr}");
        let client = exchange::connect(&endpoint).await?;
        Ok(Checker {
            endpoint,
            model,
            wait,
            client,
        })
    }

    /// A new stream, with `metadata` on every message.
    pub async fn open(&mut self, metadata: Option<Metadata>) -> Result<Exchange, String> {
        Exchange::open(&mut self.client, metadata, self.wait)
            .await
            .map_err(|e| e.to_string())
    }

    /// Checks every rule, in order, reporting each verdict to `report` as it comes.
    pub async fn run(&mut self, mut report: impl FnMut(&Verdict)) -> Vec<Verdict> {
        let mut verdicts = Vec::new();
        let mut note = |rule: &'static str, outcome: Result<String, String>| {
            let verdict = Verdict { rule, outcome };
            report(&verdict);
            verdicts.push(verdict);
        };
        note(
            "health: liveness, readiness and the ext_proc service are SERVING",
            rules::reports_health(self).await,
        );
        note("a complete request is routed in the header and the envoy.lb metadata alike, one ip:port", rules::routes_in_header_and_metadata(self).await);
        note(
            "the headers answer clears the route cache",
            rules::clears_the_route_cache(self).await,
        );
        note(
            "the body comes back whole after the headers answer (HTTP/2: data and end at once)",
            rules::returns_the_body(self, 64, 1).await,
        );
        note(
            "a body in several chunks comes back whole",
            rules::returns_the_body(self, 4096, 4).await,
        );
        note(
            "a body larger than one message comes back whole, in chunks",
            rules::returns_the_body(self, 300_000, 3).await,
        );
        note(
            "a request without a body is routed at once",
            rules::routes_a_bodyless_request(self).await,
        );
        let endpoints = rules::discover(self).await;
        let listed = endpoints
            .as_ref()
            .map(|e| e.iter().cloned().collect::<Vec<_>>().join(" "));
        note(
            "the pool: endpoints seen over 16 requests",
            listed.clone().map_err(|e| e.clone()),
        );
        match &endpoints {
            Ok(endpoints) => {
                note(
                    "a subset hint (a list) binds the choice",
                    rules::honours_the_subset(self, endpoints, true).await,
                );
                note("a subset hint (a comma-separated string, as Envoy's header_to_metadata makes) binds the choice", rules::honours_the_subset(self, endpoints, false).await);
            }
            Err(why) => {
                note(
                    "a subset hint (a list) binds the choice",
                    Err(format!("no pool: {why}")),
                );
                note(
                    "a subset hint (a comma-separated string) binds the choice",
                    Err(format!("no pool: {why}")),
                );
            }
        }
        note(
            "an empty subset is an immediate 503",
            rules::refuses_an_empty_subset(self, &[]).await,
        );
        note(
            "a subset with no eligible endpoint is an immediate 503",
            rules::refuses_an_empty_subset(self, &[NOWHERE]).await,
        );
        note(
            "a body that is not JSON is an immediate 4xx",
            rules::refuses_a_broken_body(self).await,
        );
        note(
            "the answer phase goes through (headers answered, body chunks echoed)",
            rules::lets_the_answer_through(self).await,
        );
        verdicts
    }
}
