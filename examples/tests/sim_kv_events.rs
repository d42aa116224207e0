//! sim-engine's token ids and KV cache events, against the real binary on 127.0.0.1: what a
//! proxy following vLLM's events sees (ZMQ SUB and the replay ROUTER, decoded with
//! `pd_protocol::kv_events`), and `/tokenize` as vLLM answers it.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{next, post, sim_engine, source, stored, subscribe, text, EVENTS, WAIT};
use pd_examples::cluster::{free_port, Process};
use pd_protocol::kv_events::{BlockHash, EventBatch, KvEvent};
use pd_tokenize::{ChatRequest, Tokenizer};
use serde_json::{json, Value};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// A decode engine serving requests alone, with `args`.
async fn engine(args: &[&str]) -> (Process, tempfile::TempDir) {
    sim_engine(args, &[]).await
}

async fn tokenize(engine: &Process, body: Value) -> Vec<u32> {
    let (status, answer) = post(&format!("{}/tokenize", engine.url), body).await;
    assert_eq!(status, 200, "{answer}");
    serde_json::from_value(answer["tokens"].clone()).unwrap()
}

async fn complete(engine: &Process, prompt: &str) {
    let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 1});
    let (status, answer) = post(&format!("{}/v1/completions", engine.url), body).await;
    assert_eq!(status, 200, "{answer}");
}

fn removed(event: &KvEvent) -> &[BlockHash] {
    match event {
        KvEvent::BlockRemoved(removed) => &removed.block_hashes,
        other => panic!("not BlockRemoved: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_publishes_its_whole_blocks_chained_on_their_parents() {
    let (engine, _dir) =
        engine(&["--prefix-cache-blocks", "64", "--kv-events-config", EVENTS]).await;
    let mut sub = subscribe(&engine).await;
    let first = text("the first prompt ", 40);
    complete(&engine, &first).await;
    let tokens = tokenize(&engine, json!({"prompt": first})).await;
    assert_eq!(tokens.len(), 40);
    let (seq, batch) = next(&mut sub).await;
    assert_eq!((seq, batch.data_parallel_rank), (0, Some(0)));
    let blocks = stored(&batch.events[0]);
    assert_eq!(blocks.token_ids, tokens[..32], "two whole blocks of 16");
    assert_eq!((blocks.block_hashes.len(), blocks.block_size), (2, 16));
    assert_eq!(blocks.parent_block_hash, None);
    assert_eq!(blocks.medium.as_deref(), Some("GPU"));
    assert_eq!(blocks.lora_name, None);

    // The prompt and 20 more tokens: its third block, chained on the second.
    let second = format!("{first}{}", text("more ", 20));
    complete(&engine, &second).await;
    let tokens = tokenize(&engine, json!({"prompt": second})).await;
    let (seq, batch) = next(&mut sub).await;
    let next_block = stored(&batch.events[0]);
    assert_eq!(seq, 1);
    assert_eq!(
        next_block.parent_block_hash.as_ref(),
        blocks.block_hashes.last()
    );
    assert_eq!(next_block.token_ids, tokens[32..48]);
    let stats: Value = reqwest::get(format!("{}/stats", engine.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stats["prefix_cache_hits"], 32);
    assert_eq!(stats["kv_events_published"], 2);
    let metrics = reqwest::get(format!("{}/metrics", engine.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("sim:kv_event_batches_published_total{model_name=\"sim-model\"} 2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_cache_evicts_and_says_which_blocks_left_then_a_reset_clears_all() {
    let (engine, _dir) =
        engine(&["--prefix-cache-blocks", "4", "--kv-events-config", EVENTS]).await;
    let mut sub = subscribe(&engine).await;
    complete(&engine, &text("a", 64)).await;
    let (_, batch) = next(&mut sub).await;
    let first = stored(&batch.events[0]).block_hashes.clone();
    assert_eq!(first.len(), 4);
    // Two new blocks in a full cache of four: the two least recently used leave first, the
    // first prompt's tail (as vLLM frees a request's blocks in reverse order).
    complete(&engine, &text("b", 32)).await;
    let (_, batch) = next(&mut sub).await;
    let gone: Vec<BlockHash> = batch.events[..2]
        .iter()
        .flat_map(|e| removed(e).to_vec())
        .collect();
    assert_eq!(gone, [first[3].clone(), first[2].clone()]);
    assert_eq!(stored(&batch.events[2]).block_hashes.len(), 2);

    let reset = post(&format!("{}/reset_prefix_cache", engine.url), json!({})).await;
    assert_eq!(reset, (200, json!({"success": true})));
    let (_, batch) = next(&mut sub).await;
    assert_eq!(batch.events, vec![KvEvent::AllBlocksCleared]);
}

/// Asks the replay socket at `endpoint` for every batch from `from`: their sequence numbers,
/// and whether the end marker came last.
async fn replay(endpoint: &str, from: u64) -> (Vec<i64>, bool) {
    let mut dealer = DealerSocket::new();
    dealer.connect(endpoint).await.unwrap();
    let request: ZmqMessage = vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())]
        .try_into()
        .unwrap();
    dealer.send(request).await.unwrap();
    let mut seqs = Vec::new();
    loop {
        let reply = tokio::time::timeout(WAIT, dealer.recv()).await;
        let frames = reply.expect("a reply in time").unwrap().into_vec();
        assert_eq!((frames.len(), &frames[0][..]), (4, &b""[..]), "{frames:?}");
        let seq = i64::from_be_bytes(frames[2][..].try_into().unwrap());
        if seq == -1 {
            return (seqs, frames[1].is_empty() && frames[3].is_empty());
        }
        assert_eq!(&frames[1][..], b"kv");
        EventBatch::decode(&frames[3]).unwrap();
        seqs.push(seq);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missed_batches_are_replayed_from_any_sequence_number() {
    let (engine, _dir) =
        engine(&["--prefix-cache-blocks", "64", "--kv-events-config", EVENTS]).await;
    // Nobody subscribed: the three batches are only in the replay ring.
    for tag in ["x", "y", "z"] {
        complete(&engine, &text(tag, 16)).await;
    }
    let endpoint = source(&engine, "0").await["replay_endpoint"]
        .as_str()
        .unwrap()
        .to_owned();
    // The last batch is queued before the answer: wait until it was sent.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(replay(&endpoint, 0).await, (vec![0, 1, 2], true));
    assert_eq!(replay(&endpoint, 1).await, (vec![1, 2], true));
    assert_eq!(replay(&endpoint, 3).await, (vec![], true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_dp_rank_has_its_cache_and_its_publisher_on_an_offset_port() {
    let base = free_port();
    let config = format!(
        r#"{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{base}", "topic": "kv"}}"#
    );
    let args = [
        "--dp-size",
        "2",
        "--prefix-cache-blocks",
        "8",
        "--kv-events-config",
        &config,
    ];
    let (engine, _dir) = engine(&args).await;
    let rank1 = source(&engine, "1").await;
    assert_eq!(rank1["endpoint"], format!("tcp://*:{}", base + 1));
    assert_eq!(
        source(&engine, "0").await["endpoint"],
        format!("tcp://*:{base}")
    );
    let mut sub = SubSocket::new();
    sub.connect(&format!("tcp://127.0.0.1:{}", base + 1))
        .await
        .unwrap();
    sub.subscribe("kv").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let response = reqwest::Client::new()
        .post(format!("{}/v1/completions", engine.url))
        .header("X-data-parallel-rank", "1")
        .json(&json!({"prompt": text("r", 16), "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let (seq, batch) = next(&mut sub).await;
    assert_eq!((seq, batch.data_parallel_rank), (0, Some(1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_answers_pd_tokenize_s_ids_and_names_a_bad_field() {
    let (engine, _dir) = engine(&[]).await;
    let dir = tempfile::tempdir().unwrap();
    pd_tokenize::byte_level::write(dir.path()).unwrap();
    let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();

    let prompt = "Héllo, wörld";
    let (status, answer) = post(
        &format!("{}/tokenize", engine.url),
        json!({"prompt": prompt}),
    )
    .await;
    assert_eq!(status, 200);
    let ids = tokenizer.encode(prompt, true).unwrap();
    assert_eq!(answer["tokens"], json!(ids));
    assert_eq!(answer["count"], ids.len());
    assert!(answer["max_model_len"].as_u64().unwrap() > 0);
    assert_eq!(answer["token_strs"], Value::Null);

    let messages =
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]);
    let chat = tokenize(&engine, json!({"model": "sim-model", "messages": messages})).await;
    let raw = messages.to_string();
    assert_eq!(
        chat,
        tokenizer.encode_chat(&ChatRequest::new(&raw)).unwrap()
    );

    for (body, field) in [
        (json!({"prompt": 5}), "`prompt`"),
        (json!({"model": "sim-model"}), "`prompt`"),
        (json!({"messages": "hi"}), "`messages`"),
        (
            json!({"prompt": "x", "add_special_tokens": "yes"}),
            "`add_special_tokens`",
        ),
    ] {
        let (status, answer) = post(&format!("{}/tokenize", engine.url), body.clone()).await;
        assert_eq!(status, 400, "{body}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(field), "{body}: {message}");
    }
    // Without events there are no sources, as an engine that publishes none.
    let sources = reqwest::get(format!("{}/kv_event_sources", engine.url))
        .await
        .unwrap();
    assert_eq!(sources.status(), 404);
}

/// vLLM's own decoder (its `KVEventBatch` msgspec struct, from the pinned vLLM CPU environment
/// of `examples/vllm/cpu/venv.sh`) reads sim-engine's live stream: stores and removals of a
/// small cache, every field vLLM requires present. What llm-d's KV cache manager or Dynamo's
/// router, reading vLLM's events with vLLM's classes, would see.
#[tokio::test]
async fn vllms_own_classes_decode_the_sims_events() {
    let python = pd_examples::vllm::cpu_python()
        .await
        .expect("the vLLM CPU environment (examples/vllm/cpu/venv.sh)");
    let (engine, _dir) =
        engine(&["--prefix-cache-blocks", "4", "--kv-events-config", EVENTS]).await;
    let endpoint = source(&engine, "0").await["endpoint"]
        .as_str()
        .unwrap()
        .to_owned();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/vllm/decode_kv_events.py");
    let mut decoder = tokio::process::Command::new(&python)
        .args([script, &endpoint, "kv", "6"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdout = tokio::io::BufReader::new(decoder.stdout.take().unwrap());
    let mut ready = String::new();
    let read = tokio::io::AsyncBufReadExt::read_line(&mut stdout, &mut ready);
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ready.trim(), "ready");
    // The subscription takes a moment to reach the publisher; prompts go on until the script
    // has its batches (stores, and removals once the 4 blocks are full).
    let sending = async {
        for i in 0.. {
            complete(&engine, &text(&format!("vllm decodes {i} "), 64)).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let mut out = String::new();
    let reading = tokio::io::AsyncReadExt::read_to_string(&mut stdout, &mut out);
    tokio::select! {
        read = reading => { read.unwrap(); }
        () = sending => unreachable!("the prompts never end"),
        () = tokio::time::sleep(Duration::from_secs(60)) => panic!("no decoded batches in 60 s"),
    };
    let finished = decoder.wait_with_output().await.unwrap();
    assert!(
        finished.status.success(),
        "vLLM's decoder refused sim-engine's events: {}{out}",
        String::from_utf8_lossy(&finished.stderr)
    );
    let batches: Vec<Value> = (out.lines())
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(batches.len(), 6, "{out}");
    let types: Vec<&str> = (batches.iter())
        .flat_map(|b| b["types"].as_array().unwrap())
        .map(|t| t.as_str().unwrap())
        .collect();
    assert!(
        types.contains(&"BlockStored") && types.contains(&"BlockRemoved"),
        "{types:?}"
    );
    // A batch may begin with removals (the cache full before the subscription reached it).
    let stored = (batches.iter())
        .find(|b| b["stored"].is_object())
        .unwrap_or_else(|| panic!("no batch stored a block: {out}"));
    for field in [
        "block_hashes",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
    ] {
        assert!(
            stored["stored"].get(field).is_some(),
            "no {field}: {stored}"
        );
    }
}
