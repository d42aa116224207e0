//! A real Prometheus for tests: a `prometheus` process on 127.0.0.1 scraping the given targets
//! every second (Debian's `prometheus` package, which `examples/prometheus/tools.sh` checks),
//! and its instant queries.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::process::free_port;

/// A `prometheus` process, killed when dropped.
pub struct Prometheus {
    child: Child,
    /// Its HTTP API's base URL.
    pub url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One scrape job: its name and the base URLs of its targets.
pub struct Job<'a> {
    /// The job's name (`job` label).
    pub name: &'a str,
    /// The targets' base URLs (`http://HOST:PORT`).
    pub targets: &'a [String],
}

/// Runs `examples/prometheus/tools.sh`, which makes sure `prometheus` and `promtool` are here;
/// panics naming it when they are not.
pub fn tools() {
    let script = repo().join("examples/prometheus/tools.sh");
    let output = Command::new(&script)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        output.status.success(),
        "examples/prometheus/tools.sh failed: prometheus and promtool are needed (Debian's \
         prometheus package):\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The repository's root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The JSON answer of `request`; panics when there is none.
async fn json_of(request: reqwest::RequestBuilder) -> Value {
    let response = request.send().await.expect("Prometheus answers");
    response.json().await.expect("Prometheus answers JSON")
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

impl Prometheus {
    /// Starts Prometheus scraping `jobs` every second, evaluating `rules` (a rule file) every
    /// second when given.
    pub fn start(jobs: &[Job], rules: Option<&Path>) -> Prometheus {
        let dir = tempfile::Builder::new().prefix("prom-").tempdir().unwrap();
        let mut config =
            String::from("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n");
        if let Some(rules) = rules {
            config += &format!("rule_files:\n  - '{}'\n", rules.display());
        }
        config += "scrape_configs:\n";
        for job in jobs {
            let targets: Vec<String> = (job.targets.iter())
                .map(|url| {
                    format!(
                        "'{}'",
                        url.trim_start_matches("http://").trim_end_matches('/')
                    )
                })
                .collect();
            config += &format!(
                "  - job_name: {}\n    static_configs:\n      - targets: [{}]\n",
                job.name,
                targets.join(", ")
            );
        }
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).unwrap();
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("prometheus starts (examples/prometheus/tools.sh installs it)");
        Prometheus {
            child,
            url: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        }
    }

    /// The answer of an instant query of `expr`, now.
    pub async fn query(&self, expr: &str) -> Value {
        self.query_at(expr, None).await
    }

    /// The answer of an instant query of `expr` at `time` (Unix seconds; now when `None`).
    pub async fn query_at(&self, expr: &str, time: Option<f64>) -> Value {
        let mut params = vec![("query", expr.to_owned())];
        params.extend(time.map(|t| ("time", format!("{t:.3}"))));
        let url = format!("{}/api/v1/query", self.url);
        json_of(client().get(url).query(&params)).await
    }

    /// GETs `path` of its API as JSON.
    pub async fn get(&self, path: &str) -> Value {
        json_of(client().get(format!("{}{path}", self.url))).await
    }

    /// Waits until it is ready and `targets` targets are up; panics after 30 s.
    pub async fn wait_up(&self, targets: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = client().get(format!("{}/-/ready", self.url)).send().await;
            let up = match ready {
                Ok(r) if r.status().is_success() => self.query("sum(up)").await,
                _ => Value::Null,
            };
            let value = up["data"]["result"][0]["value"][1].as_str().unwrap_or("0");
            if value == targets.to_string() {
                return;
            }
            assert!(Instant::now() < deadline, "targets not all up: {up}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}
