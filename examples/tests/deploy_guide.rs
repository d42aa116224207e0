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

/// vLLM adds the dp rank to both KV event ports: run-pd.sh keeps the PUB and replay ranges of a
/// data-parallel P apart.
#[test]
fn a_data_parallel_ps_kv_event_ports_do_not_collide() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let dp = 4;
    let printed = Command::new("bash")
        .arg(root.join("examples/vllm/run-pd.sh"))
        .arg("prefill")
        .envs([("DRY_RUN", "1"), ("KV_EVENTS", "1")])
        .env("P_DP", dp.to_string())
        .output()
        .expect("run bash");
    let said = String::from_utf8_lossy(&printed.stdout).replace('\\', "");
    assert!(printed.status.success(), "{said}");
    let port = |key: &str| -> u16 {
        let pattern = format!("\"{key}\":\"tcp://*:");
        let at = said.find(&pattern).expect(key) + pattern.len();
        let digits: String = said[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().unwrap_or_else(|_| panic!("{key}: {said}"))
    };
    let (publish, replay) = (port("endpoint"), port("replay_endpoint"));
    let ranks = |first: u16| first..first + dp;
    assert!(
        ranks(publish).all(|p| !ranks(replay).contains(&p)),
        "PUB {publish} and replay {replay} overlap over {dp} dp ranks"
    );
}
