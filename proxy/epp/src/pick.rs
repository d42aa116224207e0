//! From a request Envoy holds (its path, headers and whole body) to where it goes: the
//! router's placement, the endpoint Envoy routes to (the decode; the only engine in a fleet
//! without prefills), and for a P/D request the prefill named for the decode's sidecar. A
//! request that cannot be placed is refused with the status the protocol asks for, in
//! OpenAI's error shape.

use std::time::{Duration, Instant};

use bytes::Bytes;
use envoy_types::pb::envoy::service::ext_proc::v3::HeaderMutation;
use http::header::AUTHORIZATION;
use http::HeaderMap;
use pd_router::admission::Shed;
use pd_router::backend::{AwaitingPrefill, Backend, Call};
use pd_router::body::Body;
use pd_router::models;
use pd_router::placement::Watch;
use pd_router::prompt_tokens::PromptKind;
use pd_router::routing::decision::Decision;
use pd_router::routing::queued_work::Pending;
use pd_router::routing::RequestInfo;
use pd_router::tenants::charge::{cost, rate_headers, retry_after, Api};
use pd_router::tenants::{LimitKind, Limited, Tenant};
use pd_router::validate;
use pd_router::{Facts, Router, Unplaceable, Unplaced};
use serde_json::json;

use crate::config::Destinations;
use crate::protocol::{in_subset, set_header, PREFILLER, PREFILL_DP_RANK};

/// Where a request goes, and what holds its place in the fleet's accounting while it runs.
pub struct Picked {
    /// The endpoint Envoy routes to (`ip:port`).
    pub endpoint: String,
    /// The headers to set or remove besides the destination.
    pub mutation: HeaderMutation,
    /// The body to send on when it changed (a model alias resolved).
    pub body: Option<Bytes>,
    /// Through P and D, or to one engine alone, and why.
    pub decision: Decision,
    /// The decode's call: counted in flight until the exchange ends.
    pub decode_call: Call,
    /// The prefill's call and the request's share of its queued work: until the answer begins
    /// (by then P has answered).
    pub prefill: Option<(Call, Option<Pending>)>,
    /// A streamed answer's latencies, watched to teach the engines' models.
    pub watch: Option<Watch>,
    /// The decode's count of requests waiting for their prefill: until the answer begins.
    pub awaiting: Option<AwaitingPrefill>,
}

/// A request refused: the status, the OpenAI-shaped body, and the metric label.
#[derive(Debug)]
pub struct Refused {
    /// The HTTP status.
    pub status: u16,
    /// The JSON body (OpenAI's error shape).
    pub body: serde_json::Value,
    /// Why, as the `result` label.
    pub reason: &'static str,
    /// The `Retry-After` to send, in seconds (a request refused under overload or by its
    /// tenant's limits).
    pub retry_after: Option<u64>,
    /// More headers of the answer (a tenant's `x-ratelimit-*`, `retry-after-ms`).
    pub headers: Vec<(String, String)>,
    /// The tenant's limit that refused it, if one did.
    pub limited: Option<LimitKind>,
}

impl Refused {
    /// A refusal with `status`, an error of `kind` saying `message` (OpenAI's shape, as
    /// pd-proxy's: `param` and `code` null).
    pub fn new(status: u16, kind: &str, message: &str, reason: &'static str) -> Self {
        let body =
            json!({"error": {"message": message, "type": kind, "param": null, "code": null}});
        Refused {
            status,
            body,
            reason,
            retry_after: None,
            headers: Vec::new(),
            limited: None,
        }
    }

    /// The same refusal naming the request field at fault.
    pub fn for_param(mut self, param: &str) -> Self {
        self.set_error_field("param", param);
        self
    }

    /// The same refusal with OpenAI's `code` word.
    pub fn with_code(mut self, code: &str) -> Self {
        self.set_error_field("code", code);
        self
    }

    fn set_error_field(&mut self, name: &str, value: &str) {
        self.body["error"][name] = value.into();
    }

    /// 429 in OpenAI's shape: over a limit of the tenant `tenant`.
    pub fn rate_limited(tenant: &str, limited: &Limited) -> Self {
        let kind = match limited.kind {
            LimitKind::Requests | LimitKind::Concurrency => "requests",
            LimitKind::PromptTokens | LimitKind::OutputTokens => "tokens",
        };
        let body = json!({"error": {
            "message": limited.message(tenant),
            "type": kind,
            "param": null,
            "code": "rate_limit_exceeded",
        }});
        let mut headers = rate_headers(&limited.status);
        let retry_after = limited.retry_after.map(|wait| {
            let (seconds, millis) = retry_after(wait);
            headers.push(("retry-after-ms".to_owned(), millis.to_string()));
            seconds
        });
        Refused {
            status: 429,
            body,
            reason: "rate_limited",
            retry_after,
            headers,
            limited: Some(limited.kind),
        }
    }

    /// 429 with `Retry-After`: refused under overload.
    pub fn overloaded(shed: &Shed) -> Self {
        let body = json!({"error": {
            "message": shed.message(),
            "type": "server_overloaded",
            "param": null,
            "code": shed.reason.as_str(),
        }});
        Refused {
            status: 429,
            body,
            reason: "overloaded",
            retry_after: Some(shed.retry_after_secs()),
            headers: Vec::new(),
            limited: None,
        }
    }
}

/// What a picker knows of a request when its body is complete.
pub struct Request<'a> {
    /// The request's path (without the query).
    pub path: &'a str,
    /// Its headers (pseudo-headers left out).
    pub headers: &'a HeaderMap,
    /// Its body (empty for a bodyless request).
    pub body: Bytes,
    /// The gateway's subset hint, when it sent one.
    pub subset: Option<&'a [String]>,
    /// The tenant its key names, when keys are configured.
    pub tenant: Option<&'a Tenant>,
}

/// Places `request` on `router`'s fleet, its decode reached at its `destinations`;
/// `adapter_timeout` bounds an adapter load.
pub async fn pick(
    router: &Router,
    destinations: &Destinations,
    request: Request<'_>,
    adapter_timeout: Duration,
) -> Result<Picked, Refused> {
    if request.subset.is_some_and(<[String]>::is_empty) {
        return Err(no_endpoint("the gateway's endpoint subset is empty"));
    }
    let subset = request.subset;
    let allowed =
        |backend: &Backend| subset.is_none_or(|s| in_subset(s, &destinations.of(backend)));
    let allowed: &(dyn Fn(&Backend) -> bool + Sync) = &allowed;
    let unusable = |err: pd_router::body::BodyError| {
        Refused::new(
            400,
            "invalid_request_error",
            &err.to_string(),
            "bad_request",
        )
    };
    let parsed = match request.body.is_empty() {
        true => None,
        false => Some(Body::parse(&request.body).map_err(unusable)?),
    };
    let by_lora_path = request.path == "/generate";
    let asked = (parsed.as_ref()).and_then(|body| models::requested(body, by_lora_path));
    let model = asked.as_deref().map(|m| router.models().canonical(m));
    let rewritten =
        (parsed.as_ref()).and_then(|body| models::aliased(body, asked.as_deref(), model));
    let bytes = rewritten.as_ref().unwrap_or(&request.body);
    let reparsed = match &rewritten {
        Some(bytes) => Some(Body::parse(bytes).map_err(unusable)?),
        None => None,
    };
    let Some(body) = reparsed.as_ref().or(parsed.as_ref()) else {
        // A bodyless request (a GET): any engine that takes requests.
        let decode = router
            .pick_decode_among(None, None, &RequestInfo::empty(), Some(allowed))
            .ok_or_else(|| no_endpoint("no engine is ready"))?;
        return Ok(Picked {
            endpoint: destinations.of(&decode),
            mutation: no_prefill(),
            body: None,
            decision: Decision::AGGREGATED,
            decode_call: decode.call(),
            prefill: None,
            watch: None,
            awaiting: None,
        });
    };
    let kind = match request.path {
        "/v1/chat/completions" => PromptKind::Chat,
        _ => PromptKind::Completion,
    };
    // What the engines would refuse, refused here with one answer naming the field.
    let context = || router.pool().context_length(model);
    // Only the completion APIs are checked; the others (embeddings, SGLang's own) go through.
    let api = Api::of_path(request.path);
    validate::check(body, api, context).map_err(|invalid| {
        Refused::new(
            400,
            "invalid_request_error",
            &invalid.message,
            "bad_request",
        )
        .for_param(invalid.param)
    })?;
    let mut class = router.classify(request.headers).map_err(|err| {
        Refused::new(
            400,
            "invalid_request_error",
            &err.to_string(),
            "bad_request",
        )
    })?;
    if let Some(tenant) = request.tenant {
        // The key's tenant is the request's fair share, whatever its headers say.
        class.tenant = tenant.name().clone();
        charge(tenant, api, body)?;
    }
    let tokens = router.tokens(kind, bytes, body).await;
    let deadline = Instant::now() + router.admission().config().max_wait;
    // Held until the request's calls are counted on its engines, below.
    let _admitted =
        (router.admit(&class, model, deadline).await).map_err(|shed| Refused::overloaded(&shed))?;
    let adapter = model.filter(|model| tokens.is_some() && router.is_adapter(model));
    let info = RequestInfo::new(body, request.headers)
        .with_tokens(tokens.as_deref())
        .with_adapter(adapter);
    let placement = router
        .place(&Facts {
            request: &info,
            model,
            authorization: request.headers.get(AUTHORIZATION),
            deadline: Instant::now() + adapter_timeout,
            decodes: Some(allowed),
            class: &class,
        })
        .await
        .map_err(|unplaced| match unplaced.why {
            Unplaceable::TargetsUnmet => {
                Refused::overloaded(&router.admission().shed_for_targets(&class))
            }
            _ => refusal(unplaced),
        })?;
    let streamed = body.flag("stream") == Some(true);
    let mut mutation = no_prefill();
    let prefill = placement.prefill.as_ref().map(|pair| {
        mutation = HeaderMutation {
            set_headers: vec![
                set_header(PREFILLER, pair.backend.address()),
                set_header(PREFILL_DP_RANK, &pair.dp_rank.to_string()),
            ],
            remove_headers: Vec::new(),
        };
        (pair.call(), info.take_prefill_work())
    });
    Ok(Picked {
        endpoint: destinations.of(&placement.decode),
        mutation,
        body: rewritten,
        decision: placement.decision,
        awaiting: prefill.as_ref().map(|_| placement.decode.await_prefill()),
        decode_call: placement.decode.call(),
        prefill,
        watch: streamed.then(|| placement.forecast.watch()),
    })
}

/// Charges the request's tokens to its tenant, or a 429 when they do not fit.
fn charge(tenant: &Tenant, api: Api, body: &Body<'_>) -> Result<(), Refused> {
    if !tenant.limits().any() {
        return Ok(());
    }
    let (prompt, output) = cost(api, body);
    match tenant.charge(prompt, output, Instant::now()) {
        Ok(_) => Ok(()),
        Err(limited) => Err(Refused::rate_limited(tenant.name(), &limited)),
    }
}

/// The sidecar's headers removed: a request no prefill serves carries none a client sent.
fn no_prefill() -> HeaderMutation {
    HeaderMutation {
        set_headers: Vec::new(),
        remove_headers: vec![PREFILLER.to_owned(), PREFILL_DP_RANK.to_owned()],
    }
}

/// 503: nothing eligible.
fn no_endpoint(message: &str) -> Refused {
    Refused::new(503, "service_unavailable", message, "unavailable")
}

/// What a request the router cannot place is told.
fn refusal(Unplaced { why, .. }: Unplaced) -> Refused {
    match why {
        Unplaceable::ModelNotFound { model, served } => {
            let served: Vec<&str> = served.iter().map(String::as_str).collect();
            let served = match served.is_empty() {
                true => vec!["none yet"],
                false => served,
            };
            Refused::new(
                404,
                "invalid_request_error",
                &format!(
                    "The model `{model}` does not exist here. Served models: {}.",
                    served.join(", ")
                ),
                "model_not_found",
            )
            .with_code("model_not_found")
            .for_param("model")
        }
        Unplaceable::NoPrefill { .. } => no_endpoint("no prefill is ready"),
        Unplaceable::NoDecode => no_endpoint("no decode is ready"),
        Unplaceable::NotInFleet { address } => {
            no_endpoint(&format!("{address} is not an engine of this fleet"))
        }
        Unplaceable::ModelUnavailable { model, side } => no_endpoint(&format!(
            "model `{model}`: no {} serving it is ready",
            side.as_str()
        )),
        Unplaceable::ModelMismatch { model, .. } => no_endpoint(&format!(
            "no ready decode serves model `{model}` of the prefill picked"
        )),
        Unplaceable::AdapterNotLoaded { model, reason } => no_endpoint(&format!(
            "model `{model}` is not loaded on a ready engine: {reason}"
        )),
        Unplaceable::TargetsUnmet => Refused::new(
            429,
            "server_overloaded",
            "no engine is predicted to meet the request's latency targets",
            "overloaded",
        ),
    }
}
