//! Traces: the real `pd-proxy` binary exporting over OTLP to a receiver started by the test.
//! One request's spans (the request, pick, prefill, decode, relay) share the trace id that
//! reached P and D in their `traceparent`; a client's trace is continued, its sampling decision
//! kept; without a collector the proxy still passes the client's context on to the engines.

mod common;

use std::time::Duration;

use common::binary::in_front_of;
use common::{client, topology, Bootstrap, Mock};
use pd_service::otlp_receiver::{OtlpReceiver, ReceivedSpan};
use serde_json::json;
use tokio::process::Child;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// The binary in front of `prefill` (its bootstrap server `bootstrap`) and `decode`, with
/// `env` (and `RUST_LOG=info`); once ready. Returns it and its URL.
async fn proxy(
    prefill: &Mock,
    bootstrap: &Bootstrap,
    decode: &Mock,
    env: &[(&str, &str)],
) -> (Child, String) {
    let env = [&[("RUST_LOG", "info")], env].concat();
    in_front_of(prefill, bootstrap, &[decode], &[], &env).await
}

/// `POST /v1/completions`, with `traceparent` when given.
async fn complete(url: &str, traceparent: Option<&str>) {
    let mut request = client()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": "traced", "max_tokens": 2}));
    if let Some(traceparent) = traceparent {
        request = request.header("traceparent", traceparent);
    }
    assert_eq!(request.send().await.unwrap().status(), 200);
}

/// The trace id and parent span id of a `traceparent`.
fn parts(traceparent: &str) -> (String, String, String) {
    let fields: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(fields.len(), 4, "{traceparent}");
    (
        fields[1].to_owned(),
        fields[2].to_owned(),
        fields[3].to_owned(),
    )
}

fn named<'a>(spans: &'a [ReceivedSpan], trace: &str, name: &str) -> &'a ReceivedSpan {
    spans
        .iter()
        .find(|s| s.trace_id == trace && s.name == name)
        .unwrap_or_else(|| panic!("no span {name} in trace {trace}: {spans:#?}"))
}

async fn engines() -> (Mock, Bootstrap, Mock) {
    let prefill = Mock::prefill().await;
    let bootstrap = Bootstrap::start(topology(&[(0, "engine-0")])).await;
    let decode = Mock::decode().await;
    (prefill, bootstrap, decode)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_one_trace_from_the_client_through_p_and_d() {
    let receiver = OtlpReceiver::start().await.unwrap();
    let (prefill, bootstrap, decode) = engines().await;
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "50"),
    ];
    let (mut child, url) = proxy(&prefill, &bootstrap, &decode, &env).await;

    // The client's trace is continued: P and D get it, each under its phase's span.
    complete(&url, Some(&format!("00-{TRACE}-{CLIENT_SPAN}-01"))).await;
    let p = prefill.wait_seen(1).await[0].clone();
    let d = decode.wait_seen(1).await[0].clone();
    let (p_trace, p_parent, p_flags) = parts(&p.header("traceparent").expect("P's traceparent"));
    let (d_trace, d_parent, _) = parts(&d.header("traceparent").expect("D's traceparent"));
    assert_eq!(
        (p_trace.as_str(), d_trace.as_str(), p_flags.as_str()),
        (TRACE, TRACE, "01")
    );
    let names = ["POST /v1/completions", "pick", "prefill", "decode", "relay"];
    let spans = receiver
        .wait_for(Duration::from_secs(10), |spans| {
            names
                .iter()
                .all(|n| spans.iter().any(|s| s.trace_id == TRACE && s.name == *n))
        })
        .await;
    let request = named(&spans, TRACE, "POST /v1/completions");
    assert_eq!(request.service, "pd-proxy");
    assert_eq!(
        request.parent_span_id, CLIENT_SPAN,
        "the client's span is the parent"
    );
    for phase in ["pick", "prefill", "decode", "relay"] {
        assert_eq!(
            named(&spans, TRACE, phase).parent_span_id,
            request.span_id,
            "{phase}"
        );
    }
    assert_eq!(
        named(&spans, TRACE, "prefill").span_id,
        p_parent,
        "P is under the prefill span"
    );
    assert_eq!(
        named(&spans, TRACE, "decode").span_id,
        d_parent,
        "D is under the decode span"
    );
    let attribute = |key: &str| request.attributes.get(key).cloned().unwrap_or_default();
    assert_eq!(attribute("pd.decision"), "disaggregated");
    assert_eq!(attribute("pd.prefill"), prefill.url());
    assert_eq!(attribute("pd.decode"), decode.url());
    assert_eq!(attribute("pd.outcome"), "ok");
    let transfer = d.body["kv_transfer_params"]["transfer_id"]
        .as_str()
        .unwrap();
    assert_eq!(attribute("pd.transfer_id"), transfer);

    // Without a client trace, the proxy starts one; P and D share it.
    complete(&url, None).await;
    let p = prefill.wait_seen(2).await[1].clone();
    let d = decode.wait_seen(2).await[1].clone();
    let (trace, _, _) = parts(&p.header("traceparent").unwrap());
    assert_eq!(parts(&d.header("traceparent").unwrap()).0, trace);
    let spans = receiver
        .wait_for(Duration::from_secs(10), |s| {
            s.iter().any(|s| s.trace_id == trace && s.name == "relay")
        })
        .await;
    assert_eq!(
        named(&spans, &trace, "POST /v1/completions").parent_span_id,
        ""
    );

    // A client's decision not to sample is kept: passed on, nothing exported.
    let unsampled = "0af7651916cd43dd8448eb211c80319c";
    complete(&url, Some(&format!("00-{unsampled}-{CLIENT_SPAN}-00"))).await;
    let p = prefill.wait_seen(3).await[2].clone();
    let (trace, _, flags) = parts(&p.header("traceparent").unwrap());
    assert_eq!((trace.as_str(), flags.as_str()), (unsampled, "00"));
    // The spans of the requests before are all in; none of this one follows.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!receiver.spans().iter().any(|s| s.trace_id == unsampled));
    child.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_collector_the_clients_context_still_reaches_p_and_d() {
    let (prefill, bootstrap, decode) = engines().await;
    let (mut child, url) = proxy(&prefill, &bootstrap, &decode, &[]).await;
    let traceparent = format!("00-{TRACE}-{CLIENT_SPAN}-01");
    complete(&url, Some(&traceparent)).await;
    let p = prefill.wait_seen(1).await[0].clone();
    let d = decode.wait_seen(1).await[0].clone();
    assert_eq!(
        p.header("traceparent").as_deref(),
        Some(traceparent.as_str())
    );
    assert_eq!(
        d.header("traceparent").as_deref(),
        Some(traceparent.as_str())
    );
    // And no context is made up for a client that sent none.
    complete(&url, None).await;
    assert_eq!(prefill.wait_seen(2).await[1].header("traceparent"), None);
    child.kill().await.unwrap();
}

/// A streamed answer whose decode breaks mid-answer goes on on the other decode: the move is
/// a `migration` span of the request, from the failure to the continuation's first byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_is_a_span_of_its_request() {
    let receiver = OtlpReceiver::start().await.unwrap();
    let (prefill, bootstrap, broken) = engines().await;
    let other = Mock::decode().await;
    // The first decode sends a token (and the prompt's ids) and closes; the other goes on.
    broken.set(|b| {
        b.chunks = vec![
            r#"{"id":"c1","created":1,"model":"m","choices":[{"index":0,"text":"Hel","prompt_token_ids":[1,2],"token_ids":[7]}]}"#.into(),
        ];
    });
    other.set(|b| {
        b.chunks = vec![
            r#"{"id":"c2","created":2,"model":"m","choices":[{"index":0,"text":"lo","finish_reason":"length","prompt_token_ids":[1,2,7],"token_ids":[8]}]}"#.into(),
            "[DONE]".into(),
        ];
    });
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "50"),
    ];
    let policy = ["--decode-policy", "round_robin"];
    let (mut child, url) =
        in_front_of(&prefill, &bootstrap, &[&broken, &other], &policy, &env).await;
    let answer = client()
        .post(format!("{url}/v1/completions"))
        .header("traceparent", format!("00-{TRACE}-{CLIENT_SPAN}-01"))
        .json(&json!({"prompt": "moved", "max_tokens": 2, "stream": true}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        answer.contains(r#""text":"Hel""#) && answer.contains(r#""text":"lo""#),
        "{answer}"
    );
    assert!(
        answer.contains(r#""id":"c1""#) && !answer.contains("c2"),
        "one id: {answer}"
    );
    assert!(!answer.contains("token_ids"), "{answer}");
    let continued = other.wait_seen(1).await.remove(0);
    assert_eq!(continued.body["prompt"], json!([1, 2, 7]));
    assert_eq!(continued.body["max_tokens"], 1);
    let spans = receiver
        .wait_for(Duration::from_secs(10), |spans| {
            ["migration", "POST /v1/completions"]
                .iter()
                .all(|n| spans.iter().any(|s| s.trace_id == TRACE && s.name == *n))
        })
        .await;
    let request = named(&spans, TRACE, "POST /v1/completions");
    let migration = named(&spans, TRACE, "migration");
    assert_eq!(migration.parent_span_id, request.span_id);
    assert_eq!(
        migration.attributes.get("server.address").cloned(),
        Some(broken.url())
    );
    child.kill().await.unwrap();
}
