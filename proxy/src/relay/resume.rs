//! Following a streamed answer so that it can go on elsewhere: its events are relayed whole,
//! its tokens counted ([`Progress`]), its decode's silences limited (by its answer's own
//! timer, [`crate::upstream::Answer::limit_silences`]); when the decode fails
//! mid-answer (the connection closes or resets, an error event, no token for
//! `--decode-stall-timeout`), the answer is continued on another decode, within the request's
//! `--migration-limit`, deadline and the router's retry budget.
//!
//! The continuation itself (a completion of the prompt's tokens and those the client has,
//! placed and dispatched as a new request would be, never on a decode that failed this answer)
//! is the flow's: the relay reaches it through [`Continuer`].

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::http::HeaderValue;
use bytes::{Bytes, BytesMut};
use futures_util::future::BoxFuture;

use super::events::{Events, Overflow};
use super::progress::{Asked, Continuation, Progress, Step};
use super::{Failure, PrefillCall};
use crate::error::ApiError;
use crate::metrics::{Break, Migrated, MigrationMetrics, Outcome};
use crate::trace::{Phase, RequestTrace};
use crate::upstream::DecodeStart;
use pd_router::backend::{Backend, Call};

/// What continues a broken answer: the request placed and dispatched again.
pub(crate) trait Continuer: Send + Sync {
    /// Starts `continuation` on a decode other than those in `avoid`; resolves once its answer
    /// has begun.
    fn continue_answer(
        &self,
        continuation: Continuation,
        avoid: Vec<Arc<Backend>>,
    ) -> BoxFuture<'static, Result<Resumed, Failure>>;

    /// Whether the router's retry budget allows one more try.
    fn may_retry(&self) -> bool;
}

/// A continuation's answer has begun.
pub(crate) struct Resumed {
    /// D's status and first bytes.
    pub decode: DecodeStart,
    /// D's call, to be finished when its answer ends.
    pub call: Call,
    /// P's call when it is still running.
    pub prefill: Option<PrefillCall>,
}

/// How a streamed answer may be continued: set by the flow for answers that can go on exactly.
pub(crate) struct Resumption {
    /// How the client asked for the answer.
    pub asked: Asked,
    /// At most this many migrations.
    pub limit: u32,
    /// A decode that sends nothing for this long is taken as stalled.
    pub stall: Duration,
    /// When the whole request must be over.
    pub deadline: Instant,
    /// The request's id, for the logs.
    pub request_id: HeaderValue,
    /// Starts the continuations.
    pub continuer: Box<dyn Continuer>,
    /// The migration metrics.
    pub metrics: MigrationMetrics,
    /// The decodes that failed the request before its answer began (each one migration).
    pub failed: Vec<Arc<Backend>>,
}

/// A migration under way.
struct Migrating {
    started: BoxFuture<'static, Result<Resumed, Failure>>,
    reason: Break,
    since: Instant,
    tokens: usize,
    phase: Option<Phase>,
}

/// What a chunk of D's answer gives the client.
pub(super) enum Relayed {
    /// These bytes (possibly none).
    Send(Bytes),
    /// D told an error after these bytes (possibly none): its answer broke.
    Broke(Bytes),
    /// An event outgrew the cap: these bytes as they are, and the answer is no longer followed.
    GaveUp(Bytes),
    /// An event of a continuation outgrew the cap: the answer cannot go on.
    Overflowed,
}

/// A followed answer's state.
pub(super) struct Follow {
    /// A break seen after bytes the client must get first: handled at the next poll.
    pub pending: Option<Break>,
    resumption: Resumption,
    progress: Progress,
    events: Events,
    migrating: Option<Migrating>,
    migrations: u32,
    failed: Vec<Arc<Backend>>,
}

impl Follow {
    /// Starts following an answer.
    pub(super) fn new(resumption: Resumption) -> Self {
        Follow {
            progress: Progress::new(resumption.asked),
            migrations: resumption.failed.len() as u32,
            failed: resumption.failed.clone(),
            resumption,
            events: Events::default(),
            migrating: None,
            pending: None,
        }
    }

    /// Whether the answer ended as it should (`[DONE]`).
    pub(super) fn done(&self) -> bool {
        self.progress.done()
    }

    /// How long the decode may send nothing before it is taken as stalled.
    pub(super) fn silence_limit(&self) -> Duration {
        self.resumption.stall
    }

    /// Reads a chunk of D's answer: what the client gets of it.
    pub(super) fn chunk(&mut self, chunk: Bytes) -> Relayed {
        let events = match self.events.push(chunk) {
            Ok(events) => events,
            Err(_) if self.progress.continued() => return Relayed::Overflowed,
            Err(Overflow(held)) => return Relayed::GaveUp(held),
        };
        let mut out = BytesMut::new();
        for event in events {
            if self.progress.observe(&event, &mut out) == Step::Broke {
                return Relayed::Broke(out.freeze());
            }
        }
        Relayed::Send(out.freeze())
    }

    /// The decode of `call` failed mid-answer by `reason`: starts the continuation, or says
    /// why there is none (how the stream then ends). An answer whose choice had finished just
    /// ends (its usage when asked, and `[DONE]`).
    pub(super) fn broke(
        &mut self,
        reason: Break,
        call: Call,
        trace: Option<&RequestTrace>,
    ) -> Result<Option<Bytes>, Failure> {
        self.events.clear();
        let backend = call.backend().clone();
        call.finish(crate::metrics::CallOutcome::Error);
        // A decode whose connection broke is likely gone: out until its health checks pass. A
        // quiet or erring one may only be busy: it is just avoided by this answer.
        if reason == Break::Broken {
            backend.eject("its answer broke off mid-stream");
        }
        if self.progress.finished() {
            return Ok(Some(self.progress.ending()));
        }
        let id = self.resumption.request_id.to_str().unwrap_or_default();
        let refused = |outcome: Migrated, why: &str| {
            self.resumption.metrics.count(reason, outcome);
            tracing::warn!(
                request_id = id,
                decode = backend.url(),
                reason = reason.as_str(),
                "decode's answer failed mid-stream and is not continued: {why}"
            );
            let message = format!(
                "decode's answer broke off ({}) and could not be continued: {why}",
                reason.as_str()
            );
            Err((ApiError::bad_gateway(message), Outcome::StreamError))
        };
        let continuation = match self.progress.continuation() {
            Ok(continuation) => continuation,
            Err(why) => return refused(Migrated::Inexact, why),
        };
        if self.migrations >= self.resumption.limit {
            let why = format!(
                "its {} migrations are spent (--migration-limit)",
                self.migrations
            );
            return refused(Migrated::Limit, &why);
        }
        if Instant::now() >= self.resumption.deadline {
            return refused(Migrated::Deadline, "the request's deadline has passed");
        }
        if !self.resumption.continuer.may_retry() {
            return refused(Migrated::Budget, "the retry budget is spent");
        }
        self.migrations += 1;
        self.failed.push(backend.clone());
        tracing::warn!(
            request_id = id,
            decode = backend.url(),
            reason = reason.as_str(),
            generated = self.progress.generated(),
            "decode's answer failed mid-stream; continuing it on another decode"
        );
        self.progress.continue_from(&continuation);
        let tokens = continuation.prompt.len();
        let started =
            (self.resumption.continuer).continue_answer(continuation, self.failed.clone());
        self.migrating = Some(Migrating {
            started,
            reason,
            since: Instant::now(),
            tokens,
            phase: trace.map(|trace| trace.phase("migration", backend.url())),
        });
        Ok(None)
    }

    /// Drives the migration under way, if any: `None` when there is none.
    pub(super) fn poll_migration(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Resumed, Failure>>> {
        let Some(migrating) = &mut self.migrating else {
            return Poll::Ready(None);
        };
        let started = std::task::ready!(migrating.started.as_mut().poll(cx));
        let Migrating {
            reason,
            since,
            tokens,
            phase,
            ..
        } = self.migrating.take().expect("a migration is under way");
        let metrics = &self.resumption.metrics;
        let id = self.resumption.request_id.to_str().unwrap_or_default();
        match &started {
            Ok(resumed) => {
                metrics.resumed(reason, tokens, since.elapsed());
                tracing::info!(
                    request_id = id,
                    decode = resumed.call.backend().url(),
                    "answer continued on another decode"
                );
            }
            Err((error, _)) => {
                metrics.count(reason, Migrated::Failed);
                tracing::warn!(
                    request_id = id,
                    "answer could not be continued: {}",
                    error.message
                );
            }
        }
        if let Some(phase) = phase {
            phase.end(
                started
                    .as_ref()
                    .err()
                    .map(|(e, _)| e.message.clone().into()),
            );
        }
        Poll::Ready(Some(started))
    }
}
