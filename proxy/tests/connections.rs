//! The proxy's kept-alive connections to P and D: reused call after call, and replaced without
//! a failed request when the backend closed them (idle timeout, restart).

mod common;

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use futures_util::stream;
use http_body_util::{BodyExt, Either, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use pd_proxy::config::PrefillTarget;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// A P or D that keeps connections alive (unlike the shared mocks, which close each one) and
/// records which connection each completion arrived on.
struct KeepAlive {
    url: String,
    /// The connection number of each completion request, in order.
    completions_on: Arc<Mutex<Vec<usize>>>,
    /// The tasks serving the open connections.
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl KeepAlive {
    /// Serves completions with `answer` (streamed in two events when the request asks), and
    /// anything else (health checks) with 200 and `{}`. A connection idle for `idle_close`
    /// is closed by the server, as uvicorn does after its keep-alive timeout.
    async fn start(answer: Value, idle_close: Option<Duration>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let completions_on = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::new(Mutex::new(Vec::new()));
        let numbers = AtomicUsize::new(0);
        let (seen, open) = (completions_on.clone(), connections.clone());
        let accept = tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let number = numbers.fetch_add(1, Ordering::SeqCst);
                let (seen, answer) = (seen.clone(), answer.clone());
                let service = service_fn(move |request: Request<Incoming>| {
                    let (seen, answer) = (seen.clone(), answer.clone());
                    async move {
                        let completion = request.uri().path() == "/v1/completions";
                        let body = request.into_body().collect().await.unwrap().to_bytes();
                        if !completion {
                            return Ok::<_, Infallible>(Response::new(Either::Left(Full::from(
                                "{}",
                            ))));
                        }
                        seen.lock().unwrap().push(number);
                        let asked: Value = serde_json::from_slice(&body).unwrap();
                        Ok(Response::new(if asked["stream"] == json!(true) {
                            let events = ["data: {\"text\":\"Hel\"}\n\n", "data: [DONE]\n\n"]
                                .map(|event| Ok::<_, Infallible>(Frame::data(Bytes::from(event))));
                            Either::Right(StreamBody::new(stream::iter(events)))
                        } else {
                            Either::Left(Full::from(answer.to_string()))
                        }))
                    }
                });
                let mut builder = http1::Builder::new();
                if let Some(idle) = idle_close {
                    builder.timer(hyper_util::rt::TokioTimer::new());
                    builder.header_read_timeout(idle);
                }
                let serving = builder.serve_connection(TokioIo::new(stream), service);
                open.lock().unwrap().push(tokio::spawn(async move {
                    let _ = serving.await;
                }));
            }
        });
        KeepAlive {
            url,
            completions_on,
            connections,
            accept,
        }
    }

    /// The distinct connections completions arrived on.
    fn completion_connections(&self) -> usize {
        let mut numbers = self.completions_on.lock().unwrap().clone();
        numbers.sort_unstable();
        numbers.dedup();
        numbers.len()
    }

    /// Closes every open connection, as a backend that restarts does, and waits until they are.
    async fn close_connections(&self) {
        let tasks: Vec<_> = self.connections.lock().unwrap().drain(..).collect();
        for task in tasks {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.accept.abort();
        for task in self.connections.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

/// A keep-alive P and D behind a ready proxy.
async fn keep_alive_cluster(
    idle_close: Option<Duration>,
    serving_threads: usize,
) -> (KeepAlive, KeepAlive, Cluster2) {
    let prefill = KeepAlive::start(prefill_answer(), idle_close).await;
    let decode = KeepAlive::start(decode_answer(), idle_close).await;
    let bootstrap = Bootstrap::start(topology(&[(0, "engine-0")])).await;
    let mut config = config(
        vec![PrefillTarget {
            url: prefill.url.clone(),
            bootstrap_addr: Some(bootstrap.url()),
        }],
        vec![decode.url.clone()],
    );
    config.serving_threads = serving_threads;
    let proxy = start_proxy(config).await;
    wait_ready(&proxy).await;
    (prefill, decode, Cluster2 { bootstrap, proxy })
}

/// What the tests talk to (the bootstrap mock only has to stay up).
struct Cluster2 {
    #[allow(dead_code)]
    bootstrap: Bootstrap,
    proxy: pd_proxy::ProxyHandle,
}

impl Cluster2 {
    async fn complete(&self, stream: bool) {
        let response = client()
            .post(format!("{}/v1/completions", self.proxy.url()))
            .json(&json!({"prompt": "x", "stream": stream}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let text = response.text().await.unwrap();
        assert!(!text.is_empty());
    }
}

#[tokio::test]
async fn calls_one_after_another_reuse_one_connection_per_backend() {
    let (prefill, decode, cluster) = keep_alive_cluster(None, 1).await;
    for round in 0..20 {
        cluster.complete(round % 2 == 1).await;
    }
    assert_eq!(prefill.completions_on.lock().unwrap().len(), 20);
    assert_eq!(decode.completions_on.lock().unwrap().len(), 20);
    assert_eq!(prefill.completion_connections(), 1, "P's connections");
    assert_eq!(decode.completion_connections(), 1, "D's connections");
}

#[tokio::test]
async fn each_serving_thread_keeps_its_own_connections_to_a_backend() {
    let (prefill, decode, cluster) = keep_alive_cluster(None, 3).await;
    // Each call on a new client connection: the kernel spreads them over the three threads.
    for round in 0..30 {
        cluster.complete(round % 2 == 1).await;
    }
    assert_eq!(prefill.completions_on.lock().unwrap().len(), 30);
    for (backend, connections) in [
        ("P", prefill.completion_connections()),
        ("D", decode.completion_connections()),
    ] {
        // More than one thread served, and none opened a second connection.
        assert!(
            (2..=3).contains(&connections),
            "{backend}'s connections: {connections}"
        );
    }
}

#[tokio::test]
async fn connections_the_backend_closed_when_idle_are_replaced_without_a_failure() {
    let (prefill, decode, cluster) = keep_alive_cluster(Some(Duration::from_millis(100)), 1).await;
    for _ in 0..3 {
        cluster.complete(false).await;
        // Longer than the backends keep an idle connection.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(prefill.completion_connections(), 3, "P's connections");
    assert_eq!(decode.completion_connections(), 3, "D's connections");
}

#[tokio::test]
async fn a_restarted_backend_is_reached_on_new_connections_at_once() {
    let (prefill, decode, cluster) = keep_alive_cluster(None, 1).await;
    cluster.complete(false).await;
    cluster.complete(true).await;
    prefill.close_connections().await;
    decode.close_connections().await;
    // No pause: the next request must not fail on a connection the backends closed.
    cluster.complete(false).await;
    cluster.complete(true).await;
    assert_eq!(prefill.completion_connections(), 2, "P's connections");
    assert_eq!(decode.completion_connections(), 2, "D's connections");
}
