//! docs/deploy.md walked in dry-run mode (`examples/vllm/check_deploy_guide.py`): every
//! command it gives for bootstrap-server, pd-proxy, worker-client, run-pd.sh and `vllm serve`
//! exists with the flags it is given (vLLM's against the help of the pinned CPU build, which
//! `examples/vllm/cpu/venv.sh` makes).
//!
//! Needs the workspace binaries in the test's target folder, which `cargo test --workspace`
//! builds.

use std::path::{Path, PathBuf};
use std::process::Command;

#[tokio::test]
async fn every_command_of_the_deploy_guide_exists_with_its_flags() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let bin_dir = PathBuf::from(env!("CARGO_BIN_EXE_pd-cluster"))
        .parent()
        .unwrap()
        .to_path_buf();
    let python = pd_examples::vllm::cpu_python()
        .await
        .expect("the vLLM CPU environment (examples/vllm/cpu/venv.sh)");
    let walked = Command::new("python3")
        .arg(root.join("examples/vllm/check_deploy_guide.py"))
        .arg("--bin-dir")
        .arg(&bin_dir)
        .arg("--vllm-python")
        .arg(&python)
        .output()
        .expect("run python3");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&walked.stdout),
        String::from_utf8_lossy(&walked.stderr)
    );
    assert!(walked.status.success(), "{said}");
    // The guide's steps, each checked: its vLLM lines against vLLM's own help.
    assert!(
        said.contains("vllm serve") && !said.contains("not checked"),
        "{said}"
    );
    assert!(said.contains("0 problems"), "{said}");
}
