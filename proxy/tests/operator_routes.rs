//! The operator's routes (`/metrics`, `/admin/*`, the live pages) against the real binary: on
//! the serving port they need the admin key once any key is set (a route nobody named open
//! included: closed by default), `/metrics` may be left to scrapers; with `--admin-port` they
//! move to their own listener and the serving port answers them with 404. `/health` and
//! `/ready` stay open everywhere.

mod common;

use common::binary::in_front_of;
use common::{client, topology, Bootstrap, Mock};
use reqwest::Method;
use tokio::process::Child;

/// Every operator's route (one per handler), and a path no route serves: closed by default.
const OPERATOR: [(&str, &str); 10] = [
    ("GET", "/metrics"),
    ("GET", "/admin/backends"),
    ("POST", "/admin/drain"),
    ("POST", "/admin/duties"),
    ("GET", "/admin/kv-index"),
    ("POST", "/admin/kv-index/match"),
    ("GET", "/ui"),
    ("GET", "/ui/state"),
    ("GET", "/ui/app.js"),
    ("GET", "/a/route/added/later"),
];

const CLIENT_KEY: &str = "client-key";
const ADMIN_KEY: &str = "admin-key";

/// The engines a proxy needs to start.
struct Engines {
    prefill: Mock,
    bootstrap: Bootstrap,
    decode: Mock,
}

impl Engines {
    async fn start() -> Self {
        Engines {
            prefill: Mock::prefill().await,
            bootstrap: Bootstrap::start(topology(&[(0, "engine-0")])).await,
            decode: Mock::decode().await,
        }
    }

    /// pd-proxy in front of them with `args`, ready: the process and its serving URL.
    async fn proxy(&self, args: &[&str]) -> (Child, String) {
        in_front_of(&self.prefill, &self.bootstrap, &[&self.decode], args, &[]).await
    }
}

/// The status of `method path` at `base`, with `key` as the bearer token when given.
async fn status(base: &str, method: &str, path: &str, key: Option<&str>) -> u16 {
    let method = Method::from_bytes(method.as_bytes()).unwrap();
    let mut request = client().request(method, format!("{base}{path}"));
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    request = request
        .header("content-type", "application/json")
        .body("{}");
    request.send().await.unwrap().status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_keys_the_operators_routes_need_the_admin_key() {
    let engines = Engines::start().await;
    let keys = ["--api-key", CLIENT_KEY, "--admin-key", ADMIN_KEY];
    let (mut child, url) = engines.proxy(&keys).await;
    for (method, path) in OPERATOR {
        for key in [None, Some(CLIENT_KEY), Some("wrong")] {
            let got = status(&url, method, path, key).await;
            assert_eq!(got, 401, "{method} {path} with {key:?}");
        }
        let got = status(&url, method, path, Some(ADMIN_KEY)).await;
        assert!(
            ![401, 403].contains(&got),
            "{method} {path} with the admin key: {got}"
        );
    }
    // The probes stay open; the clients' routes ask for the clients' key.
    assert_eq!(status(&url, "GET", "/health", None).await, 200);
    assert_eq!(status(&url, "GET", "/ready", None).await, 200);
    assert_eq!(status(&url, "GET", "/v1/models", None).await, 401);
    assert_eq!(
        status(&url, "GET", "/v1/models", Some(CLIENT_KEY)).await,
        200
    );
    child.kill().await.unwrap();

    // A client key alone: the operator's routes are closed, and say how to open them.
    let (mut child, url) = engines
        .proxy(&["--api-key", CLIENT_KEY, "--metrics-open"])
        .await;
    let answer = client()
        .get(format!("{url}/admin/backends"))
        .bearer_auth(CLIENT_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 403);
    let text = answer.text().await.unwrap();
    assert!(
        text.contains("--admin-key") && text.contains("--admin-port"),
        "{text}"
    );
    // ... but /metrics is left to scrapers.
    assert_eq!(status(&url, "GET", "/metrics", None).await, 200);
    child.kill().await.unwrap();

    // No key at all: everything is open, as on a developer's machine.
    let (mut child, url) = engines.proxy(&[]).await;
    for path in ["/metrics", "/admin/backends", "/ui"] {
        assert_eq!(status(&url, "GET", path, None).await, 200, "{path}");
    }
    child.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_port_takes_the_operators_routes_off_the_serving_port() {
    let engines = Engines::start().await;
    let admin_port = pd_examples_free_port().to_string();
    let args = ["--api-key", CLIENT_KEY, "--admin-port", &admin_port];
    let (mut child, url) = engines.proxy(&args).await;
    let admin = format!("http://127.0.0.1:{admin_port}");
    for (method, path) in OPERATOR {
        for key in [None, Some(CLIENT_KEY)] {
            let got = status(&url, method, path, key).await;
            assert_eq!(got, 404, "{method} {path} on the serving port");
        }
    }
    for path in [
        "/metrics",
        "/admin/backends",
        "/ui",
        "/ui/state",
        "/health",
        "/ready",
    ] {
        assert_eq!(
            status(&admin, "GET", path, None).await,
            200,
            "{path} on the admin port"
        );
    }
    // The admin routes keep their own key (there is none here: they are off).
    assert_eq!(status(&admin, "GET", "/admin/kv-index", None).await, 403);
    // The clients' routes are not on the admin port; the probes are on both.
    assert_eq!(status(&admin, "POST", "/v1/completions", None).await, 404);
    assert_eq!(status(&url, "GET", "/health", None).await, 200);
    assert_eq!(
        status(&url, "GET", "/v1/models", Some(CLIENT_KEY)).await,
        200
    );
    child.kill().await.unwrap();
}

/// A free port on 127.0.0.1 (bound, then released).
fn pd_examples_free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
