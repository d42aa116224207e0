//! Calling D, and the one retry on another decode when D fails before its first byte, while
//! P's call (concurrent mode) is watched: if P fails first, D is dropped (cancelled) and the
//! client is told at once; if P ends before its length cap (so sent no KV), D is dropped and
//! the same decode serves the request alone, computing the prompt itself. D's first byte is due `--decode-first-byte-timeout` after P's
//! answer, everything before the request's deadline; a call that ran out of time is never made
//! again, and a retry never goes to the decode that failed, except once when the registry
//! shows that the pair's engine re-registered under a new id (see `unknown_engine.rs`).

use std::future::pending;
use std::sync::Arc;
use std::time::Instant;

use axum::http::HeaderMap;
use bytes::Bytes;

use super::prefill_finish::{prefill_stopped, stopped_before_cap};
use super::unknown_engine::registered_instead;
use crate::flow::failure::{decode_refusal, Refusal};
use crate::metrics::RouteMetrics;
use crate::relay::{Failure, PrefillCall};
use crate::route::Route;
use crate::state::Shared;
use crate::upstream::{DecodeStart, UpstreamError};
use pd_router::backend::{AwaitingPrefill, Backend, Call, Pair, Reservation};
use pd_router::routing::RequestInfo;

/// One request's call to D: what D is sent, and what it races.
pub(super) struct DecodeCall<'a> {
    /// What the handlers share.
    pub state: &'a Shared,
    /// The route called.
    pub route: Route,
    /// The model D must serve (the request's, else its prefill's), if known.
    pub model: Option<&'a str>,
    /// The route's metrics for the request's model.
    pub metrics: &'a RouteMetrics,
    /// The prefill D pulls from (none when D serves the request alone).
    pub pair: Option<&'a Pair>,
    /// The decode chosen first.
    pub decode: Arc<Backend>,
    /// The headers D gets.
    pub common: &'a HeaderMap,
    /// D's body.
    pub body: Bytes,
    /// The request, for the decode policy should D be retried.
    pub request: &'a RequestInfo<'a>,
    /// When the whole request must be over.
    pub deadline: Instant,
    /// P's call while it runs (concurrent mode).
    pub prefill: Option<PrefillCall>,
    /// When P answered, if it has (sequential mode: before D is called).
    pub prefilled: Option<Instant>,
    /// Whether D streams its answer. Only then is its first byte due
    /// `--decode-first-byte-timeout` after P's answer: a whole answer's first byte comes when
    /// all of it is generated, so only the request's deadline bounds it.
    pub streamed: bool,
    /// D's body for another engine id of the pair (concurrent mode), for when D failed because
    /// the pair's engine re-registered under a new id.
    pub reroute: Option<&'a (dyn Fn(&str) -> Bytes + Sync)>,
    /// D's body to serve the request alone, for when P's answer ended before its length cap
    /// (vLLM's modes: its connectors then send no KV); none where P's finish tells nothing of
    /// its KV (SGLang's P sends it whatever the token).
    pub alone: Option<&'a (dyn Fn() -> Bytes + Sync)>,
    /// P's finish reason once its answer came, ending before its length cap (with `alone`).
    pub stopped: Option<String>,
    /// The request counted on the decode until D's call is made.
    pub reserved: Option<Reservation>,
    /// D's call counted among the decode's requests waiting for their prefill, while P runs.
    pub awaiting: Option<AwaitingPrefill>,
    /// Decodes a retry must not go to (they failed the request before).
    pub avoid: &'a [Arc<Backend>],
}

/// D's answer has begun.
pub(super) struct Decoding {
    /// D's status and first bytes.
    pub answer: DecodeStart,
    /// D's call, to be finished when its answer ends.
    pub call: Call,
    /// P's call when it is still running.
    pub prefill: Option<PrefillCall>,
}

/// Sends the body to the decode (and once more to another decode if that fails retryably
/// before its first byte), racing P's call when it runs.
pub(super) async fn decode_with_retry(mut call: DecodeCall<'_>) -> Result<Decoding, Refusal> {
    let state = call.state;
    let mut decode = call.decode.clone();
    let (mut retried, mut rerouted) = (false, false);
    loop {
        let counted = decode.call();
        drop(call.reserved.take());
        call.awaiting = call.prefill.as_ref().map(|_| decode.await_prefill());
        let issued = Instant::now();
        let first = first_byte(&mut call, &decode).await;
        call.awaiting = None;
        let err = match first? {
            None => {
                // No KV will come: D's call is dropped (cancelled) and made again without
                // transfer instructions, once; it is not D's failure, so not a retry.
                drop(counted);
                let alone = call
                    .alone
                    .take()
                    .expect("only checked with a body to serve alone");
                let reason = call.stopped.take().unwrap_or_default();
                if let Some(pair) = call.pair {
                    prefill_stopped(call.metrics, pair, &decode, &reason);
                }
                call.body = alone();
                (call.pair, call.reroute, call.prefilled) = (None, None, None);
                continue;
            }
            Some(answer) => answer,
        };
        let err = match err {
            Ok(answer) => {
                counted.progressed();
                let waited = answer.first_at.saturating_duration_since(issued);
                call.metrics.decode_first_byte(waited);
                return Ok(Decoding {
                    answer,
                    call: counted,
                    prefill: call.prefill.take(),
                });
            }
            Err(err) => err,
        };
        counted.finish(err.outcome());
        if let (Some(pair), Some(reroute), false) = (call.pair, call.reroute, rerouted) {
            if err.may_be_unknown_engine() {
                let lookup = registered_instead(state, pair, call.deadline);
                let found = while_prefilling(&mut call, lookup).await?;
                if let Some(engine) = found.filter(|_| state.router.may_retry("unknown_engine")) {
                    // D is not at fault: the same decode, told the engine's new id.
                    call.body = reroute(&engine);
                    rerouted = true;
                    call.metrics.engine_reroute();
                    continue;
                }
            }
        }
        let prefilled = call.prefilled.is_some() && call.pair.is_some();
        if prefilled && err.broke_while_working() && state.migration.limit > 0 {
            // D went away after P answered: it may have pulled P's KV (P frees it then), so a
            // fresh placement, P included, serves the request, not a retry of the transfer.
            let mut refusal = decode_refusal(&decode, err);
            refusal.replaceable = Some(decode);
            return Err(refusal);
        }
        if !retried && err.retryable() {
            let avoid = call.avoid;
            let other = |d: &Backend| !avoid.iter().any(|failed| std::ptr::eq(&**failed, d));
            let next = (state.router)
                .pick_decode_among(Some(&decode), call.model, call.request, Some(&other))
                .filter(|_| state.router.may_retry("decode"));
            if let Some(next) = next {
                tracing::debug!(decode = decode.url(), error = %err, "decode failed before its first byte; retrying");
                call.metrics.retry();
                decode = next;
                retried = true;
                continue;
            }
        }
        return Err(decode_refusal(&decode, err));
    }
}

/// One call to `decode`, until its first byte or its failure, racing P's call: P's failure
/// ends it with what that means for the client (D is dropped, and so cancelled); P's answer
/// starts D's first-byte deadline, or ends the call (`None`, D dropped) when P ended before
/// its cap (`call.stopped`).
async fn first_byte(
    call: &mut DecodeCall<'_>,
    decode: &Backend,
) -> Result<Option<Result<DecodeStart, UpstreamError>>, Refusal> {
    let state = call.state;
    let upstream = &state.upstream;
    let endpoint = call.route.endpoint(decode);
    let decoding = upstream.decode(
        endpoint,
        call.common.clone(),
        call.body.clone(),
        call.deadline,
    );
    tokio::pin!(decoding);
    loop {
        if call.stopped.is_some() {
            return Ok(None);
        }
        let due = call
            .prefilled
            .filter(|_| call.streamed)
            .map(|at| at + upstream.first_byte_timeout);
        tokio::select! {
            biased;
            ended = answer(&mut call.prefill) => call.prefill_ended(ended)?,
            decoded = &mut decoding => return Ok(Some(decoded)),
            () = until(due) => {
                let timeout = UpstreamError::FirstByteTimeout(upstream.first_byte_timeout);
                return Ok(Some(Err(timeout)));
            }
        }
    }
}

impl DecodeCall<'_> {
    /// Records P's answer (and, where that means no KV was sent, that it ended before its
    /// length cap), or makes its failure what the client is told.
    fn prefill_ended(&mut self, ended: Result<Bytes, Failure>) -> Result<(), Refusal> {
        let answer = ended.map_err(Refusal::from)?;
        self.prefill = None;
        self.awaiting = None;
        self.prefilled = Some(Instant::now());
        self.stopped = self.alone.and_then(|_| stopped_before_cap(&answer));
        Ok(())
    }
}

/// Runs `work` while P's call goes on (a call is only driven while it is polled): P's failure
/// ends it with what that means for the client, P's answer is recorded.
async fn while_prefilling<T>(
    call: &mut DecodeCall<'_>,
    work: impl std::future::Future<Output = T>,
) -> Result<T, Refusal> {
    tokio::pin!(work);
    loop {
        tokio::select! {
            biased;
            ended = answer(&mut call.prefill) => call.prefill_ended(ended)?,
            done = &mut work => return Ok(done),
        }
    }
}

/// P's answer, or never when P's call is not running.
async fn answer(prefill: &mut Option<PrefillCall>) -> Result<Bytes, Failure> {
    match prefill {
        Some(prefilling) => prefilling.await,
        None => pending().await,
    }
}

/// Resolves at `due`, or never.
async fn until(due: Option<Instant>) {
    match due {
        Some(due) => tokio::time::sleep_until(due.into()).await,
        None => pending().await,
    }
}
