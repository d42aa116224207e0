//! The manifests as the cluster would get them: each kustomization of `examples/kubernetes`
//! rendered by `kubectl kustomize`, as JSON documents; and the tools that takes
//! (`tools.sh`: kubectl, a venv with kubernetes-validate).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use serde_json::Value;

/// Every kustomization: the base, each overlay, and the dashboards.
const KUSTOMIZATIONS: &[&str] = &[
    "base",
    "overlays/vllm-mooncake",
    "overlays/vllm-nixl",
    "overlays/sglang",
    "overlays/vllm-multinode",
    "overlays/vllm-multinode-etcd",
    "overlays/gateway-api",
    "overlays/vllm-autoscaled",
    "dashboards",
];

/// Reads YAML documents on stdin, writes them as one JSON array (empty documents dropped).
const YAML_TO_JSON: &str = "import json, sys, yaml
json.dump([d for d in yaml.safe_load_all(sys.stdin) if d], sys.stdout)";

/// One kustomization, rendered.
pub struct Rendered {
    /// Its folder under `examples/kubernetes`.
    pub name: &'static str,
    /// `kubectl kustomize`'s output, one JSON value per document.
    pub docs: Vec<Value>,
}

/// `examples/kubernetes`.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("kubernetes")
}

/// The folder of the workspace's binaries (the one this test's own binaries are built into).
pub fn bin_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sim-engine"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The path of one of this project's binaries, built first when missing (`cargo test -p
/// pd-examples` alone does not build the other packages' binaries).
pub fn binary(name: &str) -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    let path = bin_dir().join(name);
    if !path.exists() {
        BUILT.get_or_init(|| {
            let target = bin_dir().parent().unwrap().to_path_buf();
            let mut cargo = Command::new(env!("CARGO"));
            cargo.args([
                "build",
                "--bins",
                "-p",
                "bootstrap-server",
                "-p",
                "pd-proxy",
                "-p",
                "pd-epp",
            ]);
            cargo
                .args(["-p", "worker-client"])
                .env("CARGO_TARGET_DIR", target);
            if bin_dir().ends_with("release") {
                cargo.arg("--release");
            }
            run(&mut cargo, "");
        });
    }
    path
}

/// The venv with kubernetes-validate, made by `tools.sh` in the target folder the first time.
pub fn venv() -> &'static Path {
    static VENV: OnceLock<PathBuf> = OnceLock::new();
    VENV.get_or_init(|| {
        let target = bin_dir().parent().unwrap().join("k8s-venv");
        let out = run(Command::new(root().join("tools.sh")).arg(target), "");
        PathBuf::from(out.trim())
    })
}

/// Every kustomization, rendered once per test run.
pub fn all() -> &'static [Rendered] {
    static ALL: OnceLock<Vec<Rendered>> = OnceLock::new();
    ALL.get_or_init(|| {
        venv();
        KUSTOMIZATIONS.iter().map(|name| render(name)).collect()
    })
}

fn render(name: &'static str) -> Rendered {
    let mut kubectl = Command::new("kubectl");
    kubectl.arg("kustomize");
    if name == "dashboards" {
        // Its files are docs/grafana's, outside the folder (see its kustomization.yaml).
        kubectl.args(["--load-restrictor", "LoadRestrictionsNone"]);
    }
    let yaml = run(kubectl.arg(root().join(name)), "");
    let json = run(
        Command::new(venv().join("bin/python")).args(["-c", YAML_TO_JSON]),
        &yaml,
    );
    let docs = serde_json::from_str(&json).expect("the YAML converts to JSON");
    Rendered { name, docs }
}

/// Runs `command` with `stdin`, and its standard output; panics with its error output when it
/// fails.
pub fn run(command: &mut Command, stdin: &str) -> String {
    let (status, stdout, stderr) = run_status(command, stdin);
    assert!(status, "{command:?} failed:\n{stdout}\n{stderr}");
    stdout
}

/// Runs `command` with `stdin`: whether it succeeded, its standard output and error output.
pub fn run_status(command: &mut Command, stdin: &str) -> (bool, String, String) {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    // Written from a thread, so that a child answering before it read everything cannot block.
    let mut pipe = child.stdin.take().unwrap();
    let input = stdin.to_owned();
    let writer = std::thread::spawn(move || pipe.write_all(input.as_bytes()));
    let out = child.wait_with_output().unwrap();
    // A child that exits without reading (it needed no input) breaks the pipe: not an error.
    let _ = writer.join();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
