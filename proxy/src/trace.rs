//! A request's trace: with traces on ([`pd_service::traces`]), each proxied request continues
//! the client's W3C trace (`traceparent`) or starts one, as a server span named after its
//! route, with a child span per phase: `pick` (choosing P and D), `prefill` (P's call, until
//! it answers), `decode` (D's call, until its first byte) and `relay` (D's answer to the
//! client). P and D get the context of their phase's span, so an engine started with
//! `--otlp-traces-endpoint` continues the same trace. The request span carries the routing
//! decision, the backends, the transfer id, the model and the outcome.
//!
//! With traces off nothing here runs but [`pass_through`]: the tracker holds no
//! [`RequestTrace`], every call site checks for one first, and a client's context is handed to
//! P and D as it came, so that engines' traces still join the client's.

use std::borrow::Cow;
use std::time::SystemTime;

use axum::http::{HeaderMap, HeaderName};
use opentelemetry::global::BoxedTracer;
use opentelemetry::trace::{Span, SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue};
use pd_protocol::Rank;

use crate::metrics::Outcome;
use crate::route::Route;
use pd_router::routing::decision::Decision;

/// Copies the client's `traceparent` and `tracestate` (if any) into `to`, as they came.
pub(crate) fn pass_through(from: &HeaderMap, to: &mut HeaderMap) {
    for name in [TRACEPARENT, TRACESTATE] {
        if let Some(value) = from.get(&name) {
            to.insert(name, value.clone());
        }
    }
}

const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// The trace of one request: its span, in a context its phases are children of.
pub(crate) struct RequestTrace {
    tracer: BoxedTracer,
    context: Context,
    relay: Option<Context>,
}

impl RequestTrace {
    /// Starts the request's span, child of the context `headers` carry (if any).
    pub(crate) fn start(headers: &HeaderMap, route: Route) -> Self {
        let parent = pd_service::traces::extract(headers);
        let tracer = pd_service::traces::tracer();
        let span = tracer
            .span_builder(route.span_name())
            .with_kind(SpanKind::Server)
            .with_attributes([
                KeyValue::new("http.request.method", "POST"),
                KeyValue::new("http.route", route.path()),
            ])
            .start_with_context(&tracer, &parent);
        RequestTrace {
            tracer,
            context: parent.with_span(span),
            relay: None,
        }
    }

    /// Records the pick (begun at `started`) and its result on the request.
    pub(crate) fn picked(
        &self,
        started: SystemTime,
        decision: Decision,
        prefill: Option<(&str, Rank)>,
        decode: Option<&str>,
        model: Option<&str>,
    ) {
        let mut attributes = vec![
            KeyValue::new("pd.decision", decision.path_label()),
            KeyValue::new("pd.reason", decision.reason_label()),
        ];
        if let Some((url, rank)) = prefill {
            attributes.push(KeyValue::new("pd.prefill", url.to_owned()));
            attributes.push(KeyValue::new("pd.prefill.dp_rank", i64::from(rank)));
        }
        if let Some(url) = decode {
            attributes.push(KeyValue::new("pd.decode", url.to_owned()));
        }
        if let Some(model) = model {
            attributes.push(KeyValue::new("gen_ai.request.model", model.to_owned()));
        }
        let tracer = &self.tracer;
        let mut pick = tracer
            .span_builder("pick")
            .with_start_time(started)
            .with_attributes(attributes.clone())
            .start_with_context(tracer, &self.context);
        pick.end();
        self.context.span().set_attributes(attributes);
    }

    /// Records the transfer id P and D share.
    pub(crate) fn transfer(&self, transfer_id: &str) {
        let id = KeyValue::new("pd.transfer_id", transfer_id.to_owned());
        self.context.span().set_attribute(id);
    }

    /// Starts a phase's span (`prefill`, `decode`) calling `backend`.
    pub(crate) fn phase(&self, name: &'static str, backend: &str) -> Phase {
        let tracer = &self.tracer;
        let span = tracer
            .span_builder(name)
            .with_kind(SpanKind::Client)
            .with_attributes([KeyValue::new("server.address", backend.to_owned())])
            .start_with_context(tracer, &self.context);
        Phase(self.context.with_span(span))
    }

    /// D's answer began: the relay to the client starts.
    pub(crate) fn relaying(&mut self) {
        let tracer = &self.tracer;
        let span = tracer.start_with_context("relay", &self.context);
        self.relay = Some(self.context.with_span(span));
    }

    /// Ends the relay (if any) and the request with `outcome`.
    pub(crate) fn finish(&mut self, outcome: Outcome) {
        let failed = !matches!(outcome, Outcome::Ok);
        if let Some(relay) = self.relay.take() {
            if failed {
                relay.span().set_status(Status::error(outcome.as_str()));
            }
            relay.span().end();
        }
        let span = self.context.span();
        span.set_attribute(KeyValue::new("pd.outcome", outcome.as_str()));
        if failed {
            span.set_status(Status::error(outcome.as_str()));
        }
        span.end();
    }
}

/// One phase's span, whose context the backend it calls is given.
pub(crate) struct Phase(Context);

impl Phase {
    /// Writes the phase's `traceparent` into the headers of its call.
    pub(crate) fn inject(&self, headers: &mut HeaderMap) {
        pd_service::traces::inject(&self.0, headers);
    }

    /// Ends the phase: `error` says why it failed, if it did.
    pub(crate) fn end(self, error: Option<Cow<'static, str>>) {
        let span = self.0.span();
        if let Some(error) = error {
            span.set_status(Status::Error { description: error });
        }
        span.end();
    }
}
