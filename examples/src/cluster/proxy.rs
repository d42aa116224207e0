//! Starting a proxy in front of the cluster's engines, found by URL or through DNS.

use std::path::{Path, PathBuf};

use super::{
    dns, s, sim, ClusterError, ClusterSpec, ClusterTls, Connector, Dialect, Engines, Ports,
    READY_TIMEOUT,
};
use crate::process::{spawn_with_env, wait_for, Process};

/// How a proxy finds the engines.
#[derive(Clone, Copy)]
pub(super) enum Found<'a> {
    /// By their URLs (and their bootstrap servers').
    Urls(&'a Engines, &'a [Process]),
    /// Through DNS.
    Dns(&'a crate::dnsmasq::Dnsmasq),
}

/// A proxy (`name`) in front of the engines, in the mode their connector needs, once `/ready`;
/// the first one takes `spec.proxy_port`.
pub(super) async fn start_proxy(
    spec: &ClusterSpec,
    program: &Path,
    ports: &mut Ports,
    found: Found<'_>,
    name: &str,
) -> Result<Process, ClusterError> {
    let port = if spec.proxy_port == 0 || name != "proxy" {
        ports.take()?
    } else {
        spec.proxy_port
    };
    let mut args = vec![s(&"--host"), s(&"127.0.0.1"), s(&"--port"), s(&port)];
    args.extend(fleet_args(spec, found, None));
    args.extend(spec.tls.iter().flat_map(ClusterTls::proxy_args));
    args.extend(spec.proxy_args.iter().cloned());
    let url = spec.url(port);
    let env: Vec<(&str, &str)> = (spec.proxy_env.iter())
        .map(|(name, value)| (name.as_str(), value.as_str()))
        .collect();
    let mut proxy = spawn_with_env(&spec.run_dir, name, program, &args, &env, url)?;
    proxy.client_tls = spec.caller_tls();
    wait_for(&mut proxy, "/ready", READY_TIMEOUT).await?;
    Ok(proxy)
}

/// The flags naming the fleet to a front door (pd-proxy, pd-epp): the prefills with their
/// bootstrap servers, the decodes (`decodes`, else every one), the mode their connector
/// needs, and the KV events with the engines' tokenizer.
pub(super) fn fleet_args(
    spec: &ClusterSpec,
    found: Found<'_>,
    decodes: Option<&[&Process]>,
) -> Vec<String> {
    let mut args = Vec::new();
    let nixl = spec
        .vllm
        .as_ref()
        .is_some_and(|vllm| vllm.connector == Connector::Nixl);
    match found {
        Found::Dns(dns) => args.extend(dns::proxy_args(dns, nixl)),
        Found::Urls(engines, bootstraps) => {
            for (prefill, bootstrap) in engines.prefills.iter().zip(bootstraps) {
                let bootstrap_port = match nixl {
                    true => s(&"none"),
                    // An https registry is named by its URL (the port alone means http).
                    false if bootstrap.url.starts_with("https://") => bootstrap.url.clone(),
                    false => bootstrap
                        .url
                        .rsplit(':')
                        .next()
                        .unwrap_or_default()
                        .to_owned(),
                };
                let flag = if spec.dual { "--dual" } else { "--prefill" };
                args.extend([s(&flag), prefill.url.clone(), bootstrap_port]);
            }
            let all: Vec<&Process> = engines.decodes.iter().collect();
            for decode in decodes.unwrap_or(&all) {
                args.extend([s(&"--decode"), decode.url.clone()]);
            }
        }
    }
    if spec.dialect == Dialect::Sglang {
        args.extend([s(&"--mode"), s(&"sglang")]);
    } else if nixl {
        args.extend([s(&"--mode"), s(&"sequential")]);
    }
    if spec.kv_events {
        args.push(s(&"--kv-events"));
        // Tokenized in-process as the engines tokenize: the sims' tokenizer, or a real
        // model's folder.
        let tokenizer = match &spec.vllm {
            None => Some(sim::tokenizer_dir(spec)),
            Some(vllm) => Some(PathBuf::from(&vllm.model)).filter(|dir| dir.is_dir()),
        };
        if let Some(dir) = tokenizer {
            args.extend([s(&"--tokenizer"), dir.display().to_string()]);
        }
    }
    args
}
