//! The real engines of a cluster: a vLLM prefill per bootstrap server (registering with it when
//! its connector is Mooncake; of both roles, `kv_both`, with `spec.dual`) and `spec.decodes`
//! vLLM decodes, started at once.

use futures_util::future::try_join_all;

use super::{ClusterError, ClusterSpec, Engines, ServedModel, READY_TIMEOUT};
use crate::process::{free_port, wait_for, Ports, Process};
use crate::vllm::{wait_ready, Connector, EngineRole, VllmEngines};

/// Starts the engines and waits until each answers `/health` and, with Mooncake, until the
/// prefill's workers are registered (the bootstrap server's `/ready`).
pub(super) async fn start(
    spec: &ClusterSpec,
    vllm: &VllmEngines,
    ports: &mut Ports,
    bootstraps: &mut [Process],
) -> Result<Engines, ClusterError> {
    let vllm = &VllmEngines {
        tls: spec.tls.clone(),
        ..vllm.clone()
    };
    let mut prefills = Vec::new();
    for (i, bootstrap) in bootstraps.iter().enumerate() {
        let port = ports.take()?;
        let name = format!("prefill-{i}");
        let registry = Some(bootstrap.url.as_str());
        let gpu = vllm.gpu_of(prefills.len());
        let role = match spec.dual {
            true => EngineRole::Both,
            false => EngineRole::Prefill,
        };
        let engine = vllm.spawn(&spec.run_dir, &name, role, port, registry, free_port(), gpu)?;
        prefills.push(engine);
    }
    let mut decodes = Vec::new();
    for i in 0..spec.decodes {
        let port = ports.take()?;
        let name = format!("decode-{i}");
        let gpu = vllm.gpu_of(prefills.len() + decodes.len());
        let engine = vllm.spawn(
            &spec.run_dir,
            &name,
            EngineRole::Decode,
            port,
            None,
            free_port(),
            gpu,
        )?;
        decodes.push(engine);
    }
    try_join_all(
        prefills
            .iter_mut()
            .chain(decodes.iter_mut())
            .map(wait_ready),
    )
    .await?;
    if vllm.connector == Connector::Mooncake {
        for bootstrap in bootstraps.iter_mut() {
            wait_for(bootstrap, "/ready", READY_TIMEOUT).await?;
        }
    }
    let urls = |engines: &[Process]| engines.iter().map(|e| e.url.clone()).collect();
    let model = ServedModel {
        name: vllm.served_name.clone(),
        adapters: Vec::new(),
        prefills: urls(&prefills),
        decodes: urls(&decodes),
    };
    Ok(Engines {
        prefills,
        registrars: Vec::new(),
        decodes,
        models: vec![model],
    })
}
