//! The body stream of a relayed answer: D's chunks as they arrive, while P's call (when still
//! running) is watched: if P fails once an SSE stream has begun, D is cancelled and the stream
//! ends with an error event. A followed answer ([`Follow`]) goes on on another decode when its
//! decode fails mid-answer. Dropping the relay (the client went away) cancels every call.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::stream::Stream;
use futures_util::StreamExt;

use super::resume::{Follow, Relayed, Resumed, Resumption};
use super::{detach, PrefillCall, Tracker};
use crate::error::ApiError;
use crate::metrics::{Break, CallOutcome, Outcome};
use crate::upstream::{Answer, DecodeStart, UpstreamError};
use pd_router::backend::Call;
use pd_router::placement::Watch;

/// The body stream of a relayed answer.
pub(crate) struct Relay {
    first: Option<Bytes>,
    decode: Option<(Answer, Call)>,
    prefill: Option<PrefillCall>,
    sse: bool,
    tracker: Tracker,
    /// The answer's pace, watched to teach the engines' latency models.
    watch: Option<Watch>,
    /// The answer followed so that it can go on elsewhere, when it can.
    follow: Option<Box<Follow>>,
}

/// The error a broken non-SSE body ends with (the client sees the connection cut).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct RelayError(String);

impl Relay {
    /// Relays `decode`'s answer, of D's `call`; `prefill` is P's call when it has not ended
    /// yet. `sse` says the answer is an event stream, where errors can be told in-band.
    pub(crate) fn new(
        decode: DecodeStart,
        call: Call,
        prefill: Option<PrefillCall>,
        sse: bool,
        tracker: Tracker,
    ) -> Self {
        Relay {
            first: decode.first,
            decode: Some((decode.rest, call)),
            prefill,
            sse,
            tracker,
            watch: None,
            follow: None,
        }
    }

    /// The same relay teaching `watch` the answer's pace (its first chunk already noted).
    pub(crate) fn watched(self, watch: Option<Watch>) -> Self {
        Relay { watch, ..self }
    }

    /// The same relay continuing the answer elsewhere should its decode fail, as `resumption`
    /// says (event streams only).
    pub(crate) fn resumable(self, resumption: Option<Resumption>) -> Self {
        let follow = resumption
            .filter(|_| self.sse)
            .map(|resumption| Box::new(Follow::new(resumption)));
        let mut relay = Relay { follow, ..self };
        if let (Some(follow), Some((answer, _))) = (&relay.follow, &mut relay.decode) {
            answer.limit_silences(follow.silence_limit());
        }
        relay
    }

    /// Ends the stream with `error`: an SSE error event, or a broken body.
    fn fail(
        &mut self,
        error: ApiError,
        outcome: Outcome,
    ) -> Poll<Option<Result<Bytes, RelayError>>> {
        self.decode = None;
        self.prefill = None;
        self.tracker.finish(outcome);
        Poll::Ready(Some(if self.sse {
            Ok(error.to_sse())
        } else {
            Err(RelayError(error.message))
        }))
    }

    /// D's answer ended as it should.
    fn ended(&mut self) -> Poll<Option<Result<Bytes, RelayError>>> {
        if let Some((_, call)) = self.decode.take() {
            call.finish(CallOutcome::Ok);
        }
        if let Some(prefill) = self.prefill.take() {
            detach(prefill);
        }
        self.tracker.finish(Outcome::Ok);
        if let Some(watch) = self.watch.take() {
            watch.ended();
        }
        Poll::Ready(None)
    }

    /// What D's failure mid-answer tells the client, when the answer cannot go on.
    fn decode_failed(&mut self, err: UpstreamError) -> Poll<Option<Result<Bytes, RelayError>>> {
        let (error, outcome) = match err {
            UpstreamError::Timeout(limit) => (
                ApiError::gateway_timeout(format!(
                    "decode did not finish within the request timeout ({limit:?})"
                )),
                Outcome::DecodeTimeout,
            ),
            UpstreamError::Broken(cause) => (
                ApiError::bad_gateway(format!("decode's answer broke off: {cause}")),
                Outcome::StreamError,
            ),
            other => (
                ApiError::bad_gateway(format!("decode's answer broke off: {other}")),
                Outcome::StreamError,
            ),
        };
        self.fail(error, outcome)
    }

    /// Watches P's call while it runs: `Some` when its failure ends the answer.
    fn poll_prefill(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Option<Poll<Option<<Self as Stream>::Item>>> {
        let prefill = self.prefill.as_mut()?;
        let Poll::Ready(result) = prefill.as_mut().poll(cx) else {
            return None;
        };
        self.prefill = None;
        match result {
            Err((error, outcome)) if self.sse => Some(self.fail(error, outcome)),
            // A non-streamed answer only starts once D has generated all of it, so D already
            // has the KV: P's late failure cannot spoil it.
            _ => None,
        }
    }

    /// The relay of an answer not followed: D's chunks as they are.
    fn poll_plain(&mut self, cx: &mut Context<'_>) -> Poll<Option<<Self as Stream>::Item>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(Ok(first)));
        }
        if let Some(failed) = self.poll_prefill(cx) {
            return failed;
        }
        let Some((stream, call)) = &mut self.decode else {
            return Poll::Ready(None);
        };
        match std::task::ready!(stream.poll_next_unpin(cx)) {
            Some(Ok(chunk)) => {
                call.progressed();
                if let Some(watch) = &mut self.watch {
                    watch.chunk(&chunk);
                }
                Poll::Ready(Some(Ok(chunk)))
            }
            Some(Err(err)) => {
                let (_, call) = self.decode.take().expect("decode is set");
                call.finish(err.outcome());
                self.decode_failed(err)
            }
            None => self.ended(),
        }
    }

    /// The relay of a followed answer: whole events, continued elsewhere should D fail.
    fn poll_followed(&mut self, cx: &mut Context<'_>) -> Poll<Option<<Self as Stream>::Item>> {
        loop {
            let follow = self.follow.as_mut().expect("the answer is followed");
            if let Some(reason) = follow.pending.take() {
                match self.broke(reason) {
                    Some(end) => return end,
                    None => continue,
                }
            }
            if let Some(started) = std::task::ready!(follow.poll_migration(cx)) {
                match started {
                    Ok(resumed) => self.resume(resumed),
                    Err((error, outcome)) => return self.fail(error, outcome),
                }
            }
            // The first chunk was noted by the latency watch when the answer began.
            let (chunk, first) = match self.first.take() {
                Some(first) => (Some(Ok(first)), true),
                None => {
                    if let Some(failed) = self.poll_prefill(cx) {
                        return failed;
                    }
                    let Some((stream, _)) = &mut self.decode else {
                        return Poll::Ready(None);
                    };
                    (std::task::ready!(stream.poll_next_unpin(cx)), false)
                }
            };
            let follow = self.follow.as_mut().expect("the answer is followed");
            match chunk {
                Some(Ok(chunk)) => {
                    if let Some((_, call)) = &self.decode {
                        call.progressed();
                    }
                    if let Some(watch) = self.watch.as_mut().filter(|_| !first) {
                        watch.chunk(&chunk);
                    }
                    match follow.chunk(chunk) {
                        Relayed::Send(bytes) if bytes.is_empty() => continue,
                        Relayed::Send(bytes) => return Poll::Ready(Some(Ok(bytes))),
                        Relayed::GaveUp(held) => {
                            self.follow = None;
                            return Poll::Ready(Some(Ok(held)));
                        }
                        Relayed::Overflowed => {
                            let error = ApiError::bad_gateway(
                                "the continued answer sent an event over the proxy's limit",
                            );
                            return self.fail(error, Outcome::StreamError);
                        }
                        Relayed::Broke(bytes) if bytes.is_empty() => {
                            match self.broke(Break::ErrorEvent) {
                                Some(end) => return end,
                                None => continue,
                            }
                        }
                        Relayed::Broke(bytes) => {
                            follow.pending = Some(Break::ErrorEvent);
                            return Poll::Ready(Some(Ok(bytes)));
                        }
                    }
                }
                // The whole answer is in: whatever its connection does now changes nothing.
                _ if follow.done() => return self.ended(),
                // The request's deadline: no time is left to go on elsewhere.
                Some(Err(err @ UpstreamError::Timeout(_))) => {
                    let (_, call) = self.decode.take().expect("decode is set");
                    call.finish(err.outcome());
                    return self.decode_failed(err);
                }
                Some(Err(UpstreamError::Stalled(_))) => match self.broke(Break::Stalled) {
                    Some(end) => return end,
                    None => continue,
                },
                Some(Err(_)) | None => match self.broke(Break::Broken) {
                    Some(end) => return end,
                    None => continue,
                },
            }
        }
    }

    /// D failed mid-answer: `Some` ends the stream (the answer had finished, or cannot go on),
    /// `None` lets a continuation start.
    fn broke(&mut self, reason: Break) -> Option<Poll<Option<<Self as Stream>::Item>>> {
        if self.follow.as_ref().is_some_and(|follow| follow.done()) {
            // The whole answer is in: its decode going quiet or away changes nothing.
            return Some(self.ended());
        }
        let (_, call) = self.decode.take().expect("decode is set");
        // P's answer no longer matters; it ends in the background (keeping its connection).
        if let Some(prefill) = self.prefill.take() {
            detach(prefill);
        }
        self.watch = None;
        let follow = self.follow.as_mut().expect("the answer is followed");
        match follow.broke(reason, call, self.tracker.trace()) {
            Ok(Some(ending)) => {
                self.tracker.finish(Outcome::Ok);
                Some(Poll::Ready(Some(Ok(ending))))
            }
            Ok(None) => None,
            Err((error, outcome)) => Some(self.fail(error, outcome)),
        }
    }

    /// A continuation's answer has begun: it is relayed from now on.
    fn resume(&mut self, resumed: Resumed) {
        let mut answer = resumed.decode.rest;
        if let Some(follow) = &self.follow {
            answer.limit_silences(follow.silence_limit());
        }
        self.first = resumed.decode.first;
        self.decode = Some((answer, resumed.call));
        self.prefill = resumed.prefill;
    }
}

impl Stream for Relay {
    type Item = Result<Bytes, RelayError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        match this.follow {
            Some(_) => this.poll_followed(cx),
            None => this.poll_plain(cx),
        }
    }
}
