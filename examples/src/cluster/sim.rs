//! The simulated engines of a cluster: sim-engine prefills (one per bootstrap server) and
//! decodes, playing vLLM or SGLang, registered by themselves or by Python registrars; one set
//! per model, prefills and decodes numbered across the models.

use pd_transfer::Transport;

use super::{
    binary, model_name, s, ClusterError, ClusterSpec, ClusterTls, Engines, ServedModel,
    LORA_ADAPTERS, READY_TIMEOUT, REGISTER_ENGINE_SCRIPT,
};
use crate::process::{spawn, spawn_with_env, wait_for, Ports, Process};
use crate::sim::lora::RUNTIME_UPDATING_ENV;
use crate::sim::Dialect;

/// The prefix cache of a sim that publishes KV events, unless `engine_args` size it: 4,096
/// blocks of 16 tokens.
const DEFAULT_CACHE_BLOCKS: usize = 4096;

/// Where the sims' tokenizer is written (one token per byte): the sims and the proxies load
/// the same files.
pub(super) fn tokenizer_dir(spec: &ClusterSpec) -> std::path::PathBuf {
    spec.run_dir.join("tokenizer")
}

/// Starts the sims and waits until every prefill's workers are registered: vLLM's expected
/// topology, or every rank of SGLang's.
pub(super) async fn start(
    spec: &ClusterSpec,
    ports: &mut Ports,
    bootstraps: &mut [Process],
) -> Result<Engines, ClusterError> {
    let sim_bin = binary(spec, "sim-engine")?;
    let tokenizer = tokenizer_dir(spec);
    std::fs::create_dir_all(&tokenizer)
        .and_then(|()| pd_tokenize::byte_level::write(&tokenizer))
        .map_err(|source| ClusterError::RunDir {
            path: tokenizer.clone(),
            source,
        })?;
    // UCX on one host: shared memory, where gets are one-sided (docs/transfer.md), unless the
    // caller chose transports.
    let sim_env: &[(&str, &str)] = match spec.transfer {
        Transport::Ucx if std::env::var_os("UCX_TLS").is_none() => {
            &[("UCX_TLS", "posix,sysv,self")]
        }
        _ => &[],
    };
    let sim_args = |role: &str, port: u16| {
        let mut args = vec![
            s(&"--role"),
            s(&role),
            s(&"--dialect"),
            s(&spec.dialect),
            s(&"--transfer"),
            s(&spec.transfer),
            s(&"--port"),
            s(&port),
            s(&"--prefill-us-per-token"),
            s(&spec.prefill_us_per_token),
            s(&"--decode-ms-per-token"),
            s(&spec.decode_ms_per_token),
            s(&"--tokenizer"),
            tokenizer.display().to_string(),
        ];
        args.extend(spec.tls.iter().flat_map(ClusterTls::sim_args));
        args.extend(spec.engine_args.iter().cloned());
        // Events come from the prefix cache: give the sims one unless the caller sized it.
        if spec.kv_events
            && !spec
                .engine_args
                .iter()
                .any(|a| a.starts_with("--prefix-cache-blocks"))
        {
            args.extend([s(&"--prefix-cache-blocks"), s(&DEFAULT_CACHE_BLOCKS)]);
        }
        args
    };
    // Each dp rank publishes on its own port and answers replays on another, offset from
    // the first of each as vLLM offsets them.
    let kv_events = |ports: &mut Ports, dp: u32| -> Result<Vec<String>, ClusterError> {
        if !spec.kv_events {
            return Ok(Vec::new());
        }
        let dp = u16::try_from(dp).unwrap_or(1);
        let first = ports.take_run(2 * dp)?;
        let config = serde_json::json!({"enable_kv_cache_events": true, "publisher": "zmq",
            "endpoint": format!("tcp://*:{first}"),
            "replay_endpoint": format!("tcp://*:{}", first + dp), "topic": "kv"});
        Ok(vec![s(&"--kv-events-config"), config.to_string()])
    };
    let models = spec.models.max(1);
    let (mut prefills, mut decodes, mut served) = (Vec::new(), Vec::new(), Vec::new());
    for k in 0..models {
        let model = model_name(k, models);
        // Adapters are vLLM's: model 0's engines load two, and may load more at run time.
        let adapters = match k == 0 && models > 1 && spec.dialect == Dialect::Vllm {
            true => &LORA_ADAPTERS[..],
            false => &[],
        };
        let mut model_args = Vec::new();
        if models > 1 {
            model_args.extend([s(&"--model"), model.clone()]);
        }
        let mut env = sim_env.to_vec();
        if !adapters.is_empty() {
            model_args.push(s(&"--lora-modules"));
            model_args.extend(adapters.iter().map(|(name, path)| format!("{name}={path}")));
            env.push((RUNTIME_UPDATING_ENV, "true"));
        }
        let (first_prefill, first_decode) = (prefills.len(), decodes.len());
        for shape in &spec.prefills {
            let i = prefills.len();
            let port = ports.take()?;
            let mut args = sim_args(if spec.dual { "both" } else { "prefill" }, port);
            args.extend(model_args.iter().cloned());
            args.extend(kv_events(ports, shape.dp)?);
            if spec.dialect == Dialect::Vllm {
                args.extend([s(&"--engine-id"), format!("prefill-{i}")]);
            }
            args.extend([
                s(&"--dp-size"),
                s(&shape.dp),
                s(&"--tp-size"),
                s(&shape.tp),
                s(&"--bootstrap"),
                bootstraps[i].url.clone(),
            ]);
            if spec.python_registrar.is_some() {
                args.extend([s(&"--registration"), s(&"external")]);
            } else if let Some(ttl) = spec.lease_ttl.filter(|_| spec.dialect == Dialect::Vllm) {
                args.extend([s(&"--lease-ttl"), s(&ttl)]);
            }
            let name = format!("prefill-{i}");
            let mut prefill =
                spawn_with_env(&spec.run_dir, &name, &sim_bin, &args, &env, spec.url(port))?;
            prefill.client_tls = spec.caller_tls();
            prefills.push(prefill);
        }
        for _ in 0..spec.decodes {
            let i = decodes.len();
            let port = ports.take()?;
            let mut args = sim_args("decode", port);
            args.extend(model_args.iter().cloned());
            args.extend(kv_events(ports, 1)?);
            args.extend([s(&"--engine-id"), format!("decode-{i}")]);
            args.extend(spec.decode_args.get(i).into_iter().flatten().cloned());
            let name = format!("decode-{i}");
            let mut decode =
                spawn_with_env(&spec.run_dir, &name, &sim_bin, &args, &env, spec.url(port))?;
            decode.client_tls = spec.caller_tls();
            decodes.push(decode);
        }
        let urls = |engines: &[Process]| engines.iter().map(|e| e.url.clone()).collect();
        served.push(ServedModel {
            name: model,
            adapters: adapters.iter().map(|(name, _)| s(name)).collect(),
            prefills: urls(&prefills[first_prefill..]),
            decodes: urls(&decodes[first_decode..]),
        });
    }
    for process in prefills.iter_mut().chain(decodes.iter_mut()) {
        wait_for(process, "/health", READY_TIMEOUT).await?;
    }
    let mut registrars = Vec::new();
    if let Some(python) = &spec.python_registrar {
        for (i, (prefill, bootstrap)) in prefills.iter().zip(bootstraps.iter()).enumerate() {
            let args = [
                s(&REGISTER_ENGINE_SCRIPT),
                s(&"--engine"),
                prefill.url.clone(),
                s(&"--bootstrap"),
                bootstrap.url.clone(),
                s(&"--ttl"),
                s(&spec.lease_ttl.unwrap_or(10)),
            ];
            let name = format!("register-{i}");
            let url = bootstrap.url.clone();
            registrars.push(spawn(&spec.run_dir, &name, python, &args, url)?);
        }
    }
    let ready = match spec.dialect {
        Dialect::Vllm => "/ready",
        Dialect::Sglang => {
            "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        }
    };
    // A registrar's URL is its bootstrap server's: waiting through it also fails at once when
    // the registrar dies (e.g. a Python without the package).
    let registering = if registrars.is_empty() {
        bootstraps
    } else {
        &mut registrars[..]
    };
    for process in registering {
        wait_for(process, ready, READY_TIMEOUT).await?;
    }
    Ok(Engines {
        prefills,
        registrars,
        decodes,
        models: served,
    })
}
