//! What a client sees when a request fails, by table: the same mistake gets the same answer
//! (whichever engine answers first, run after run), in one OpenAI shape (`message`, `type`,
//! `param` and `code` always there, `code` a word or null), on every endpoint and in both
//! dialects (vLLM's concurrent P/D and SGLang's), and no answer names an engine: which one
//! failed goes to the logs and, for operators, to the `x-pd-upstream` header.

mod common;

use std::time::Duration;

use bootstrap_server::{Server, ServerConfig};
use common::*;
use pd_proxy::config::{Config, Mode, PrefillTarget};
use reqwest::StatusCode;
use serde_json::{json, Value};

/// The prefill's row SGLang's rank sends its bootstrap server.
fn sglang_row() -> Value {
    json!({
        "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
        "system_dp_size": 1, "system_dp_rank": 0,
        "rank_ip": "127.0.0.1", "rank_port": 17000, "page_size": 64,
        "kv_cache_dtype": "bfloat16"
    })
}

/// A proxy in `mode` in front of one mock P and one mock D; `edit` changes its config.
struct Front {
    prefill: Mock,
    decode: Mock,
    proxy: pd_proxy::ProxyHandle,
    _bootstrap: Option<bootstrap_server::ServerHandle>,
    _mock_bootstrap: Option<Bootstrap>,
    _dir: tempfile::TempDir,
}

impl Front {
    async fn start(mode: Mode, edit: impl FnOnce(&mut Config)) -> Front {
        let dir = tempfile::tempdir().unwrap();
        let prefill = Mock::prefill().await;
        let decode = Mock::decode().await;
        let (bootstrap, mock_bootstrap, bootstrap_url) = match mode {
            Mode::Sglang => {
                let server = Server::bind(ServerConfig::local(dir.path()))
                    .await
                    .unwrap()
                    .spawn();
                let status = client()
                    .put(format!("{}/route", server.url()))
                    .json(&sglang_row())
                    .send()
                    .await
                    .unwrap()
                    .status();
                assert_eq!(status, 200);
                let url = server.url();
                (Some(server), None, url)
            }
            _ => {
                let mock = Bootstrap::start(topology(&[(0, "engine-0")])).await;
                let url = mock.url();
                (None, Some(mock), url)
            }
        };
        let target = PrefillTarget {
            url: prefill.url(),
            bootstrap_addr: Some(bootstrap_url),
        };
        let mut config = config(vec![target], vec![decode.url()]);
        config.router.mode = mode;
        config.router.discovery.sglang = mode == Mode::Sglang;
        edit(&mut config);
        let proxy = start_proxy(config).await;
        wait_ready(&proxy).await;
        Front {
            prefill,
            decode,
            proxy,
            _bootstrap: bootstrap,
            _mock_bootstrap: mock_bootstrap,
            _dir: dir,
        }
    }

    async fn post(
        &self,
        path: &str,
        body: &Value,
        key: Option<&str>,
    ) -> (StatusCode, Option<String>, Value) {
        let mut request = client()
            .post(format!("{}{path}", self.proxy.url()))
            .json(body);
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        let answer = request.send().await.unwrap();
        let status = answer.status();
        let upstream =
            (answer.headers().get("x-pd-upstream")).map(|value| value.to_str().unwrap().to_owned());
        let text = answer.text().await.unwrap();
        let body = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
        (status, upstream, body)
    }
}

/// The error object of `body`, checked for the one shape and for engine addresses.
fn error_of(body: &Value) -> &Value {
    let error = &body["error"];
    let keys: Vec<&str> = error
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(keys, ["code", "message", "param", "type"], "{body}");
    assert!(
        error["code"].is_null() || error["code"].is_string(),
        "{body}"
    );
    assert!(
        error["param"].is_null() || error["param"].is_string(),
        "{body}"
    );
    let text = body.to_string();
    assert!(
        !text.contains("127.0.0.1") && !text.contains("dp rank"),
        "{text}"
    );
    error
}

const COMPLETIONS: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";

#[tokio::test]
async fn the_same_mistake_gets_the_same_answer_before_any_engine_is_called() {
    // (endpoint, body, param at fault)
    let table = [
        (COMPLETIONS, json!({"model": "mock-model"}), "prompt"),
        (
            COMPLETIONS,
            json!({"prompt": "hi", "temperature": "hot"}),
            "temperature",
        ),
        (
            COMPLETIONS,
            json!({"model": "mock-model", "prompt": "hi", "max_tokens": 0}),
            "max_tokens",
        ),
        (
            COMPLETIONS,
            json!({"model": "mock-model", "prompt": "hi", "max_tokens": "1.5"}),
            "max_tokens",
        ),
        (
            COMPLETIONS,
            json!({"prompt": "hi", "stream": "maybe"}),
            "stream",
        ),
        (CHAT, json!({"prompt": "hi"}), "messages"),
        (CHAT, json!({"messages": []}), "messages"),
        (
            CHAT,
            json!({"messages": [{"role": "user", "content": "x"}], "top_p": 0}),
            "top_p",
        ),
        (
            CHAT,
            json!({"messages": [{"role": "user", "content": "x"}], "n": -1}),
            "n",
        ),
    ];
    for mode in [Mode::Concurrent, Mode::Sglang] {
        let front = Front::start(mode, |_| {}).await;
        for (path, body, param) in &table {
            let mut answers = Vec::new();
            for _ in 0..3 {
                let (status, upstream, answer) = front.post(path, body, None).await;
                assert_eq!(status, 400, "{mode:?} {path} {body}: {answer}");
                assert_eq!(upstream, None);
                let error = error_of(&answer);
                assert_eq!(error["param"], *param, "{mode:?} {path} {body}: {answer}");
                assert_eq!(error["type"], "invalid_request_error");
                answers.push(answer);
            }
            assert!(answers.windows(2).all(|w| w[0] == w[1]), "{answers:?}");
        }
        assert!(front.prefill.seen().is_empty() && front.decode.seen().is_empty());
        // A refusal is counted under the model it asked for.
        let refused = sample(
            &metrics(&front.proxy).await,
            "pd_proxy_requests_total",
            r#"model="mock-model",outcome="bad_request",route="/v1/completions""#,
        );
        assert_eq!(refused, 9.0, "{mode:?}");
    }
}

#[tokio::test]
async fn what_vllm_reads_is_passed_through() {
    // vLLM's pydantic models read numbers in strings and whole floats; a completion that echoes
    // its prompt may generate nothing; a chat's `max_completion_tokens` of 0 gives way to
    // `max_tokens`; an API the proxy does not check is not asked for a prompt.
    let front = Front::start(Mode::Concurrent, |_| {}).await;
    let table = [
        (
            COMPLETIONS,
            json!({"prompt": "hi", "max_tokens": "4", "n": 1.0, "temperature": "0.5"}),
        ),
        (
            COMPLETIONS,
            json!({"prompt": "hi", "max_tokens": 0, "echo": true}),
        ),
        (
            CHAT,
            json!({"messages": [{"role": "user", "content": "x"}],
                "max_completion_tokens": 0, "max_tokens": 3}),
        ),
    ];
    for (path, body) in &table {
        let (status, _, answer) = front.post(path, body, None).await;
        assert_eq!(status, 200, "{path} {body}: {answer}");
    }
    assert_eq!(front.decode.seen().len(), table.len());
}

#[tokio::test]
async fn an_engines_refusal_reads_the_same_whichever_engine_answered_first() {
    // vLLM's own refusal, from whichever engine answers first.
    let refusal = json!({"error": {"message": "'foo' is not a valid sampling field",
        "type": "BadRequestError", "param": "foo", "code": 400}});
    for mode in [Mode::Concurrent, Mode::Sglang] {
        for path in [COMPLETIONS, CHAT] {
            let front = Front::start(mode, |_| {}).await;
            let body =
                json!({"prompt": "hi", "messages": [{"role": "user", "content": "x"}], "foo": 1});
            let mut answers = Vec::new();
            for (slow, fast) in [
                (&front.prefill, &front.decode),
                (&front.decode, &front.prefill),
            ] {
                slow.set(|b| {
                    *b = Behavior::failing(400, refusal.clone());
                    b.delay = Duration::from_millis(300);
                });
                fast.set(|b| *b = Behavior::failing(400, refusal.clone()));
                let (status, upstream, answer) = front.post(path, &body, None).await;
                assert_eq!(status, 400, "{mode:?} {path}: {answer}");
                // A proxy without keys tells anyone which engine failed, in the header only.
                let upstream = upstream.expect("x-pd-upstream on a proxy without keys");
                assert!(upstream.contains("127.0.0.1"), "{upstream}");
                let error = error_of(&answer).clone();
                assert_eq!(
                    error,
                    json!({"message": "'foo' is not a valid sampling field",
                        "type": "invalid_request_error", "param": "foo", "code": null})
                );
                answers.push(answer);
            }
            assert_eq!(answers[0], answers[1], "{mode:?} {path}");
        }
    }
}

#[tokio::test]
async fn with_an_admin_key_only_operators_learn_which_engine_failed() {
    let front = Front::start(Mode::Concurrent, |config| {
        config.admin_key = Some("operator-key".to_owned());
    })
    .await;
    front.decode.set(|b| {
        *b = Behavior::failing(
            500,
            json!({"detail": "CUDA error: an illegal memory access"}),
        )
    });
    let body = json!({"prompt": "hi"});
    let (status, upstream, answer) = front.post(COMPLETIONS, &body, None).await;
    assert_eq!(status, 500, "{answer}");
    assert_eq!(upstream, None);
    assert_eq!(error_of(&answer)["type"], "upstream_error");
    let (status, upstream, answer) = front.post(COMPLETIONS, &body, Some("operator-key")).await;
    assert_eq!(status, 500, "{answer}");
    names_the_decode(upstream, "the operator is told");
}

/// `x-pd-upstream`, which must be there (`why`) and name the mock decode.
fn names_the_decode(upstream: Option<String>, why: &str) {
    let upstream = upstream.unwrap_or_else(|| panic!("no x-pd-upstream: {why}"));
    assert!(
        upstream.starts_with("decode http://127.0.0.1:"),
        "{upstream}"
    );
}

#[tokio::test]
async fn a_down_engine_is_not_named_to_the_client() {
    let front = Front::start(Mode::Concurrent, |_| {}).await;
    front.decode.served.stop();
    let (status, upstream, answer) = front
        .post(COMPLETIONS, &json!({"prompt": "hi"}), None)
        .await;
    assert!(status.is_server_error(), "{status} {answer}");
    error_of(&answer);
    // A proxy without keys has no one to hide it from: the header says which engine.
    names_the_decode(upstream, "a proxy without keys names the engine");
}

#[tokio::test]
async fn with_tenants_an_operator_names_the_admin_key_in_a_header_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    std::fs::write(&keys, "[tenants.team]\nkeys = [\"team-key\"]\n").unwrap();
    let front = Front::start(Mode::Concurrent, |config| {
        config.admin_key = Some("operator-key".to_owned());
        config.api_keys_file = Some(keys.clone());
    })
    .await;
    front
        .decode
        .set(|b| *b = Behavior::failing(500, json!({"detail": "CUDA error"})));
    let ask = |admin: Option<&'static str>| {
        let mut request = client()
            .post(format!("{}{COMPLETIONS}", front.proxy.url()))
            .bearer_auth("team-key")
            .json(&json!({"prompt": "hi"}));
        if let Some(admin) = admin {
            request = request.header("x-pd-admin-key", admin);
        }
        async move {
            let answer = request.send().await.unwrap();
            assert!(answer.status().is_server_error(), "{}", answer.status());
            (answer.headers().get("x-pd-upstream")).map(|v| v.to_str().unwrap().to_owned())
        }
    };
    assert_eq!(ask(None).await, None);
    assert_eq!(ask(Some("not-the-key")).await, None);
    names_the_decode(ask(Some("operator-key")).await, "the operator is told");
    // The admin key alone is no tenant's key.
    let (status, upstream, _) = front
        .post(COMPLETIONS, &json!({"prompt": "hi"}), Some("operator-key"))
        .await;
    assert_eq!((status, upstream), (StatusCode::UNAUTHORIZED, None));
}

/// An engine that refuses every POST as soon as its headers are in, answering 413 and closing
/// without reading the body (as an engine over its body limit does); GETs (health, models) get
/// a 200.
async fn refusing_engine() -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if stream.read(&mut byte).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(byte[0]);
                }
                let (status, body) = match head.starts_with(b"POST") {
                    true => (
                        "413 Payload Too Large",
                        r#"{"error": {"message": "the prompt is over 1 MiB", "type": "BadRequestError", "param": null, "code": 413}}"#,
                    ),
                    false => ("200 OK", r#"{"object": "list", "data": []}"#),
                };
                let answer = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
                // Closed with the body unread: the sender's next writes fail.
            });
        }
    });
    url
}

#[tokio::test]
async fn an_engine_refusing_a_body_before_reading_it_is_heard() {
    let prefill = refusing_engine().await;
    let decode = refusing_engine().await;
    let bootstrap = Bootstrap::start(topology(&[(0, "engine-0")])).await;
    let target = PrefillTarget {
        url: prefill,
        bootstrap_addr: Some(bootstrap.url()),
    };
    let proxy = start_proxy(config(vec![target], vec![decode])).await;
    wait_ready(&proxy).await;
    // 10 MB: under the proxy's own limit, far over what the sockets buffer.
    let prompt = "x".repeat(10 << 20);
    for _ in 0..3 {
        let answer = client()
            .post(format!("{}/v1/completions", proxy.url()))
            .json(&json!({"prompt": prompt}))
            .send()
            .await
            .unwrap();
        let status = answer.status();
        let body: Value = answer.json().await.unwrap();
        assert_eq!(status, 413, "{body}");
        assert_eq!(error_of(&body)["message"], "the prompt is over 1 MiB");
    }
}

#[tokio::test]
async fn a_body_over_the_proxys_limit_is_refused_before_any_engine_is_called() {
    let front = Front::start(Mode::Concurrent, |config| {
        config.clients.max_body_bytes = 1 << 20;
    })
    .await;
    let body = json!({"prompt": "x".repeat(2 << 20)});
    let (status, _, answer) = front.post(COMPLETIONS, &body, None).await;
    assert_eq!(status, 413, "{answer}");
    error_of(&answer);
    assert!(front.prefill.seen().is_empty() && front.decode.seen().is_empty());
}
