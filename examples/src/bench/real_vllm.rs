//! `pd-bench real-vllm`: what pd-proxy adds on real engines. The real-engine cluster (vLLM's
//! CPU build, the tiny model, Mooncake over TCP) serves the same requests two ways, one request
//! at a time and alternating: through pd-proxy, and as the same P and D calls made directly by
//! the benchmark (the engine id read from `/query` once, then P and D at once with the
//! `kv_transfer_params` the proxy would send). TTFT and total time of each.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::cluster::{Cluster, ClusterSpec, PrefillShape};
use crate::openai_client::{send, Answer};
use crate::vllm::{Connector, VllmEngines, TINY_MODEL_NAME};

/// One way of calling the engines, measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RealRow {
    /// `pd-proxy` or `direct P+D`.
    pub path: String,
    /// Whether the answers were streamed.
    pub stream: bool,
    /// Requests measured.
    pub requests: usize,
    /// Time to the first content byte, p50 and p90, in ms.
    pub ttft_p50_ms: f64,
    /// 90th percentile.
    pub ttft_p90_ms: f64,
    /// Time to the end of the answer, p50 and p90, in ms.
    pub total_p50_ms: f64,
    /// 90th percentile.
    pub total_p90_ms: f64,
}

/// Starts the cluster and measures `requests` requests per path and streaming mode.
pub async fn compare(
    bin_dir: &Path,
    run_dir: &Path,
    requests: usize,
) -> Result<Vec<RealRow>, String> {
    let run_dir = run_dir.join("real-vllm");
    let vllm = VllmEngines::cpu(&run_dir, Connector::Mooncake)
        .await
        .map_err(|err| err.to_string())?;
    let mut spec = ClusterSpec::demo(bin_dir.to_path_buf(), run_dir);
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }];
    spec.decodes = 1;
    spec.vllm = Some(vllm);
    let cluster = Cluster::start(&spec).await.map_err(|err| err.to_string())?;
    let result = measure(&cluster, requests).await;
    cluster.shutdown().await;
    result
}

async fn measure(cluster: &Cluster, requests: usize) -> Result<Vec<RealRow>, String> {
    let http = reqwest::Client::new();
    let engine_id = engine_id(&http, &cluster.bootstraps[0].url).await?;
    let mut rows = Vec::new();
    for stream in [false, true] {
        let (mut proxied, mut direct) = (Vec::new(), Vec::new());
        // One warm-up of each, then alternate so that drift affects both alike.
        for i in 0..=requests {
            // A prompt of about 100 tokens that no engine has cached from its first block on.
            let body = json!({
                "model": TINY_MODEL_NAME, "stream": stream, "max_tokens": 16, "temperature": 0,
                "ignore_eos": true,
                "prompt": format!("Request {i} of {stream}: {}", PROMPT),
            });
            let through = checked(
                send(
                    &http,
                    &format!("{}/v1/completions", cluster.proxy.url),
                    &body,
                    TIMEOUT,
                )
                .await,
            )?;
            let by_hand = direct_call(&http, cluster, &engine_id, body).await?;
            if i > 0 {
                proxied.push(through);
                direct.push(by_hand);
            }
        }
        rows.push(row("pd-proxy", stream, &proxied));
        rows.push(row("direct P+D", stream, &direct));
    }
    Ok(rows)
}

const TIMEOUT: Duration = Duration::from_secs(60);

/// About 90 tokens of the tiny model's tokenizer.
const PROMPT: &str = "Prefill computes the key and value cache of the whole prompt in one pass; \
    decode then produces one token at a time from that cache. Disaggregated serving runs the two \
    phases on separate engines. Explain why the sky is blue, in one sentence.";

/// P and D called at once, as the proxy calls them; D's answer.
async fn direct_call(
    http: &reqwest::Client,
    cluster: &Cluster,
    engine_id: &str,
    body: Value,
) -> Result<Answer, String> {
    let transfer_id = format!("xfer-{}", uuid::Uuid::new_v4());
    let mut to_p = body.clone();
    to_p["stream"] = json!(false);
    to_p["max_tokens"] = json!(1);
    to_p["kv_transfer_params"] = json!({
        "do_remote_decode": true, "do_remote_prefill": false, "transfer_id": transfer_id,
    });
    let mut to_d = body;
    to_d["kv_transfer_params"] = json!({
        "do_remote_decode": false, "do_remote_prefill": true, "transfer_id": transfer_id,
        "remote_bootstrap_addr": cluster.bootstraps[0].url, "remote_engine_id": engine_id,
    });
    let p_url = format!("{}/v1/completions", cluster.prefills[0].url);
    let d_url = format!("{}/v1/completions", cluster.decodes[0].url);
    let (p, d) = tokio::join!(
        send(http, &p_url, &to_p, TIMEOUT),
        send(http, &d_url, &to_d, TIMEOUT)
    );
    checked(p)?;
    checked(d)
}

fn checked(answer: Result<Answer, String>) -> Result<Answer, String> {
    let answer = answer?;
    if answer.status != 200 || answer.stream_error.is_some() {
        return Err(format!("request failed: {} {}", answer.status, answer.text));
    }
    Ok(answer)
}

async fn engine_id(http: &reqwest::Client, bootstrap: &str) -> Result<String, String> {
    let topology: Value = http
        .get(format!("{bootstrap}/query"))
        .timeout(TIMEOUT)
        .send()
        .await
        .map_err(|err| err.to_string())?
        .json()
        .await
        .map_err(|err| err.to_string())?;
    topology["0"]["engine_id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("no engine id for dp rank 0 in {topology}"))
}

fn row(path: &str, stream: bool, answers: &[Answer]) -> RealRow {
    let quantile = |pick: fn(&Answer) -> Duration, q: f64| {
        let mut ms: Vec<f64> = answers
            .iter()
            .map(|a| pick(a).as_secs_f64() * 1e3)
            .collect();
        ms.sort_by(f64::total_cmp);
        ms.get(((ms.len().max(1) - 1) as f64 * q).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    RealRow {
        path: path.to_owned(),
        stream,
        requests: answers.len(),
        ttft_p50_ms: quantile(|a| a.ttft, 0.5),
        ttft_p90_ms: quantile(|a| a.ttft, 0.9),
        total_p50_ms: quantile(|a| a.total, 0.5),
        total_p90_ms: quantile(|a| a.total, 0.9),
    }
}

/// The section of the report: [`compare`]'s rows as a Markdown table (also on stderr).
pub async fn section(bin_dir: &Path, run_dir: &Path, requests: usize) -> Result<String, String> {
    let table = table(&compare(bin_dir, run_dir, requests).await?);
    eprint!("{table}");
    Ok(table)
}

/// The rows as a Markdown table.
fn table(rows: &[RealRow]) -> String {
    let mut out = String::from("| path | streamed | requests | TTFT p50 ms | TTFT p90 ms | total p50 ms | total p90 ms |\n|---|---|---|---|---|---|---|\n");
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
            r.path,
            r.stream,
            r.requests,
            r.ttft_p50_ms,
            r.ttft_p90_ms,
            r.total_p50_ms,
            r.total_p90_ms
        ));
    }
    out
}
