//! sim-engine serving a model and LoRA adapters as vLLM 0.32 does, against the real binary on
//! 127.0.0.1: `/v1/models`, the 404 for a model not served, adapters loaded and unloaded at run
//! time (only when `VLLM_ALLOW_RUNTIME_LORA_UPDATING` allows it), an adapter's KV cache events,
//! and a P/D cluster serving two models.
//!
//! The cluster test needs the workspace binaries in the test's target folder, which `cargo test
//! --workspace` builds.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{next, post, sim_engine, stored, subscribe, text, EVENTS};
use pd_examples::cluster::{Cluster, ClusterSpec, PrefillShape, Process};
use pd_protocol::kv_events::ExtraValue;
use serde_json::{json, Value};

const ADAPTERS: [&str; 3] = [
    "--lora-modules",
    "sim-lora-a=/adapters/a",
    r#"{"name": "sim-lora-b", "path": "/adapters/b", "base_model_name": "sim-model"}"#,
];

/// vLLM's runtime loading allowed.
const RUNTIME: [(&str, &str); 1] = [("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")];

async fn get(url: &str) -> (u16, Value) {
    let response = reqwest::get(url).await.unwrap();
    (response.status().as_u16(), response.json().await.unwrap())
}

/// POSTs `body` as JSON: the status and the answer's text.
async fn post_text(url: &str, body: Value) -> (u16, String) {
    let response = reqwest::Client::new()
        .post(url)
        .json(&body)
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

async fn complete(engine: &str, model: &str, prompt: &str) -> (u16, Value) {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 2});
    post(&format!("{engine}/v1/completions"), body).await
}

/// The ids of `/v1/models`.
async fn model_ids(engine: &str) -> Vec<String> {
    let (status, list) = get(&format!("{engine}/v1/models")).await;
    assert_eq!(status, 200);
    let cards = list["data"].as_array().unwrap();
    cards
        .iter()
        .map(|c| c["id"].as_str().unwrap().into())
        .collect()
}

/// A card's fields but the ones that change (`created`, the permission's id).
fn stable(card: &Value) -> Value {
    let mut card = card.clone();
    assert!(card["created"].as_u64().unwrap() > 1_700_000_000, "{card}");
    card["created"] = Value::Null;
    if let Some(permission) = card.get_mut("permission").and_then(|p| p.get_mut(0)) {
        let id = permission["id"].as_str().unwrap();
        assert!(id
            .strip_prefix("modelperm-")
            .is_some_and(|hex| hex.len() == 16));
        permission["id"] = Value::Null;
        permission["created"] = Value::Null;
    }
    card
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_lists_the_base_model_then_each_adapter_as_vllm_and_sglang_do() {
    let (engine, _dir) = sim_engine(&ADAPTERS, &[]).await;
    let (status, list) = get(&format!("{}/v1/models", engine.url)).await;
    assert_eq!((status, &list["object"]), (200, &json!("list")));
    let permission = json!({"id": null, "object": "model_permission", "created": null,
        "allow_create_engine": false, "allow_sampling": true, "allow_logprobs": true,
        "allow_search_indices": false, "allow_view": true, "allow_fine_tuning": false,
        "organization": "*", "group": null, "is_blocking": false});
    let card = |id: &str, root: &str, parent: Value, len: Value| {
        json!({"id": id, "object": "model", "created": null, "owned_by": "vllm", "root": root,
               "parent": parent, "max_model_len": len, "permission": [permission]})
    };
    let cards: Vec<Value> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(stable)
        .collect();
    assert_eq!(
        cards,
        [
            card("sim-model", "sim-model", Value::Null, json!(131_072)),
            card("sim-lora-a", "/adapters/a", json!("sim-model"), Value::Null),
            card("sim-lora-b", "/adapters/b", json!("sim-model"), Value::Null),
        ]
    );
    let (_, stats) = get(&format!("{}/stats", engine.url)).await;
    assert_eq!(stats["lora_adapters"], json!(["sim-lora-a", "sim-lora-b"]));

    let (sglang, _dir) = sim_engine(&["--dialect", "sglang", "--model", "sg"], &[]).await;
    let (_, list) = get(&format!("{}/v1/models", sglang.url)).await;
    let cards: Vec<Value> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(stable)
        .collect();
    assert_eq!(
        cards,
        [
            json!({"id": "sg", "object": "model", "created": null, "owned_by": "sglang",
                "root": "sg", "parent": null, "max_model_len": 131_072})
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_model_is_vllm_s_404_and_answers_name_the_model_served() {
    let (engine, _dir) = sim_engine(&ADAPTERS, &[]).await;
    let url = engine.url.as_str();
    let not_found = json!({"error": {"message":
        "The model `other` does not exist. Valid aliases: sim-model.",
        "type": "NotFoundError", "param": "model", "code": 404}});
    assert_eq!(complete(url, "other", "hi").await, (404, not_found.clone()));
    let chat = json!({"model": "other", "messages": [{"role": "user", "content": "hi"}]});
    let answer = post(&format!("{url}/v1/chat/completions"), chat).await;
    assert_eq!(answer, (404, not_found));
    for model in ["sim-model", "sim-lora-b"] {
        let (status, answer) = complete(url, model, "hi").await;
        assert_eq!((status, answer["model"].as_str()), (200, Some(model)));
    }
    // No model, or an empty one, is the base model.
    for body in [
        json!({"prompt": "hi"}),
        json!({"prompt": "hi", "model": ""}),
    ] {
        let (status, answer) = post(&format!("{url}/v1/completions"), body).await;
        assert_eq!((status, &answer["model"]), (200, &json!("sim-model")));
    }
    // Without VLLM_ALLOW_RUNTIME_LORA_UPDATING there are no load routes: FastAPI's 404.
    let load = json!({"lora_name": "c", "lora_path": "/c"});
    let answer = post(&format!("{url}/v1/load_lora_adapter"), load).await;
    assert_eq!(answer, (404, json!({"detail": "Not Found"})));
    let unload = json!({"lora_name": "sim-lora-a"});
    let answer = post(&format!("{url}/v1/unload_lora_adapter"), unload).await;
    assert_eq!(answer, (404, json!({"detail": "Not Found"})));
}

/// vLLM's `InvalidUserInput` answer.
fn invalid(message: &str) -> Value {
    json!({"error": {"message": message, "type": "InvalidUserInput", "param": null, "code": 400}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_load_and_unload_at_run_time_as_vllm_answers() {
    let args = ["--lora-load-delay-ms", "400", ADAPTERS[0], ADAPTERS[1]];
    let (engine, _dir) = sim_engine(&args, &RUNTIME).await;
    let url = engine.url.as_str();
    let (load, unload) = (
        format!("{url}/v1/load_lora_adapter"),
        format!("{url}/v1/unload_lora_adapter"),
    );
    // A request for an adapter being loaded waits for the load, as vLLM's resolution does.
    let started = Instant::now();
    let body = json!({"lora_name": "sim-lora-c", "lora_path": "/adapters/c"});
    let (loaded, (status, answer)) = tokio::join!(post_text(&load, body.clone()), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        complete(url, "sim-lora-c", "hi").await
    });
    let success = "Success: LoRA adapter 'sim-lora-c' added successfully.";
    assert_eq!(loaded, (200, success.to_owned()));
    assert!(started.elapsed() >= Duration::from_millis(400));
    assert_eq!((status, &answer["model"]), (200, &json!("sim-lora-c")));
    assert_eq!(
        model_ids(url).await,
        ["sim-model", "sim-lora-a", "sim-lora-c"]
    );

    let again = "The lora adapter 'sim-lora-c' has already been loaded. If you want to load the \
                 adapter in place, set 'load_inplace' to True.";
    assert_eq!(post(&load, body).await, (400, invalid(again)));
    let base = json!({"lora_name": "sim-model", "lora_path": "/x"});
    let conflict = "The lora adapter 'sim-model' conflicts with a served base model.";
    assert_eq!(post(&load, base).await, (400, invalid(conflict)));
    let empty = json!({"lora_name": "", "lora_path": "/x"});
    let both = "Both 'lora_name' and 'lora_path' must be provided.";
    assert_eq!(post(&load, empty).await, (400, invalid(both)));
    let (status, missing) = post(&load, json!({"lora_name": "d"})).await;
    assert_eq!(
        (
            status,
            &missing["error"]["type"],
            &missing["error"]["param"]
        ),
        (400, &json!("Bad Request"), &json!("body.lora_path"))
    );
    let message = missing["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("1 validation error:\n  {'type': 'missing'"));

    let gone = post_text(&unload, json!({"lora_name": "sim-lora-a"})).await;
    let removed = "Success: LoRA adapter 'sim-lora-a' removed successfully.";
    assert_eq!(gone, (200, removed.to_owned()));
    assert_eq!(complete(url, "sim-lora-a", "hi").await.0, 404);
    let unknown = json!({"error": {"message": "The lora adapter 'sim-lora-a' cannot be found.",
        "type": "NotFoundError", "param": null, "code": 404}});
    let answer = post(&unload, json!({"lora_name": "sim-lora-a"})).await;
    assert_eq!(answer, (404, unknown));
    assert_eq!(model_ids(url).await, ["sim-model", "sim-lora-c"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_s_blocks_carry_its_name_and_never_match_the_base_model_s() {
    let mut args = vec!["--prefix-cache-blocks", "64", "--kv-events-config", EVENTS];
    args.extend(ADAPTERS);
    let (engine, _dir) = sim_engine(&args, &[]).await;
    let url = engine.url.as_str();
    let mut sub = subscribe(&engine).await;
    let prompt = text("one prompt for every model ", 40);
    assert_eq!(complete(url, "sim-model", &prompt).await.0, 200);
    let (_, batch) = next(&mut sub).await;
    let base = stored(&batch.events[0]).clone();
    assert_eq!((base.lora_name, base.lora_id), (None, None));
    assert_eq!(base.extra_keys, [None, None]);

    let salted = json!({"model": "sim-lora-a", "prompt": prompt, "max_tokens": 1,
                        "cache_salt": "salt"});
    assert_eq!(post(&format!("{url}/v1/completions"), salted).await.0, 200);
    let (_, batch) = next(&mut sub).await;
    let adapted = stored(&batch.events[0]).clone();
    assert_eq!(adapted.lora_name.as_deref(), Some("sim-lora-a"));
    assert_eq!(adapted.lora_id, Some(1), "vLLM numbers adapters from 1");
    let keys = |keys: &[&str]| Some(keys.iter().map(|k| ExtraValue::Str((*k).into())).collect());
    assert_eq!(
        adapted.extra_keys,
        [keys(&["sim-lora-a", "salt"]), keys(&["sim-lora-a"])]
    );
    assert_eq!(adapted.parent_block_hash, None);
    assert_eq!(adapted.token_ids, base.token_ids);
    assert!(adapted
        .block_hashes
        .iter()
        .all(|h| !base.block_hashes.contains(h)));

    assert_eq!(complete(url, "sim-lora-b", &prompt).await.0, 200);
    let (_, batch) = next(&mut sub).await;
    let other = stored(&batch.events[0]).clone();
    assert_eq!(
        (other.lora_id, other.extra_keys[1].clone()),
        (Some(2), keys(&["sim-lora-b"]))
    );
    assert!(other
        .block_hashes
        .iter()
        .all(|h| !base.block_hashes.contains(h) && !adapted.block_hashes.contains(h)));
    let (_, stats) = get(&format!("{url}/stats")).await;
    assert_eq!(
        stats["prefix_cache_hits"], 0,
        "no adapter hit another's blocks"
    );
    // The same adapter again finds its own blocks.
    assert_eq!(complete(url, "sim-lora-b", &prompt).await.0, 200);
    let (_, stats) = get(&format!("{url}/stats")).await;
    assert_eq!(stats["prefix_cache_hits"], 32);
}

/// Its `/v1/models` ids and `/stats` model.
async fn served(engine: &str) -> (Vec<String>, Value) {
    let (_, stats) = get(&format!("{engine}/stats")).await;
    (model_ids(engine).await, stats["model"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_model_cluster_serves_each_model_and_its_adapters_on_its_own_engines() {
    let bin_dir = PathBuf::from(env!("CARGO_BIN_EXE_sim-engine"))
        .parent()
        .unwrap()
        .to_path_buf();
    let run_dir = tempfile::Builder::new()
        .prefix("models-")
        .tempdir()
        .unwrap();
    let mut spec = ClusterSpec::demo(bin_dir, run_dir.path().to_path_buf());
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }];
    spec.decodes = 1;
    spec.kv_events = false;
    spec.prefill_us_per_token = 10;
    spec.decode_ms_per_token = 1;
    spec.models = 2;
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let models = cluster.models();
    let names: Vec<&str> = models.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["sim-model-0", "sim-model-1"]);
    assert_eq!(models[0].adapters, ["sim-lora-a", "sim-lora-b"]);
    assert!(models[1].adapters.is_empty());
    let all = |p: &[Process]| p.iter().map(|p| p.url.clone()).collect::<Vec<_>>();
    let urls: Vec<String> = models.iter().flat_map(|m| m.prefills.clone()).collect();
    assert_eq!(urls, all(&cluster.prefills));
    let urls: Vec<String> = models.iter().flat_map(|m| m.decodes.clone()).collect();
    assert_eq!(urls, all(&cluster.decodes));
    for engine in models[0].prefills.iter().chain(&models[0].decodes) {
        let expected = (
            vec![
                "sim-model-0".into(),
                "sim-lora-a".into(),
                "sim-lora-b".into(),
            ],
            json!("sim-model-0"),
        );
        assert_eq!(served(engine).await, expected, "{engine}");
    }
    for engine in models[1].prefills.iter().chain(&models[1].decodes) {
        let expected = (vec!["sim-model-1".to_owned()], json!("sim-model-1"));
        assert_eq!(served(engine).await, expected, "{engine}");
    }

    // An adapter's request through P then D, as a proxy sends it: both take the adapter.
    let (prefill, decode) = (&models[0].prefills[0], &models[0].decodes[0]);
    let body = |kv: Value| {
        json!({"model": "sim-lora-a", "prompt": "an adapter's prompt",
                                  "max_tokens": 2, "kv_transfer_params": kv})
    };
    let to_p = body(json!({"do_remote_decode": true, "transfer_id": "xfer-lora"}));
    let (status, answer) = post(&format!("{prefill}/v1/completions"), to_p).await;
    assert_eq!(
        (status, &answer["model"]),
        (200, &json!("sim-lora-a")),
        "{answer}"
    );
    let to_d = body(answer["kv_transfer_params"].clone());
    let (status, answer) = post(&format!("{decode}/v1/completions"), to_d).await;
    assert_eq!(
        (status, &answer["model"]),
        (200, &json!("sim-lora-a")),
        "{answer}"
    );
    // Model 1's engines serve neither the adapter nor model 0; model 0's load a third adapter.
    let other = &models[1].decodes[0];
    assert_eq!(complete(other, "sim-lora-a", "x").await.0, 404);
    assert_eq!(complete(other, "sim-model-0", "x").await.0, 404);
    let load = json!({"lora_name": "sim-lora-c", "lora_path": "/adapters/c"});
    let (status, _) = post_text(&format!("{decode}/v1/load_lora_adapter"), load).await;
    assert_eq!(status, 200);
    assert_eq!(complete(decode, "sim-lora-c", "x").await.0, 200);
    cluster.shutdown().await;
}
