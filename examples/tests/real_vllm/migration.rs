//! A decode lost mid-answer, with real vLLM engines: a prefill and three decodes (Mooncake),
//! greedy decoding. The decode streaming a long answer (the one `x-pd-route` names) is frozen
//! (SIGSTOP: it holds its connection and sends nothing) or killed (SIGKILL) after its first
//! tokens; the client's stream goes on, whole, and its text equals the engine's own answer
//! token for token, for a completion and for a chat.

use super::*;
use pd_examples::bench::migration::{disturbed, migrations, Fault};

/// Tokens of each answer: long enough to be cut in the middle, even when the engine runs well
/// ahead of the client (a loaded machine; 160 once let a whole answer be in flight before the
/// fault), within the tiny model's 256-token context.
const TOKENS: u64 = 200;
/// Content chunks the client reads before the fault: few, so that most of the answer is yet
/// to come.
const BEFORE_FAULT: usize = 6;

/// A long greedy answer asked of `path`.
fn long_answer(path: &str) -> Value {
    let mut body = greedy(path, SHORT_PROMPT, true);
    body["max_tokens"] = json!(TOKENS);
    body.as_object_mut().unwrap().remove("return_token_ids");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_frozen_or_killed_mid_answer_is_continued_token_for_token() {
    let _one = ONE_CLUSTER.lock().await;
    let (mut spec, _dir) = spec("real-migration-", engines(Connector::Mooncake).await);
    spec.decodes = 3;
    spec.proxy_args
        .extend(["--decode-stall-timeout", "3"].map(String::from));
    let mut cluster = start(&spec).await;
    let http = reqwest::Client::new();
    // Frozen first (the engine lives on once thawed), then killed: three decodes leave one.
    for fault in [Fault::Freeze, Fault::Kill] {
        for path in ["/v1/completions", "/v1/chat/completions"] {
            let body = long_answer(path);
            let expected = reference(&http, &cluster.prefills[0], path, &body).await;
            let through = (disturbed(&mut cluster, path, &body, fault, BEFORE_FAULT).await)
                .unwrap_or_else(|err| panic!("{fault:?} {path}: {err}"));
            assert!(
                through.done && through.errors.is_empty() && !through.token_ids,
                "{fault:?} {path}: {through:?}"
            );
            assert_eq!(through.text, expected, "{fault:?} {path}");
            let gap = through.gap.expect("tokens came after the fault");
            eprintln!("{fault:?} {path}: the next token {gap:?} after the fault");
        }
    }
    for reason in ["stalled", "broken"] {
        let moved = migrations(&cluster.proxy.url, reason, "resumed")
            .await
            .unwrap();
        assert_eq!(moved, 2, "{reason}");
    }
    cluster.shutdown().await;
}
