//! The cluster's bootstrap servers: one per prefill engine of every model, as on real rank-0
//! hosts.

use std::path::Path;

use super::{s, ClusterError, ClusterSpec, ClusterTls, Dialect, READY_TIMEOUT};
use crate::process::{spawn, wait_for, Ports, Process};

/// One bootstrap server per prefill engine of every model (with vLLM's expected topology, for
/// `/ready`), each answering `/health`.
pub(super) async fn start(
    spec: &ClusterSpec,
    program: &Path,
    ports: &mut Ports,
) -> Result<Vec<Process>, ClusterError> {
    let mut bootstraps = Vec::new();
    for (i, shape) in spec.prefill_engines().enumerate() {
        let port = ports.take()?;
        let data_dir = spec.run_dir.join(format!("bootstrap-{i}-data"));
        let mut args = vec![
            s(&"--host"),
            s(&"127.0.0.1"),
            s(&"--port"),
            s(&port),
            s(&"--data-dir"),
            data_dir.display().to_string(),
        ];
        if spec.dialect == Dialect::Vllm {
            // SGLang's rows carry their sizes.
            args.extend([s(&"--dp-size"), s(&shape.dp), s(&"--tp-size"), s(&shape.tp)]);
        }
        // Real vLLM engines register over plain HTTP.
        let tls = spec.tls.as_ref().filter(|_| spec.vllm.is_none());
        let url = match tls {
            Some(tls) => {
                args.extend(tls.bootstrap_args());
                ClusterTls::url(port)
            }
            None => format!("http://127.0.0.1:{port}"),
        };
        let name = format!("bootstrap-{i}");
        let mut bootstrap = spawn(&spec.run_dir, &name, program, &args, url)?;
        bootstrap.client_tls = spec.caller_tls();
        bootstraps.push(bootstrap);
    }
    for process in &mut bootstraps {
        wait_for(process, "/health", READY_TIMEOUT).await?;
    }
    Ok(bootstraps)
}
