//! The second stage: where the request goes. The prompt is tokenized when a policy routes on the
//! engines' KV events, the request is admitted ([`pd_router::Router::admit`]: at once, after
//! waiting its turn, or refused with 429), the router places it ([`pd_router::Router::place`]), its
//! decision is counted and traced, and told in `x-pd-route` when the client asked. A request
//! that cannot be placed gets OpenAI's error shape here.

use std::time::SystemTime;

use axum::http::header::AUTHORIZATION;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::IntoResponse;
use bytes::Bytes;
use pd_router::backend::{Backend, Reservation};
use pd_router::body::Body;
use pd_router::routing::decision::X_PD_ROUTE;
use pd_router::routing::queued_work::Pending;
use pd_router::routing::RequestInfo;
use pd_router::{Facts, Placement, Unplaceable, Unplaced};

use super::failure::{no_decode, no_prefill, overloaded, refused, Refusal};
use super::Request;
use crate::error::ApiError;
use crate::metrics::Outcome;
use crate::models::ModelHandles;
use crate::trace::RequestTrace;

/// A placed request, and what placing it found that the dispatch needs.
pub(super) struct Placed {
    /// Where it goes.
    pub placement: Placement,
    /// The prompt's token ids, when a policy needed them (for D's retry).
    pub tokens: Option<Vec<u32>>,
    /// Whether the model is a LoRA adapter whose blocks a policy matches (tokens known).
    pub adapter: bool,
    /// The request's share of its prefill's queued work (precise_prefix), until P's call ends.
    pub prefill_work: Option<Pending>,
    /// The decision for the answer's `x-pd-route` (when the client asked).
    pub route_header: Option<HeaderValue>,
    /// The request counted in flight on its decode and prefill until their calls are made.
    pub reserved: Reserved,
}

/// A placed request's reservations, each dropped when its call is made.
pub(super) struct Reserved {
    /// On the decode.
    pub decode: Option<Reservation>,
    /// On the prefill.
    pub prefill: Option<Reservation>,
}

/// Places `request` (its body `body`, parsed from `raw`).
pub(super) async fn place(
    request: &Request<'_>,
    raw: &Bytes,
    body: &Body<'_>,
    handles: &ModelHandles,
    trace: Option<&RequestTrace>,
) -> Result<Placed, Refusal> {
    let (router, model) = (&request.state.router, request.model);
    let tokens = router.tokens(request.route.prompt_kind(), raw, body).await;
    // Admitted once the prompt is tokenized, so that the queue lets the next request in as soon
    // as this one's engines count it; held until they do (its reservations, below). A
    // continuation was admitted as its request.
    let admitted = match request.state.sidecar || request.continued {
        true => None,
        false => Some(
            (router.admit(request.class, model, request.deadline).await)
                .map_err(|shed| overloaded(&shed))?,
        ),
    };
    let adapter = model.filter(|model| tokens.is_some() && router.is_adapter(model));
    let info = RequestInfo::new(body, request.headers)
        .with_tokens(tokens.as_deref())
        .with_adapter(adapter);
    let pick_started = trace.map(|_| SystemTime::now());
    let avoid = request.avoid;
    let other = |decode: &Backend| !avoid.iter().any(|failed| std::ptr::eq(&**failed, decode));
    let facts = Facts {
        request: &info,
        model,
        authorization: request.headers.get(AUTHORIZATION),
        deadline: request.deadline,
        decodes: match avoid.is_empty() {
            true => None,
            false => Some(&other),
        },
        class: request.class,
    };
    let placed = match request.state.sidecar {
        true => router.place_named(&facts, named_prefill(request.headers)?),
        false => router.place(&facts).await,
    };
    let decision = match &placed {
        Ok(placement) => Some(placement.decision),
        Err(unplaced) => unplaced.decision,
    };
    if let Some(decision) = decision {
        handles.decisions.count(decision);
    }
    let explain = request.headers.contains_key(&X_PD_ROUTE);
    let placement = match placed {
        Ok(placement) => placement,
        Err(Unplaced { decision, why }) => {
            let header = decision
                .filter(|_| explain)
                .map(|d| d.header(None, None, ""));
            if why == Unplaceable::TargetsUnmet {
                let shed = router.admission().shed_for_targets(request.class);
                return Err(explained(overloaded(&shed), header));
            }
            return Err(explained(refusal(why), header));
        }
    };
    let prefill = (placement.prefill.as_ref()).map(|p| (p.backend.url(), p.dp_rank));
    let decode = placement.decode.url();
    if let (Some(trace), Some(started)) = (trace, pick_started) {
        trace.picked(started, placement.decision, prefill, Some(decode), model);
    }
    let route_header = explain.then(|| {
        let notes = match model {
            Some(model) => format!("; model={model}{}", info.pick_notes()),
            None => info.pick_notes(),
        };
        placement.decision.header(prefill, Some(decode), &notes)
    });
    let prefill_work = info.take_prefill_work();
    let adapter = adapter.is_some();
    drop(info);
    let reserved = Reserved {
        decode: Some(placement.decode.reserve()),
        prefill: (placement.prefill.as_ref()).map(|pair| pair.backend.reserve()),
    };
    drop(admitted);
    Ok(Placed {
        placement,
        tokens,
        adapter,
        prefill_work,
        route_header,
        reserved,
    })
}

/// llm-d's header naming the prefill a gateway's endpoint picker chose (`host:port`; the
/// first of a list).
pub(crate) const PREFILLER: &str = "x-prefiller-host-port";
/// pd-epp's header beside it: the prefill's dp rank.
pub(crate) const PREFILL_DP_RANK: &str = "x-pd-prefill-dp-rank";

/// The prefill (and dp rank) the gateway named for this sidecar, if it named one.
fn named_prefill(headers: &HeaderMap) -> Result<Option<(&str, Option<u32>)>, Refusal> {
    let bad = |message: String| {
        refused(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            message,
            Outcome::BadRequest,
        )
    };
    let Some(value) = headers.get(PREFILLER) else {
        return Ok(None);
    };
    let text = value
        .to_str()
        .map_err(|_| bad(format!("{PREFILLER} is not text")))?;
    let address = text.split(',').next().unwrap_or_default().trim();
    if address.is_empty() {
        return Ok(None);
    }
    let dp_rank = match headers.get(PREFILL_DP_RANK) {
        None => None,
        Some(rank) => Some(
            (rank.to_str().ok())
                .and_then(|rank| rank.trim().parse().ok())
                .ok_or_else(|| bad(format!("{PREFILL_DP_RANK} is not a dp rank")))?,
        ),
    };
    Ok(Some((address, dp_rank)))
}

/// What a request that cannot be placed is told.
fn refusal(why: Unplaceable) -> Refusal {
    match why {
        Unplaceable::NoPrefill { none_known } => no_prefill(none_known),
        Unplaceable::NoDecode => no_decode(),
        Unplaceable::ModelUnavailable { model, side } => Refusal {
            response: Box::new(crate::models::unavailable(&model, side.as_str()).into_response()),
            outcome: Outcome::Unavailable,
            replaceable: None,
        },
        Unplaceable::ModelNotFound { model, served } => Refusal {
            response: Box::new(crate::models::not_found(&model, &served).into_response()),
            outcome: Outcome::ModelNotFound,
            replaceable: None,
        },
        Unplaceable::ModelMismatch {
            model,
            prefill,
            dp_rank,
        } => Refusal::from((
            ApiError::unavailable(format!(
                "no healthy decode serves model {model:?}, which the chosen prefill serves: P \
                 and D of different models are never paired (see GET /ready)"
            ))
            .failed_at(format!("prefill {prefill} (dp rank {dp_rank})")),
            Outcome::ModelMismatch,
        )),
        Unplaceable::NotInFleet { address } => refused(
            StatusCode::FORBIDDEN,
            "permission_error",
            format!(
                "{PREFILLER} names {address}, which is not a prefill of this proxy's fleet: \
                 a sidecar only calls the prefills it knows"
            ),
            Outcome::BadRequest,
        ),
        Unplaceable::AdapterNotLoaded { model, reason } => refused(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            format!("model `{model}` is not loaded on a ready prefill and decode: {reason}"),
            Outcome::Unavailable,
        ),
        Unplaceable::TargetsUnmet => refused(
            StatusCode::TOO_MANY_REQUESTS,
            "server_overloaded",
            "no engine is predicted to meet the request's latency targets".into(),
            Outcome::Overloaded,
        ),
    }
}

/// `refusal` with the `x-pd-route` header when the client asked.
pub(super) fn explained(mut refusal: Refusal, route: Option<HeaderValue>) -> Refusal {
    if let Some(route) = route {
        refusal
            .response
            .headers_mut()
            .insert(X_PD_ROUTE.clone(), route);
    }
    refusal
}
