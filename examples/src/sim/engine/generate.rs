//! Generation: `max_tokens` tokens at the decode pace (fewer when a stop token ends the answer
//! first), whole or as SSE chunks (each token from the whole context, see `sim/kv.rs`), with the
//! faults `--fail-after-tokens` injects.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::Engine;
use crate::sim::api::{sse_event, with_token_ids, Api, Finish, Prompt, ResponseMeta, SSE_DONE};
use crate::sim::config::FailMode;
use crate::sim::kv::Generator;
use crate::sim::pace::Pace;

impl Engine {
    /// Generates the answer's tokens ([`Prompt::planned`]) at `pace`, whole or as SSE chunks; a
    /// stop token's text is not shown.
    pub(super) async fn generate(
        &self,
        api: Api,
        prompt: Prompt,
        kv_params: Value,
        mut pace: Pace,
    ) -> Response {
        let served = prompt
            .lora
            .as_ref()
            .map_or(&self.args.model, |lora| &lora.name);
        let meta = ResponseMeta::new(api, served);
        let prompt_tokens = prompt.token_count();
        let (total, finish) = prompt.planned();
        let shown =
            move |step: u32, piece: String| match finish == Finish::Stop && step + 1 == total {
                true => String::new(),
                false => piece,
            };
        let ids = prompt.return_token_ids;
        let fail_after = Some(self.args.fail_after_tokens).filter(|n| *n > 0);
        let fail_mode = self.args.fail_mode;
        if !prompt.stream {
            let mut generator = Generator::new(&prompt.tokens);
            let (generated, text): (Vec<u32>, String) = (0..total)
                .map(|step| {
                    let (id, piece) = generator.next_token();
                    (id, shown(step, piece))
                })
                .unzip();
            for step in 0..total {
                if fail_after == Some(step) {
                    if fail_mode == FailMode::Error {
                        let error = injected_error();
                        return (StatusCode::INTERNAL_SERVER_ERROR, Json(error)).into_response();
                    }
                    fail(fail_mode).await;
                }
                pace.next_token().await;
            }
            let answer = meta.full(&text, (prompt_tokens, total), finish, kv_params);
            let answer = match ids && api != Api::Generate {
                true => with_token_ids(answer, &generated, Some(&prompt.tokens)),
                false => answer,
            };
            return Json(answer).into_response();
        }
        let include_usage = prompt.include_usage && api != Api::Generate;
        // Steps: one event per token, then (OpenAI only) the closing chunk and optional usage,
        // then [DONE]. SGLang's events carry the whole text so far and end on the last token.
        let prompt_ids: Arc<[u32]> = prompt.tokens.clone().into();
        let generator = Generator::new(&prompt.tokens);
        let state = (0u32, String::new(), generator, pace);
        let events = futures_util::stream::unfold(state, move |state| {
            let (step, so_far, mut generator, mut pace) = state;
            let meta = meta.clone();
            let prompt_ids = prompt_ids.clone();
            async move {
                let mut so_far = so_far;
                if fail_after == Some(step) && step < total {
                    if fail_mode == FailMode::Error {
                        let error = sse_event(&injected_error());
                        let ended = [&error[..], SSE_DONE].concat();
                        let state = (total + 3, so_far, generator, pace);
                        return Some((Ok(Bytes::from(ended)), state));
                    }
                    fail(fail_mode).await;
                }
                let event = if step < total {
                    pace.next_token().await;
                    let (id, piece) = generator.next_token();
                    let piece = shown(step, piece);
                    if api == Api::Generate {
                        so_far.push_str(&piece);
                        let done = (step + 1 == total).then_some(finish);
                        sse_event(&meta.generated(&so_far, prompt_tokens, step + 1, done))
                    } else {
                        let chunk = meta.chunk(Some(&piece), step == 0, None);
                        let chunk = match ids {
                            true => {
                                with_token_ids(chunk, &[id], (step == 0).then_some(&prompt_ids[..]))
                            }
                            false => chunk,
                        };
                        sse_event(&chunk)
                    }
                } else if step == total && api != Api::Generate {
                    sse_event(&meta.chunk(None, total == 0, Some(finish)))
                } else if step == total + 1 && include_usage {
                    sse_event(&meta.usage_chunk(prompt_tokens, total))
                } else if step <= total + 2 {
                    Bytes::from_static(SSE_DONE)
                } else {
                    return None;
                };
                let next = match step {
                    s if s + 1 == total && api == Api::Generate => total + 2,
                    s if s == total && !include_usage => total + 2,
                    s => s + 1,
                };
                Some((Ok::<_, Infallible>(event), (next, so_far, generator, pace)))
            }
        });
        (
            [
                (header::CONTENT_TYPE, "text/event-stream"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            Body::from_stream(events),
        )
            .into_response()
    }
}

/// The error an injected `--fail-mode error` tells, as vLLM's `ErrorResponse`.
fn injected_error() -> Value {
    json!({"error": {"message": "injected failure (--fail-mode error)",
                     "type": "InternalServerError", "param": null, "code": 500}})
}

/// Injected failure mid-answer: the engine dies, or the answer hangs (an error is told by the
/// caller, in the answer's own shape, instead).
async fn fail(mode: FailMode) {
    match mode {
        FailMode::Exit => {
            // The tokens sent so far reach the client first, as a crash between two tokens
            // leaves them.
            tokio::time::sleep(Duration::from_millis(100)).await;
            std::process::exit(1)
        }
        FailMode::Stall | FailMode::Error => std::future::pending::<()>().await,
    }
}
