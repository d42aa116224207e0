//! `pd-bench migration`: a decode lost mid-answer. A long streamed answer goes through pd-proxy;
//! after its first tokens the decode serving it (the one `x-pd-route` names) is killed
//! (SIGKILL) or frozen (SIGSTOP, thawed afterwards); the answer goes on on another decode. The
//! figure is the time from the fault to the client's next token, over repeated faults: with
//! sim engines (a fresh cluster per fault) and with the real vLLM CPU engines (three decodes,
//! each killed one started again on its port). [`disturbed`] is also what the tests use.

use std::path::Path;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};

use super::chart::{grouped_bars, Series};
use crate::cluster::{free_port, Cluster, ClusterSpec, PrefillShape};
use crate::vllm::{wait_ready, Connector, EngineRole, VllmEngines, TINY_MODEL_NAME};

/// What is done to the decode serving an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// SIGSTOP: the engine holds its connections and sends nothing (thawed afterwards).
    Freeze,
    /// SIGKILL: the engine and its processes die at once.
    Kill,
}

impl Fault {
    /// Its name in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Fault::Freeze => "freeze (SIGSTOP)",
            Fault::Kill => "kill (SIGKILL)",
        }
    }
}

/// A streamed answer disturbed by a fault, as the client saw it.
#[derive(Debug)]
pub struct Disturbed {
    /// Its text.
    pub text: String,
    /// Whether it ended with `[DONE]`.
    pub done: bool,
    /// Its error events' JSON.
    pub errors: Vec<Value>,
    /// Whether a chunk carried token ids (the proxy takes out those the client did not ask
    /// for).
    pub token_ids: bool,
    /// From the fault to the next content chunk.
    pub gap: Option<Duration>,
    /// The longest time between two content chunks before the fault.
    pub pace: Duration,
}

/// Streams `body` from the proxy's `path`, doing `fault` to the decode serving it after
/// `before` content chunks (a frozen decode is thawed at the end).
pub async fn disturbed(
    cluster: &mut Cluster,
    path: &str,
    body: &Value,
    fault: Fault,
    before: usize,
) -> Result<Disturbed, String> {
    let response = reqwest::Client::new()
        .post(format!("{}{path}", cluster.proxy.url))
        .header("x-pd-route", "1")
        .json(body)
        .send()
        .await
        .map_err(|err| err.to_string())?;
    if response.status() != 200 {
        return Err(format!("{path}: {}", response.status()));
    }
    let route = (response.headers().get("x-pd-route"))
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let decode_url = (route.split("; "))
        .find_map(|word| word.strip_prefix("decode="))
        .ok_or_else(|| format!("no decode in x-pd-route: {route:?}"))?;
    let decode = (cluster.decodes.iter())
        .position(|engine| engine.url == decode_url)
        .ok_or_else(|| format!("{decode_url} is not a decode"))?;
    let mut answer = Disturbed {
        text: String::new(),
        done: false,
        errors: Vec::new(),
        token_ids: false,
        gap: None,
        pace: Duration::ZERO,
    };
    let (mut pending, mut chunks) = (String::new(), 0);
    let (mut faulted, mut last) = (None::<Instant>, Instant::now());
    let mut stream = response.bytes_stream();
    while let Some(bytes) = tokio::time::timeout(Duration::from_secs(120), stream.next())
        .await
        .map_err(|_| format!("{path}: nothing for 120 s"))?
    {
        let bytes = bytes.map_err(|err| err.to_string())?;
        pending.push_str(&String::from_utf8_lossy(&bytes));
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                answer.done = true;
                continue;
            }
            let chunk: Value = serde_json::from_str(data).map_err(|err| err.to_string())?;
            if chunk.get("error").is_some() {
                answer.errors.push(chunk);
                continue;
            }
            let choice = &chunk["choices"][0];
            answer.token_ids |= choice.get("token_ids").is_some()
                || chunk.get("prompt_token_ids").is_some()
                || choice.get("prompt_token_ids").is_some();
            let piece = (choice["text"].as_str())
                .or(choice["delta"]["content"].as_str())
                .unwrap_or_default();
            if piece.is_empty() {
                continue;
            }
            answer.text.push_str(piece);
            chunks += 1;
            match faulted {
                Some(at) => {
                    answer.gap.get_or_insert_with(|| at.elapsed());
                }
                None if chunks > 1 => answer.pace = answer.pace.max(last.elapsed()),
                None => {}
            }
            last = Instant::now();
            if chunks == before {
                match fault {
                    Fault::Freeze => cluster.decodes[decode].freeze(true),
                    Fault::Kill => cluster.decodes[decode].kill().await,
                }
                faulted = Some(Instant::now());
            }
        }
    }
    if fault == Fault::Freeze {
        cluster.decodes[decode].freeze(false);
    }
    Ok(answer)
}

/// How many answers the proxy at `proxy_url` moved after their decode failed by `reason`, that
/// ended as `outcome` (its `pd_proxy_migrations_total`).
pub async fn migrations(proxy_url: &str, reason: &str, outcome: &str) -> Result<u64, String> {
    let metrics = reqwest::get(format!("{proxy_url}/metrics"))
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(|err| err.to_string())?
        .text()
        .await
        .map_err(|err| err.to_string())?;
    let series = format!("pd_proxy_migrations_total{{outcome=\"{outcome}\",reason=\"{reason}\"}} ");
    Ok((metrics.lines())
        .find_map(|line| line.strip_prefix(&series))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0))
}

/// The figures of one kind of fault on one kind of engine.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MigrationRow {
    /// `sim` or `vLLM (CPU)`.
    pub engines: String,
    /// What was done to the decode.
    pub fault: String,
    /// Faults measured.
    pub faults: usize,
    /// From the fault to the client's next token: p50, p99 and the largest, in ms.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// The largest.
    pub max_ms: f64,
    /// The largest gap between two tokens before the fault (the engine's own pace), in ms.
    pub pace_ms: f64,
    /// `--decode-stall-timeout` (what a freeze waits before the answer moves), in ms.
    pub stall_timeout_ms: f64,
}

/// The stall timeout the runs use, seconds.
const STALL_TIMEOUT_S: f64 = 1.0;
/// Content chunks before the fault.
const BEFORE: usize = 8;

/// Measures `faults` kills and freezes with sim engines, and with the real vLLM engines when
/// `real` (`faults` freezes, [`REAL_KILLS`] kills).
pub async fn rows(
    bin_dir: &Path,
    run_dir: &Path,
    faults: usize,
    real: bool,
) -> Result<Vec<MigrationRow>, String> {
    let mut rows = Vec::new();
    for fault in [Fault::Kill, Fault::Freeze] {
        let mut measured = Vec::new();
        for i in 0..faults {
            let dir = run_dir.join(format!("migration-sim-{i}"));
            let mut spec = cluster_spec(bin_dir, &dir, 2);
            spec.decode_ms_per_token = 10;
            let mut cluster = Cluster::start(&spec).await.map_err(|e| e.to_string())?;
            let body = json!({"model": "sim-model", "prompt": format!("answer {i}"),
                              "max_tokens": 32, "stream": true});
            let answer = disturbed(&mut cluster, "/v1/completions", &body, fault, BEFORE).await;
            cluster.shutdown().await;
            measured.push(checked(answer?)?);
        }
        rows.push(row("sim", fault, &measured));
    }
    if real {
        rows.extend(real_rows(bin_dir, run_dir, faults).await?);
    }
    Ok(rows)
}

/// One prefill and `decodes` decodes, pd-proxy with the stall timeout of these runs.
fn cluster_spec(bin_dir: &Path, run_dir: &Path, decodes: usize) -> ClusterSpec {
    let mut spec = ClusterSpec::demo(bin_dir.to_path_buf(), run_dir.to_path_buf());
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }];
    spec.decodes = decodes;
    spec.proxy_args = vec!["--decode-stall-timeout".into(), STALL_TIMEOUT_S.to_string()];
    spec
}

/// Kills of real engines measured (each killed decode is started again, 20 to 60 s).
const REAL_KILLS: usize = 8;

/// The real engines: three decodes, `faults` freezes (each thawed), then [`REAL_KILLS`] kills.
async fn real_rows(
    bin_dir: &Path,
    run_dir: &Path,
    faults: usize,
) -> Result<Vec<MigrationRow>, String> {
    let run_dir = run_dir.join("migration-vllm");
    let vllm =
        (VllmEngines::cpu(&run_dir, Connector::Mooncake).await).map_err(|e| e.to_string())?;
    let mut spec = cluster_spec(bin_dir, &run_dir, 3);
    spec.vllm = Some(vllm.clone());
    let mut cluster = Cluster::start(&spec).await.map_err(|e| e.to_string())?;
    let measured = real_faults(&mut cluster, &vllm, &run_dir, faults).await;
    cluster.shutdown().await;
    measured
}

/// The faults of [`real_rows`] on its `cluster`.
async fn real_faults(
    cluster: &mut Cluster,
    vllm: &VllmEngines,
    run_dir: &Path,
    faults: usize,
) -> Result<Vec<MigrationRow>, String> {
    let mut rows = Vec::new();
    for (fault, count) in [(Fault::Freeze, faults), (Fault::Kill, REAL_KILLS)] {
        let mut measured = Vec::new();
        for i in 0..count {
            let body = json!({"model": TINY_MODEL_NAME, "prompt": format!("Answer {i}: the sky"),
                              "max_tokens": 64, "temperature": 0, "ignore_eos": true,
                              "stream": true});
            let answer = disturbed(cluster, "/v1/completions", &body, fault, BEFORE).await?;
            measured.push(checked(answer)?);
            if fault == Fault::Kill {
                restart_killed(cluster, vllm, run_dir).await?;
            }
        }
        rows.push(row("vLLM (CPU)", fault, &measured));
    }
    Ok(rows)
}

/// Starts the decode of `cluster` that was killed again, on its port, and waits until it is
/// up.
async fn restart_killed(
    cluster: &mut Cluster,
    vllm: &VllmEngines,
    run_dir: &Path,
) -> Result<(), String> {
    let Some(killed) = (cluster.decodes.iter_mut()).position(|d| d.exited_or_reaped()) else {
        return Ok(());
    };
    let old = &cluster.decodes[killed];
    let port: u16 = (old.url.rsplit(':').next())
        .and_then(|port| port.parse().ok())
        .ok_or_else(|| format!("no port in {}", old.url))?;
    let name = format!("{}-again", old.name);
    let mut engine = (vllm.spawn(
        run_dir,
        &name,
        EngineRole::Decode,
        port,
        None,
        free_port(),
        None,
    ))
    .map_err(|e| e.to_string())?;
    wait_ready(&mut engine).await.map_err(|e| e.to_string())?;
    cluster.decodes[killed] = engine;
    Ok(())
}

/// `answer`, when it went on to its end.
fn checked(answer: Disturbed) -> Result<Disturbed, String> {
    match (answer.done, answer.errors.is_empty(), answer.gap) {
        (true, true, Some(_)) => Ok(answer),
        _ => Err(format!("the answer did not go on: {answer:?}")),
    }
}

/// The row of `measured` answers.
fn row(engines: &str, fault: Fault, measured: &[Disturbed]) -> MigrationRow {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut gaps: Vec<f64> = measured.iter().filter_map(|a| a.gap).map(ms).collect();
    gaps.sort_by(f64::total_cmp);
    let at = |q: f64| gaps[((gaps.len() - 1) as f64 * q).round() as usize];
    MigrationRow {
        engines: engines.to_owned(),
        fault: fault.as_str().to_owned(),
        faults: gaps.len(),
        p50_ms: at(0.5),
        p99_ms: at(0.99),
        max_ms: gaps.last().copied().unwrap_or_default(),
        pace_ms: measured.iter().map(|a| ms(a.pace)).fold(0.0, f64::max),
        stall_timeout_ms: STALL_TIMEOUT_S * 1e3,
    }
}

/// The rows as a Markdown table.
pub fn table(rows: &[MigrationRow]) -> String {
    let mut out = String::from(
        "| engines | fault | faults | next token after the fault p50 | p99 | max | the engine's own pace (max gap before) |\n\
         | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for row in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {:.0} ms | {:.0} ms | {:.0} ms | {:.0} ms |\n",
            row.engines, row.fault, row.faults, row.p50_ms, row.p99_ms, row.max_ms, row.pace_ms
        ));
    }
    out.push_str(&format!(
        "\nA freeze is seen after `--decode-stall-timeout` ({:.0} ms here): the rest is the \
         continuation's prefill and first token.\n",
        STALL_TIMEOUT_S * 1e3
    ));
    out
}

/// The chart: p50 and p99 per engines and fault.
pub fn charts(rows: &[MigrationRow]) -> Result<Vec<(&'static str, String)>, String> {
    let categories: Vec<String> = (rows.iter())
        .map(|row| format!("{}: {}", row.engines, row.fault))
        .collect();
    let series = [
        Series::of("p50", rows, |row| row.p50_ms),
        Series::of("p99", rows, |row| row.p99_ms),
    ];
    let chart = grouped_bars(
        "A decode lost mid-answer: from the fault to the next token",
        "ms",
        &categories,
        &series,
    )?;
    Ok(vec![("migration", chart)])
}
