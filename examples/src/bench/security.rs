//! What TLS and tenant limits cost a front door: whole completions through each system to
//! instant mock engines, over plain HTTP, over TLS from the client, over TLS to the engines, over
//! both, and with the client's key looked up among tenants whose limits it never reaches. The
//! peers run the scenarios they support (smg: server TLS, CA-verified TLS to workers, tenant
//! keys with its tenant rate limiter; vllm-router: none but plain).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use pd_service::test_certs::{Issued, TestCa};
use serde_json::Value;

use super::loadgen::{self, ClientTls, LoadConfig, ProcessUsage, RequestFactory};
use super::mocks::{mock_backend_over, mock_bootstrap};
use super::proxy::{request_body, Settings};
use super::report::Row;
use crate::cluster::{free_port, spawn, wait_for, Process};
use crate::openai_client::send;

/// The key every request carries in the tenant scenario.
const KEY: &str = "sk-bench-tenant";

/// The scenarios, in the report's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Plain,
    ClientTls,
    UpstreamTls,
    BothTls,
    Tenants,
}

impl Scenario {
    const ALL: [Scenario; 5] = [
        Scenario::Plain,
        Scenario::ClientTls,
        Scenario::UpstreamTls,
        Scenario::BothTls,
        Scenario::Tenants,
    ];

    fn name(self) -> &'static str {
        match self {
            Scenario::Plain => "completions, whole, plain HTTP",
            Scenario::ClientTls => "completions, whole, TLS from the client",
            Scenario::UpstreamTls => "completions, whole, TLS to the engines",
            Scenario::BothTls => "completions, whole, TLS on both sides",
            Scenario::Tenants => "completions, whole, tenant key and limits",
        }
    }

    fn client_tls(self) -> bool {
        matches!(self, Scenario::ClientTls | Scenario::BothTls)
    }

    fn upstream_tls(self) -> bool {
        matches!(self, Scenario::UpstreamTls | Scenario::BothTls)
    }
}

/// The files every scenario may use: the CA, the servers' certificate, the keys files.
struct Files {
    ca: PathBuf,
    server: Issued,
    /// pd-proxy's `--api-keys-file`: one tenant whose limits the load never reaches.
    keys: PathBuf,
    /// smg's `--tenant-rate-limit-config`: the same.
    smg_limits: PathBuf,
}

impl Files {
    fn make(dir: &Path) -> Result<Self, String> {
        let tls = dir.join("tls");
        std::fs::create_dir_all(&tls).map_err(|e| e.to_string())?;
        let ca = TestCa::new(&tls, "bench");
        let keys = dir.join("keys.toml");
        let text = format!(
            "[tenants.bench]\nkeys = [\"{KEY}\"]\nrequests_per_second = 1e9\n\
             prompt_tokens_per_minute = 1e15\noutput_tokens_per_minute = 1e15\n\
             max_concurrent_requests = 1000000\n"
        );
        std::fs::write(&keys, text).map_err(|e| e.to_string())?;
        let smg_limits = dir.join("smg-rate-limits.yaml");
        let yaml = "default_policy:\n  tokens_per_minute: 4000000000\n  requests_per_minute: 4000000000\n\
                    tenants:\n- tenant_key: \"auth:bench\"\n  tokens_per_minute: 4000000000\n  requests_per_minute: 4000000000\n";
        std::fs::write(&smg_limits, yaml).map_err(|e| e.to_string())?;
        Ok(Files {
            server: ca.server("server"),
            ca: ca.ca.clone(),
            keys,
            smg_limits,
        })
    }
}

/// A front door, and how it runs each scenario.
struct System {
    name: &'static str,
    program: PathBuf,
    base: &'static str,
    ready_path: &'static str,
    /// The flags of each scenario (none: the system cannot run it).
    flags: fn(Scenario, &Files) -> Option<String>,
}

fn pd_proxy_flags(scenario: Scenario, files: &Files) -> Option<String> {
    let (cert, key, ca) = (
        files.server.cert.display(),
        files.server.key.display(),
        files.ca.display(),
    );
    Some(match scenario {
        Scenario::Plain => String::new(),
        Scenario::ClientTls => format!("--tls-cert {cert} --tls-key {key}"),
        Scenario::UpstreamTls => format!("--upstream-ca {ca}"),
        Scenario::BothTls => format!("--tls-cert {cert} --tls-key {key} --upstream-ca {ca}"),
        Scenario::Tenants => format!("--api-keys-file {}", files.keys.display()),
    })
}

fn smg_flags(scenario: Scenario, files: &Files) -> Option<String> {
    let (cert, key, ca) = (
        files.server.cert.display(),
        files.server.key.display(),
        files.ca.display(),
    );
    Some(match scenario {
        Scenario::Plain => String::new(),
        Scenario::ClientTls => format!("--tls-cert-path {cert} --tls-key-path {key}"),
        Scenario::UpstreamTls => format!("--ca-cert-paths {ca}"),
        Scenario::BothTls => {
            format!("--tls-cert-path {cert} --tls-key-path {key} --ca-cert-paths {ca}")
        }
        Scenario::Tenants => format!(
            "--tenant-api-key bench:{KEY} --tenant-rate-limit-enabled \
             --tenant-rate-limit-config {}",
            files.smg_limits.display()
        ),
    })
}

fn plain_only(scenario: Scenario, _: &Files) -> Option<String> {
    (scenario == Scenario::Plain).then(String::new)
}

fn systems(bin_dir: &Path, peers_venv: Option<&Path>) -> Vec<System> {
    let mut systems = vec![System {
        name: "pd-proxy",
        program: bin_dir.join("pd-proxy"),
        base: "--host 127.0.0.1 --port {port} --prefill {prefill} {bootstrap_port} \
               --decode {decode} --policy round_robin",
        ready_path: "/ready",
        flags: pd_proxy_flags,
    }];
    if let Some(venv) = peers_venv {
        systems.push(System {
            name: "smg",
            program: venv.join("bin/smg"),
            base: "launch --host 127.0.0.1 --port {port} --pd-disaggregation \
                   --prefill {prefill} {bootstrap_port} --decode {decode} --policy round_robin \
                   --prometheus-host 127.0.0.1 --prometheus-port {metrics_port} \
                   --log-level warn --shutdown-grace-period-secs 0",
            ready_path: "/readiness",
            flags: smg_flags,
        });
        systems.push(System {
            name: "vllm-router",
            program: venv.join("bin/vllm-router"),
            base:
                "--host 127.0.0.1 --port {port} --vllm-pd-disaggregation --kv-connector mooncake \
                   --prefill {prefill} {bootstrap_port} --decode {decode} --policy round_robin \
                   --log-level error --prometheus-port {metrics_port} \
                   --worker-startup-check-interval 1",
            ready_path: "/health",
            flags: plain_only,
        });
    }
    systems
}

/// The instant engines, over plain HTTP and over TLS, and their bootstrap server.
struct Engines {
    plain: (SocketAddr, SocketAddr),
    tls: (SocketAddr, SocketAddr),
    bootstrap: SocketAddr,
}

impl Engines {
    async fn start(files: &Files) -> Result<Self, String> {
        let tls = pd_service::ServerTls::load(&pd_service::TlsFiles {
            cert: files.server.cert.clone(),
            key: files.server.key.clone(),
            client_ca: None,
        })
        .map_err(|e| e.to_string())?;
        Ok(Engines {
            plain: (mock_backend_over(None).await, mock_backend_over(None).await),
            tls: (
                mock_backend_over(Some(tls.clone())).await,
                mock_backend_over(Some(tls)).await,
            ),
            bootstrap: mock_bootstrap().await,
        })
    }

    /// (prefill URL, decode URL) of a scenario.
    fn urls(&self, scenario: Scenario) -> (String, String) {
        match scenario.upstream_tls() {
            true => (
                format!("https://localhost:{}", self.tls.0.port()),
                format!("https://localhost:{}", self.tls.1.port()),
            ),
            false => (
                format!("http://{}", self.plain.0),
                format!("http://{}", self.plain.1),
            ),
        }
    }
}

/// Every scenario on every system that supports it, at every concurrency.
pub async fn rows(
    settings: &Settings,
    bin_dir: &Path,
    peers_venv: Option<&Path>,
) -> Result<Vec<Row>, String> {
    let files = Files::make(&settings.run_dir)?;
    let engines = Engines::start(&files).await?;
    let load_tls = ClientTls::trusting(&files.ca)?;
    let mut rows = Vec::new();
    for scenario in Scenario::ALL {
        for system in systems(bin_dir, peers_venv) {
            let Some(flags) = (system.flags)(scenario, &files) else {
                continue;
            };
            let mut process = start(settings, &system, scenario, &flags, &engines, &files).await?;
            let target = SocketAddr::from(([127, 0, 0, 1], port_of(&process.url)));
            let tls = scenario.client_tls().then(|| load_tls.clone());
            for &concurrency in &settings.concurrency {
                let config = LoadConfig {
                    concurrency,
                    duration: settings.duration,
                    warmup: Duration::from_millis(500),
                    first_byte: false,
                };
                let before = process.pid().and_then(ProcessUsage::read);
                let make = requests(target, scenario == Scenario::Tenants);
                let report = loadgen::run_over(target, tls.clone(), make, config).await;
                let after = process.pid().and_then(ProcessUsage::read);
                let row = Row::new(
                    scenario.name(),
                    system.name,
                    concurrency,
                    &report,
                    before,
                    after,
                );
                eprintln!("{}", row.markdown());
                rows.push(row);
            }
            process.stop(Duration::from_secs(5)).await;
        }
    }
    Ok(rows)
}

/// The whole completion of the proxy benchmark, with the tenant's key when `keyed`.
fn requests(addr: SocketAddr, keyed: bool) -> RequestFactory {
    let host = addr.to_string();
    let body = request_body(false);
    let bearer = format!("Bearer {KEY}");
    Arc::new(move |_| {
        let mut request = loadgen::post_json(&host, "/v1/completions", body.clone());
        if keyed {
            let value = bearer.parse().expect("a header value");
            request
                .headers_mut()
                .insert(hyper::header::AUTHORIZATION, value);
        }
        request
    })
}

fn port_of(url: &str) -> u16 {
    url.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or(0)
}

/// Starts `system` for `scenario` and waits until it has answered a completion.
async fn start(
    settings: &Settings,
    system: &System,
    scenario: Scenario,
    flags: &str,
    engines: &Engines,
    files: &Files,
) -> Result<Process, String> {
    let (port, metrics_port) = (free_port(), free_port());
    let (prefill, decode) = engines.urls(scenario);
    let args: Vec<String> = (system
        .base
        .split_whitespace()
        .chain(flags.split_whitespace()))
    .map(|word| {
        word.replace("{port}", &port.to_string())
            .replace("{metrics_port}", &metrics_port.to_string())
            .replace("{prefill}", &prefill)
            .replace("{bootstrap_port}", &engines.bootstrap.port().to_string())
            .replace("{decode}", &decode)
    })
    .collect();
    let (url, client_tls) = match scenario.client_tls() {
        true => {
            let tls = worker_client::ClientTls::load(Some(&files.ca), None, None)
                .map_err(|e| e.to_string())?;
            (format!("https://localhost:{port}"), tls)
        }
        false => (format!("http://127.0.0.1:{port}"), Default::default()),
    };
    let name = format!("{}-{:?}", system.name, scenario).to_lowercase();
    let mut process =
        spawn(&settings.run_dir, &name, &system.program, &args, url).map_err(|e| e.to_string())?;
    process.client_tls = client_tls;
    wait_for(&mut process, system.ready_path, Duration::from_secs(60))
        .await
        .map_err(|e| e.to_string())?;
    let mut headers = reqwest::header::HeaderMap::new();
    if scenario == Scenario::Tenants {
        let value = format!("Bearer {KEY}").parse().expect("a header value");
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    let http = (process.client_tls.apply(reqwest::Client::builder()))
        .default_headers(headers)
        .build()
        .map_err(|e| e.to_string())?;
    let completions = format!("{}/v1/completions", process.url);
    let body: Value = serde_json::from_slice(&request_body(false)).expect("json");
    for _ in 0..100 {
        let answer = send(&http, &completions, &body, Duration::from_secs(5)).await;
        if matches!(answer, Ok(a) if a.status == 200) {
            return Ok(process);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!(
        "{name} never answered a completion (log: {})",
        process.log.display()
    ))
}
