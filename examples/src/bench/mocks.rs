//! The instant mock engines and bootstrap server the proxy scenarios run against, in the
//! benchmark's own process: an OpenAI backend that answers at once (whole, or 16 SSE events),
//! optionally pausing after its first event, and a bootstrap server with one engine.

use std::net::SocketAddr;
use std::sync::LazyLock;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pd_service::{serve, ServeLimits, ServerTls};
use serde::Deserialize;
use serde_json::{json, Value};

use super::mock_events;

/// SSE events a streamed mock answer carries before `[DONE]`.
const STREAM_EVENTS: usize = 16;

/// How long the "first chunk" mock D waits between its first event and the rest.
const TAIL_GAP: Duration = Duration::from_millis(20);

/// What the instant backends answer, rendered once: they stand for engines, so whatever they
/// spend per request is load on the cores the systems under test share, the same for each.
struct Answers {
    /// A whole completion.
    whole: Bytes,
    /// The streamed answer, as it is sent without token ids and with them (vLLM's
    /// `return_token_ids`: the prompt's on the first chunk, each chunk's own).
    plain: Streamed,
    with_ids: Streamed,
}

/// A streamed answer: [`STREAM_EVENTS`] SSE events and `[DONE]`.
struct Streamed {
    /// In one piece.
    stream: Bytes,
    /// The first event, and the rest (for a D that pauses between them).
    first_event: Bytes,
    later_events: Bytes,
}

impl Streamed {
    /// The answer of `chunk(i)` for each event `i`.
    fn of(chunk: impl Fn(usize) -> Value) -> Self {
        let mut events: Vec<Bytes> = (0..STREAM_EVENTS)
            .map(|i| Bytes::from(format!("data: {}\n\n", chunk(i))))
            .collect();
        events.push(Bytes::from_static(b"data: [DONE]\n\n"));
        Streamed {
            stream: Bytes::from(events.concat()),
            first_event: events[0].clone(),
            later_events: Bytes::from(events[1..].concat()),
        }
    }
}

static ANSWERS: LazyLock<Answers> = LazyLock::new(|| {
    let whole = json!({"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "sim-model",
           "choices": [{"index": 0, "text": " the cache moves", "logprobs": null, "finish_reason": "length"}],
           "usage": {"prompt_tokens": 24, "completion_tokens": 16, "total_tokens": 40}});
    let chunk = json!({"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "sim-model",
                       "choices": [{"index": 0, "text": " tok", "logprobs": null, "finish_reason": null}]});
    let prompt: Vec<u32> = (1000..1024).collect();
    Answers {
        whole: Bytes::from(whole.to_string()),
        plain: Streamed::of(|_| chunk.clone()),
        with_ids: Streamed::of(|i| {
            let mut chunk = chunk.clone();
            chunk["choices"][0]["prompt_token_ids"] = json!((i == 0).then_some(&prompt));
            chunk["choices"][0]["token_ids"] = json!([2000 + i]);
            chunk
        }),
    }
});

/// The fields of a request the mocks read (the rest is skipped, not parsed into values).
#[derive(Deserialize)]
struct StreamFlag {
    stream: Option<bool>,
    return_token_ids: Option<bool>,
}

async fn answer(body: Bytes, tail_gap: Option<Duration>) -> Response {
    let flags = serde_json::from_slice::<StreamFlag>(&body).ok();
    let stream = flags.as_ref().and_then(|flag| flag.stream).unwrap_or(false);
    let ids = flags
        .and_then(|flag| flag.return_token_ids)
        .unwrap_or(false);
    let answers = &*ANSWERS;
    if !stream {
        return (
            [(header::CONTENT_TYPE, "application/json")],
            answers.whole.clone(),
        )
            .into_response();
    }
    let streamed = match ids {
        true => &answers.with_ids,
        false => &answers.plain,
    };
    let body = match tail_gap {
        None => Body::from(streamed.stream.clone()),
        Some(gap) => {
            let parts = futures_util::stream::iter([
                (streamed.first_event.clone(), Duration::ZERO),
                (streamed.later_events.clone(), gap),
            ]);
            Body::from_stream(futures_util::StreamExt::then(
                parts,
                |(bytes, wait)| async move {
                    // Not even a zero sleep for the first event: the timer's millisecond ticks
                    // would delay it by up to one, hiding what a proxy adds.
                    if !wait.is_zero() {
                        tokio::time::sleep(wait).await;
                    }
                    Ok::<_, std::convert::Infallible>(bytes)
                },
            ))
        }
    };
    ([(header::CONTENT_TYPE, "text/event-stream")], body).into_response()
}

async fn serve_mock(app: Router, tls: Option<ServerTls>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a mock");
    let addr = listener.local_addr().expect("bound");
    let forever = std::future::pending();
    let limits = ServeLimits {
        tls,
        ..ServeLimits::default()
    };
    tokio::spawn(serve(listener, app, forever, limits));
    addr
}

/// An instant OpenAI backend (P or D). With `tail_gap`, a streamed answer sends its first event
/// at once and the rest after the gap; with `kv_event_sources`, it answers `GET
/// /kv_event_sources` with them (else 404, as an engine that publishes none).
pub async fn mock_backend(
    tail_gap: Option<Duration>,
    kv_event_sources: Option<Value>,
) -> SocketAddr {
    serve_mock(backend_app(tail_gap, kv_event_sources), None).await
}

/// An instant OpenAI backend, over TLS when `tls` is given (HTTPS engines).
pub async fn mock_backend_over(tls: Option<ServerTls>) -> SocketAddr {
    serve_mock(backend_app(None, None), tls).await
}

/// The routes of [`mock_backend`].
fn backend_app(tail_gap: Option<Duration>, kv_event_sources: Option<Value>) -> Router {
    let sources = move || {
        let sources = kv_event_sources.clone();
        async move {
            match sources {
                Some(sources) => Json(sources).into_response(),
                None => axum::http::StatusCode::NOT_FOUND.into_response(),
            }
        }
    };
    Router::new()
        .route("/kv_event_sources", get(sources))
        .route(
            "/v1/completions",
            post(move |body: Bytes| answer(body, tail_gap)),
        )
        .route(
            "/v1/chat/completions",
            post(move |body: Bytes| answer(body, tail_gap)),
        )
        .route("/health", get(|| async { "" }))
        .route(
            "/v1/models",
            get(|| async {
                Json(json!({"object": "list", "data": [{"id": "sim-model", "object": "model"}]}))
            }),
        )
}

/// A bootstrap server with one engine on dp rank 0 (what the proxies discover).
pub async fn mock_bootstrap() -> SocketAddr {
    let topology = json!({"0": {"engine_id": "bench-engine", "worker_addr": {"0": {"0": "tcp://127.0.0.1:1"}}}});
    let app = Router::new()
        .route("/query", get(move || async move { Json(topology.clone()) }))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }));
    serve_mock(app, None).await
}

/// The backends every system is measured against.
#[derive(Debug, Clone, Copy)]
pub struct Mocks {
    /// The instant P, whose KV cache events announce it holds the benchmark's prompt.
    pub prefill: SocketAddr,
    /// The instant D.
    pub decode: SocketAddr,
    /// A D whose streamed answers pause after the first event.
    pub slow_tail_decode: SocketAddr,
    /// P's bootstrap server.
    pub bootstrap: SocketAddr,
}

impl Mocks {
    /// Starts every mock in this process; P announces it holds the blocks of `prompt_tokens`.
    pub async fn start(prompt_tokens: Vec<u32>) -> Self {
        let events = mock_events::announce(prompt_tokens).await;
        Mocks {
            prefill: mock_backend(None, Some(events.sources)).await,
            decode: mock_backend(None, None).await,
            slow_tail_decode: mock_backend(Some(TAIL_GAP), None).await,
            bootstrap: mock_bootstrap().await,
        }
    }
}
