//! One timed run: a fresh fleet for one system on one split, the trace replayed through its
//! front door at one rate (the autoscaler actuating alongside, for an autoscaled system), and
//! what the engines and the front door measured around it.

use std::time::{Duration, Instant};

use clap::ValueEnum;
use tokio::sync::watch;

use super::summary::{cpu, prefill_stats, summarize, Summary};
use super::{TimedRow, TimedSettings};
use crate::bench::fleet::autoscale::{self, Actuation};
use crate::bench::fleet::replay::replay;
use crate::bench::fleet::systems::{Front, Roles, System};
use crate::bench::fleet::trace::Trace;
use crate::cluster::{Cluster, ClusterSpec, PrefillShape};

/// The planner's pace in the GPU's seconds (divided by the time scale on the replay's clock):
/// demand over the last 30 s, a decision every 2 s, engines' metrics read every second, a duty
/// kept 10 s at least.
const PLANNER_PACE: [(&str, f64); 4] = [
    ("--planner-window", 30.0),
    ("--planner-interval", 2.0),
    ("--engine-metrics-interval", 1.0),
    ("--duty-dwell", 10.0),
];

/// The moving roles' safe time before the planner desires one engine fewer of a role, in the
/// GPU's seconds: a duty moved back costs only a warm-up, so the split follows the load within
/// 30 s (the autoscaled runs' is `--scale-down-after`: a stopped engine costs its start-up).
const MOVING_SCALE_DOWN_AFTER: f64 = 30.0;

/// pd-proxy's admin key in the autoscaled runs (127.0.0.1 only, a fresh fleet each run).
const ADMIN_KEY: &str = "pd-bench-autoscaler";

/// One system on one split at one rate, on a fresh fleet: with moving roles, `prefills +
/// decodes` engines of both roles, `prefills` of them on prefill duty at the start.
pub async fn run(
    settings: &TimedSettings,
    trace: &Trace,
    system: &System,
    (prefills, decodes): (usize, usize),
    rate: f64,
) -> Result<TimedRow, String> {
    let split = match system.roles {
        Roles::Moving => format!("{} both", prefills + decodes),
        _ => format!("{prefills}:{decodes}"),
    };
    let label = format!("{}-{}-{split}-{rate}x", trace.name, system.name).replace([' ', '/'], "_");
    let dir = settings.run_dir.join(format!("fleet-{label}"));
    let spec = spec(settings, system, (prefills, decodes), dir.clone());
    let cluster = Cluster::start(&spec).await.map_err(|e| e.to_string())?;
    let peer = system
        .start_peer(&cluster, &dir, settings.peers_venv.as_deref())
        .await;
    let peer = match peer {
        Ok(peer) => peer,
        Err(err) => {
            cluster.shutdown().await;
            return Err(err);
        }
    };
    let front_door = peer.as_ref().unwrap_or(&cluster.proxy);
    let url = format!("{}/v1/completions", front_door.url);
    let engines: Vec<u32> = (cluster.prefills.iter().chain(&cluster.decodes))
        .filter_map(|p| p.pid())
        .collect();
    let front: Vec<u32> = front_door.pid().into_iter().collect();
    let (cpu_before, front_before) = (cpu(&engines), cpu(&front));
    let before = prefill_stats(&cluster).await;
    let before = match before {
        Ok(before) => before,
        Err(err) => {
            cluster.shutdown().await;
            return Err(err);
        }
    };
    let speed = rate * settings.time_scale;
    let timeout = Duration::from_secs(600);
    let (stop, stopped) = watch::channel(false);
    let actuation = Actuation {
        interval: wall(settings, 2.0),
        start_delay: settings.start_delay.div_f64(settings.time_scale),
        admin_key: ADMIN_KEY,
    };
    let started = Instant::now();
    let autoscaler = async {
        match system.roles {
            Roles::Autoscaled => autoscale::actuate(&cluster, actuation, stopped)
                .await
                .map(Some),
            _ => Ok(None),
        }
    };
    let load = async {
        let outcomes = replay(&url, trace, speed, settings.limit, timeout).await;
        let _ = stop.send(true);
        outcomes
    };
    let (outcomes, scaled) = tokio::join!(load, autoscaler);
    let wall_time = started.elapsed();
    let after = prefill_stats(&cluster).await;
    let role_changes = duty_changes(&cluster.proxy.url).await;
    let sim_cpu = cpu(&engines).saturating_sub(cpu_before);
    let front_cpu = cpu(&front).saturating_sub(front_before);
    if let Some(mut peer) = peer {
        peer.stop(Duration::from_secs(2)).await;
    }
    cluster.shutdown().await;
    let (after, scaled) = (after?, scaled?);
    let span = trace.requests[..outcomes.len()]
        .last()
        .map_or(Duration::ZERO, |r| r.at)
        .as_secs_f64()
        .max(1.0);
    let engine_seconds = match &scaled {
        Some(scaled) => scaled.engine_seconds,
        None => (prefills + decodes) as f64 * wall_time.as_secs_f64(),
    };
    Ok(summarize(Summary {
        settings,
        trace,
        system,
        split,
        rate,
        offered_rps: outcomes.len() as f64 * rate / span,
        outcomes: &outcomes,
        before: &before,
        after: &after,
        sim_cpu,
        front_cpu,
        wall: wall_time,
        engine_seconds: engine_seconds * settings.time_scale,
        role_changes,
        stops: scaled.as_ref().map_or(0, |s| s.stops),
    }))
}

/// The fleet of `system` on `(prefills, decodes)`.
fn spec(
    settings: &TimedSettings,
    system: &System,
    (prefills, decodes): (usize, usize),
    dir: std::path::PathBuf,
) -> ClusterSpec {
    let mut spec = ClusterSpec::demo(settings.bin_dir.clone(), dir);
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }; prefills];
    spec.decodes = decodes;
    spec.dialect = system.dialect;
    spec.kv_events = system.kv_events;
    let model = settings.preset.coefficients();
    let preset = settings.preset.to_possible_value().expect("named");
    spec.engine_args = [
        "--engine-model",
        preset.get_name(),
        "--time-scale",
        &settings.time_scale.to_string(),
        "--prefix-cache-blocks",
        &(model.kv_capacity_tokens / 16).to_string(),
        // The KV moves over loopback, a few bytes a token: its transfer time is not modelled.
        "--kv-bytes-per-token",
        "4",
        // D waits as long as the proxy does, and P holds the KV as long (vLLM's P holds it
        // up to VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, 480 s): a request queued behind an
        // overloaded decode longer than the sims' default 60 s hold would otherwise wait for
        // KV already dropped until the 600 s limit.
        "--kv-wait",
        "600",
        "--kv-hold",
        "600",
    ]
    .map(str::to_owned)
    .to_vec();
    if let Front::PdProxy(flags) = system.front {
        spec.proxy_args = flags.iter().map(|f| f.to_string()).collect();
    }
    // A prefill queued behind long prompts is busy, not frozen: pd-proxy's per-call limits
    // (30 s to P, 60 s to D's first byte, wall time: 45 s and 90 s of GPU time at 1.5x) would
    // take it out of rotation and fail its requests, where the peers wait.
    spec.proxy_args.extend(
        [
            "--request-timeout",
            "600",
            "--prefill-timeout",
            "600",
            "--decode-first-byte-timeout",
            "600",
        ]
        .map(str::to_owned),
    );
    match system.roles {
        Roles::Fixed => {}
        Roles::Moving => {
            spec.dual = true;
            spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }; prefills + decodes];
            spec.decodes = 0;
            spec.proxy_args
                .extend(planner_flags(settings, MOVING_SCALE_DOWN_AFTER));
            spec.proxy_args
                .extend(["--dual-prefills".into(), prefills.to_string()]);
        }
        Roles::Autoscaled => {
            // A frozen engine keeps its registration (no lease to run out while stopped).
            spec.lease_ttl = None;
            spec.proxy_args.extend(planner_flags(
                settings,
                settings.scale_down_after.as_secs_f64(),
            ));
            let max = (prefills.max(decodes)).to_string();
            spec.proxy_args
                .extend(["--planner-max-engines".into(), max]);
            spec.proxy_args
                .extend(["--admin-key".into(), ADMIN_KEY.into()]);
        }
    }
    spec
}

/// The planner's flags: the run's targets, [`PLANNER_PACE`] and `scale_down_after` (GPU
/// seconds) on the replay's clock.
fn planner_flags(settings: &TimedSettings, scale_down_after: f64) -> Vec<String> {
    let seconds = |d: Duration| d.div_f64(settings.time_scale).as_secs_f64().to_string();
    let mut flags = vec![
        "--planner-ttft-target".to_owned(),
        seconds(settings.ttft_slo),
        "--planner-tpot-target".to_owned(),
        seconds(settings.tpot_slo),
    ];
    let pace = PLANNER_PACE.into_iter();
    for (flag, gpu_seconds) in pace.chain([("--planner-scale-down-after", scale_down_after)]) {
        flags.extend([
            flag.to_owned(),
            wall(settings, gpu_seconds).as_secs_f64().to_string(),
        ]);
    }
    flags
}

/// `gpu_seconds` of the GPU's time on the replay's clock.
fn wall(settings: &TimedSettings, gpu_seconds: f64) -> Duration {
    Duration::from_secs_f64(gpu_seconds / settings.time_scale)
}

/// The duty changes pd-proxy counted (0 without engines of both roles; the admin key, which
/// /metrics asks for when pd-proxy has one, is the autoscaled runs').
async fn duty_changes(proxy: &str) -> u64 {
    let metrics = reqwest::Client::new().get(format!("{proxy}/metrics"));
    let text = async { metrics.bearer_auth(ADMIN_KEY).send().await?.text().await };
    let text = tokio::time::timeout(Duration::from_secs(10), text).await;
    let text = text.ok().and_then(Result::ok).unwrap_or_default();
    (text.lines())
        .filter(|line| line.starts_with("pd_proxy_duty_changes_total{"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}
