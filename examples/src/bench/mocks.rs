//! The instant mock engines and bootstrap server the proxy scenarios run against, in the
//! benchmark's own process: an OpenAI backend that answers at once (whole, or 16 SSE events),
//! optionally pausing after its first event, and a bootstrap server with one engine.

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pd_service::{serve, ServeLimits};
use serde_json::{json, Value};

/// SSE events a streamed mock answer carries before `[DONE]`.
const STREAM_EVENTS: usize = 16;

/// How long the "first chunk" mock D waits between its first event and the rest.
const TAIL_GAP: Duration = Duration::from_millis(20);

fn completion() -> Value {
    json!({"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "sim-model",
           "choices": [{"index": 0, "text": " the cache moves", "logprobs": null, "finish_reason": "length"}],
           "usage": {"prompt_tokens": 24, "completion_tokens": 16, "total_tokens": 40}})
}

fn sse_chunks() -> Vec<Bytes> {
    let chunk = json!({"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "sim-model",
                       "choices": [{"index": 0, "text": " tok", "logprobs": null, "finish_reason": null}]});
    let mut events: Vec<Bytes> = (0..STREAM_EVENTS)
        .map(|_| Bytes::from(format!("data: {chunk}\n\n")))
        .collect();
    events.push(Bytes::from_static(b"data: [DONE]\n\n"));
    events
}

async fn answer(body: Bytes, tail_gap: Option<Duration>) -> Response {
    let stream = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.get("stream").and_then(Value::as_bool))
        .unwrap_or(false);
    if !stream {
        return Json(completion()).into_response();
    }
    let events = sse_chunks();
    let body = match tail_gap {
        None => Body::from(events.concat()),
        Some(gap) => {
            let (first, rest) = (events[0].clone(), Bytes::from(events[1..].concat()));
            let parts = futures_util::stream::iter([(first, Duration::ZERO), (rest, gap)]);
            Body::from_stream(futures_util::StreamExt::then(
                parts,
                |(bytes, wait)| async move {
                    tokio::time::sleep(wait).await;
                    Ok::<_, std::convert::Infallible>(bytes)
                },
            ))
        }
    };
    ([(header::CONTENT_TYPE, "text/event-stream")], body).into_response()
}

async fn serve_mock(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a mock");
    let addr = listener.local_addr().expect("bound");
    let forever = std::future::pending();
    tokio::spawn(serve(listener, app, forever, ServeLimits::default()));
    addr
}

/// An instant OpenAI backend (P or D). With `tail_gap`, a streamed answer sends its first event
/// at once and the rest after the gap.
pub async fn mock_backend(tail_gap: Option<Duration>) -> SocketAddr {
    let app = Router::new()
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
        );
    serve_mock(app).await
}

/// A bootstrap server with one engine on dp rank 0 (what the proxies discover).
pub async fn mock_bootstrap() -> SocketAddr {
    let topology = json!({"0": {"engine_id": "bench-engine", "worker_addr": {"0": {"0": "tcp://127.0.0.1:1"}}}});
    let app = Router::new()
        .route("/query", get(move || async move { Json(topology.clone()) }))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }));
    serve_mock(app).await
}

/// The backends every system is measured against.
#[derive(Debug, Clone, Copy)]
pub struct Mocks {
    /// The instant P.
    pub prefill: SocketAddr,
    /// The instant D.
    pub decode: SocketAddr,
    /// A D whose streamed answers pause after the first event.
    pub slow_tail_decode: SocketAddr,
    /// P's bootstrap server.
    pub bootstrap: SocketAddr,
}

impl Mocks {
    /// Starts every mock in this process.
    pub async fn start() -> Self {
        Mocks {
            prefill: mock_backend(None).await,
            decode: mock_backend(None).await,
            slow_tail_decode: mock_backend(Some(TAIL_GAP)).await,
            bootstrap: mock_bootstrap().await,
        }
    }
}
