//! One request as Envoy processes it: an ext_proc stream, from the request's headers to the end
//! of its answer.
//!
//! The request phase: the headers are kept (nothing is answered yet), the body is buffered up to
//! `--max-body-bytes` (413 past it), and when it is complete (its last chunk, its trailers, or a
//! request without a body) the request is placed ([`crate::pick`]): the answer to its headers
//! names the endpoint, then its body goes back in chunks. When Envoy buffers the body itself
//! (`BUFFERED` mode) the headers are let through at once and the answer to the body names the
//! endpoint. A request that cannot be placed gets an
//! immediate answer and the stream ends. The response phase: the endpoint that served it is read
//! back, its headers and any body chunks and trailers are let through unchanged. The request's
//! calls are counted in flight until the stream ends (the prefill's until the answer begins),
//! so the policies see the load pd-epp placed.

use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use envoy_types::pb::envoy::config::core::v3::HeaderMap as EnvoyHeaders;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, ProcessingRequest, ProcessingResponse,
};
use http::{HeaderMap, HeaderName, HeaderValue};
use pd_router::metrics::CallOutcome;
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

use crate::pick::{self, Picked, Refused};
use crate::protocol;
use crate::state::Shared;
use pd_router::tenants::{Authentication, InFlight, Tenant};

/// How the request's body stands when it is placed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Body {
    /// It has none (its headers ended the stream).
    None,
    /// It is complete, and nothing follows it.
    Ends,
    /// It is complete, and trailers follow it.
    TrailersFollow,
}

/// Where the exchange stands.
enum Phase {
    /// Waiting for the request's body to end.
    Request,
    /// Routed: the answer's phase.
    Routed(Box<Picked>),
    /// Answered at once: nothing more to do.
    Done,
}

/// One ext_proc stream.
pub(crate) struct Exchange {
    shared: Arc<Shared>,
    out: mpsc::Sender<Result<ProcessingResponse, Status>>,
    path: String,
    headers: HeaderMap,
    body: BytesMut,
    subset: Option<Vec<String>>,
    phase: Phase,
    /// The answer's status, once its headers are seen.
    status: Option<u16>,
    /// Envoy buffers the body and sends it whole after the headers' answer (`BUFFERED`
    /// mode), instead of streaming it full duplex.
    buffered: bool,
    /// The answer's body comes full duplex (each chunk echoed), not as chunks to let through.
    duplex_answer: bool,
    /// The tenant its key names, when keys are configured.
    tenant: Option<Arc<Tenant>>,
    /// Its place among its tenant's requests in flight, until the stream ends.
    _in_flight: Option<InFlight>,
}

impl Exchange {
    /// An exchange answering on `out`.
    pub(crate) fn new(
        shared: Arc<Shared>,
        out: mpsc::Sender<Result<ProcessingResponse, Status>>,
    ) -> Self {
        Exchange {
            shared,
            out,
            path: String::new(),
            headers: HeaderMap::new(),
            body: BytesMut::new(),
            subset: None,
            phase: Phase::Request,
            status: None,
            buffered: false,
            duplex_answer: true,
            tenant: None,
            _in_flight: None,
        }
    }

    /// Runs the exchange until Envoy ends the stream (or an answer cannot be sent).
    pub(crate) async fn run(mut self, mut inbound: Streaming<ProcessingRequest>) {
        let exchanges = self.shared.metrics.exchanges().clone();
        exchanges.inc();
        while let Ok(Some(message)) = inbound.message().await {
            if self.handle(message).await.is_err() {
                break;
            }
        }
        exchanges.dec();
        if let Phase::Routed(picked) = self.phase {
            let outcome = match self.status {
                Some(status) if (200..300).contains(&status) => CallOutcome::Ok,
                Some(_) => CallOutcome::HttpError,
                None => CallOutcome::Cancelled,
            };
            if let (CallOutcome::Ok, Some(watch)) = (outcome, picked.watch) {
                watch.ended();
            }
            picked.decode_call.finish(outcome);
        }
    }

    /// Handles one message; an error means the stream is over.
    async fn handle(&mut self, message: ProcessingRequest) -> Result<(), ()> {
        let Some(request) = message.request else {
            return Ok(());
        };
        if self.subset.is_none() {
            self.subset = protocol::subset_hint(message.metadata_context.as_ref());
        }
        if let Some(config) = &message.protocol_config {
            self.buffered = config.request_body_mode == BodySendMode::Buffered as i32;
            self.duplex_answer =
                config.response_body_mode == BodySendMode::FullDuplexStreamed as i32;
        }
        match request {
            processing_request::Request::RequestHeaders(headers) => {
                self.keep_headers(headers.headers.as_ref());
                if let Err(refused) = self.authenticate() {
                    return self.refuse(refused).await;
                }
                match (headers.end_of_stream, self.buffered) {
                    (true, _) => self.route(Body::None).await,
                    (false, true) => self.send(protocol::headers_seen(false)).await,
                    (false, false) => Ok(()),
                }
            }
            processing_request::Request::RequestBody(body) => {
                if !matches!(self.phase, Phase::Request) {
                    return Ok(());
                }
                if self.body.len() + body.body.len() > self.shared.max_body_bytes {
                    let message = format!(
                        "the request body is larger than {} bytes (--max-body-bytes)",
                        self.shared.max_body_bytes
                    );
                    let refused = Refused::new(413, "invalid_request_error", &message, "too_large");
                    return self.refuse(refused).await;
                }
                self.body.extend_from_slice(&body.body);
                // A buffered body comes whole in one message (trailers, if any, after the
                // answer to it); a full-duplex one ends with its end of stream.
                match body.end_of_stream || self.buffered {
                    true => self.route(Body::Ends).await,
                    false => Ok(()),
                }
            }
            processing_request::Request::RequestTrailers(_) => {
                if matches!(self.phase, Phase::Request) {
                    self.route(Body::TrailersFollow).await?;
                }
                self.send(protocol::trailers_seen(false)).await
            }
            processing_request::Request::ResponseHeaders(headers) => {
                self.status = status_of(headers.headers.as_ref());
                self.answer_began(message.metadata_context.as_ref());
                self.send(protocol::headers_seen(true)).await
            }
            processing_request::Request::ResponseBody(body) => {
                if let Phase::Routed(picked) = &mut self.phase {
                    if let Some(watch) = &mut picked.watch {
                        watch.chunk(&body.body);
                    }
                }
                self.let_answer_through(body).await
            }
            processing_request::Request::ResponseTrailers(_) => {
                self.send(protocol::trailers_seen(true)).await
            }
        }
    }

    /// Lets a chunk of the answer through unchanged.
    async fn let_answer_through(
        &mut self,
        body: envoy_types::pb::envoy::service::ext_proc::v3::HttpBody,
    ) -> Result<(), ()> {
        match self.duplex_answer {
            true => {
                let chunk = protocol::streamed_body(&body.body, body.end_of_stream, true);
                self.send(chunk).await
            }
            false => self.send(protocol::body_seen(true)).await,
        }
    }

    /// Keeps the request's path and headers (the pseudo-headers' `:path` only).
    fn keep_headers(&mut self, headers: Option<&EnvoyHeaders>) {
        for header in headers.map(|h| h.headers.as_slice()).unwrap_or_default() {
            let value = protocol::header_value(header);
            if header.key == ":path" {
                let path = String::from_utf8_lossy(value);
                self.path = path.split('?').next().unwrap_or_default().to_owned();
                continue;
            }
            if header.key.starts_with(':') {
                continue;
            }
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(header.key.as_bytes()),
                HeaderValue::from_bytes(value),
            ) {
                self.headers.append(name, value);
            }
        }
    }

    /// When keys are configured: the tenant the request's key names, let in by its requests
    /// per second and requests in flight; else 401 or 429.
    fn authenticate(&mut self) -> Result<(), Refused> {
        let Some(tenants) = &self.shared.tenants else {
            return Ok(());
        };
        let tenant = match tenants.authenticate(&self.headers) {
            Authentication::Tenant(tenant) => tenant,
            Authentication::Missing | Authentication::Unknown => {
                return Err(Refused::new(
                    401,
                    "invalid_request_error",
                    "Incorrect API key provided: send it as `Authorization: Bearer <key>`",
                    "unauthorized",
                ))
            }
        };
        let metrics = self.shared.metrics.tenants();
        match tenant.arrive(Instant::now()) {
            Ok(in_flight) => {
                metrics.admitted(tenant.name());
                self._in_flight = Some(in_flight);
                self.tenant = Some(tenant);
                Ok(())
            }
            Err(limited) => {
                metrics.limited(tenant.name(), limited.kind);
                Err(Refused::rate_limited(tenant.name(), &limited))
            }
        }
    }

    /// Places the request and answers its headers (then sends its body back when it has one).
    async fn route(&mut self, body_is: Body) -> Result<(), ()> {
        let with_body = body_is != Body::None;
        let started = Instant::now();
        let body = std::mem::take(&mut self.body).freeze();
        let picked = pick::pick(
            &self.shared.router,
            &self.shared.destinations,
            pick::Request {
                path: &self.path,
                headers: &self.headers,
                body: body.clone(),
                subset: self.subset.as_deref(),
                tenant: self.tenant.as_deref(),
            },
            self.shared.adapter_timeout,
        )
        .await;
        let mut picked = match picked {
            Ok(picked) => picked,
            Err(refused) => return self.refuse(refused).await,
        };
        self.shared
            .metrics
            .picked(picked.decision, started.elapsed());
        let mutation = std::mem::take(&mut picked.mutation);
        let sent_body: Bytes = picked.body.clone().unwrap_or(body);
        tracing::debug!(path = %self.path, endpoint = %picked.endpoint, decision = picked.decision.path_label(), "picked");
        let changed = picked.body.is_some();
        let buffered = self.buffered && with_body;
        let mut mutation = mutation;
        if buffered && changed {
            // Envoy still holds the headers: they carry the replaced body's length, as GIE's
            // reference picker sets it (Envoy 1.40 also fixes it up itself; others may not).
            let length = sent_body.len().to_string();
            mutation
                .set_headers
                .push(protocol::set_header("content-length", &length));
        }
        let answer = protocol::route_to(
            &picked.endpoint,
            mutation,
            buffered,
            changed.then_some(&sent_body[..]),
        );
        self.phase = Phase::Routed(Box::new(picked));
        self.send(answer).await?;
        if with_body && !buffered {
            let ends = body_is == Body::Ends;
            for chunk in protocol::body_chunks(&sent_body, ends) {
                self.send(chunk).await?;
            }
        }
        Ok(())
    }

    /// The answer began: the prefill has answered (its call ends); where the gateway sent the
    /// request is counted.
    fn answer_began(
        &mut self,
        metadata: Option<&envoy_types::pb::envoy::config::core::v3::Metadata>,
    ) {
        let Phase::Routed(picked) = &mut self.phase else {
            return;
        };
        if let Some((call, _work)) = picked.prefill.take() {
            call.finish(CallOutcome::Ok);
        }
        picked.awaiting = None;
        let served = match protocol::served(metadata) {
            Some(endpoint) if endpoint == picked.endpoint => "picked",
            Some(_) => "elsewhere",
            None => "unreported",
        };
        self.shared.metrics.served(served);
    }

    /// Answers at once with `refused`; the stream is then over.
    async fn refuse(&mut self, refused: Refused) -> Result<(), ()> {
        self.shared.metrics.refused(refused.reason);
        tracing::debug!(path = %self.path, status = refused.status, reason = refused.reason, "refused");
        self.phase = Phase::Done;
        if let (Some(tenant), Some(limit)) = (&self.tenant, refused.limited) {
            self.shared.metrics.tenants().limited(tenant.name(), limit);
        }
        let retry_after = refused.retry_after.map(|s| s.to_string());
        let mut headers: Vec<(&str, &str)> = (retry_after.as_deref())
            .map(|value| ("retry-after", value))
            .into_iter()
            .collect();
        headers.extend(
            refused
                .headers
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_str())),
        );
        self.send(protocol::immediate(
            refused.status,
            &refused.body.to_string(),
            &headers,
        ))
        .await?;
        Err(())
    }

    async fn send(&self, response: ProcessingResponse) -> Result<(), ()> {
        self.out.send(Ok(response)).await.map_err(|_| ())
    }
}

/// The `:status` of the answer's headers.
fn status_of(headers: Option<&EnvoyHeaders>) -> Option<u16> {
    let headers = headers?.headers.iter();
    let status = headers.into_iter().find(|h| h.key == ":status")?;
    std::str::from_utf8(protocol::header_value(status))
        .ok()?
        .parse()
        .ok()
}
