//! A local cluster with TLS everywhere (`ClusterSpec::tls`, `pd-cluster --tls`): curl talks to
//! pd-proxy over HTTPS (HTTP/2 and HTTP/1.1 by ALPN), plain HTTP on its port is told to use
//! https, the engines refuse callers without a client certificate, the bootstrap servers refuse
//! writers without one, and a certificate rotated in place is served without a restart.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pd_examples::cluster::{Cluster, ClusterSpec, ClusterTls, PrefillShape};
use pd_service::test_certs::TestCa;
use serde_json::{json, Value};
use worker_client::ClientTls;

async fn start_cluster() -> (Cluster, tempfile::TempDir, ClusterTls) {
    let bin_dir = PathBuf::from(env!("CARGO_BIN_EXE_sim-engine"))
        .parent()
        .unwrap()
        .to_path_buf();
    let run_dir = tempfile::Builder::new().prefix("tls").tempdir().unwrap();
    let mut spec = ClusterSpec::demo(bin_dir, run_dir.path().to_path_buf());
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }];
    spec.decodes = 1;
    spec.kv_events = false;
    let tls = ClusterTls::make(run_dir.path()).unwrap();
    spec.tls = Some(tls.clone());
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    (cluster, run_dir, tls)
}

/// Runs curl with `args`; returns what it wrote (headers with `-i`) and whether it succeeded.
async fn curl(args: &[&str]) -> (bool, String) {
    let output = tokio::process::Command::new("curl")
        .args(["-sS", "--max-time", "10"])
        .args(args)
        .output()
        .await
        .expect("curl runs");
    let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stderr));
    (output.status.success(), text)
}

fn completion() -> String {
    json!({"model": "sim-model", "prompt": "hello over tls", "max_tokens": 4}).to_string()
}

/// A client trusting only `ca`, presenting nothing.
fn trusting(ca: &Path) -> reqwest::Client {
    (ClientTls::load(Some(ca), None, None).unwrap())
        .apply(reqwest::Client::builder().tls_built_in_root_certs(false))
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

#[tokio::test]
async fn curl_speaks_https_to_the_proxy_and_every_hop_is_tls() {
    let (cluster, _dir, tls) = start_cluster().await;
    let proxy = &cluster.proxy.url;
    assert!(proxy.starts_with("https://"), "{proxy}");
    let ca = tls.ca.display().to_string();
    let url = format!("{proxy}/v1/completions");
    let body = completion();
    for (version, expected) in [("--http2", "HTTP/2 200"), ("--http1.1", "HTTP/1.1 200")] {
        let (ok, out) = curl(&[
            version,
            "-i",
            "--cacert",
            &ca,
            &url,
            "-H",
            "content-type: application/json",
            "-d",
            &body,
        ])
        .await;
        assert!(ok && out.starts_with(expected), "{version}: {out}");
        assert!(out.contains("\"text_completion\""), "{out}");
    }
    // Without the CA, curl refuses the proxy's certificate.
    let (ok, out) = curl(&[&url, "-d", &body]).await;
    assert!(!ok, "{out}");
    // Plain HTTP on the TLS port gets a JSON 400 saying what to do.
    let plain = url.replace("https://", "http://");
    let (_, out) = curl(&["-i", &plain, "-d", &body]).await;
    assert!(
        out.starts_with("HTTP/1.1 400") && out.contains("use https://"),
        "{out}"
    );

    // The engines require a client certificate; the proxy presented one.
    let anonymous = trusting(&tls.ca);
    let decode = &cluster.decodes[0].url;
    let refused = anonymous
        .get(format!("{decode}/v1/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403);
    let caller = (tls.caller().apply(reqwest::Client::builder()))
        .build()
        .unwrap();
    let served = caller
        .get(format!("{decode}/v1/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(served.status(), 200);

    // The bootstrap server lets writers in by their certificate, and reads stay open.
    let bootstrap = &cluster.bootstraps[0].url;
    let workers: Value = (anonymous
        .get(format!("{bootstrap}/workers"))
        .send()
        .await
        .unwrap())
    .json()
    .await
    .unwrap();
    assert_eq!(
        workers["workers"].as_array().map(Vec::len),
        Some(1),
        "{workers}"
    );
    let register = json!({"engine_id": "intruder", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0,
        "addr": "tcp://127.0.0.1:1"});
    let write = anonymous
        .post(format!("{bootstrap}/register"))
        .json(&register);
    assert_eq!(write.send().await.unwrap().status(), 403);
    cluster.shutdown().await;
}

#[tokio::test]
async fn a_certificate_rotated_in_place_is_served_without_a_restart() {
    let (cluster, dir, tls) = start_cluster().await;
    let proxy = cluster.proxy.url.clone();
    let old = trusting(&tls.ca);
    assert!(old
        .get(format!("{proxy}/health"))
        .send()
        .await
        .unwrap()
        .status()
        .is_success());
    // cert-manager's way: new files over the old ones, the servers running.
    let rotated = TestCa::new(&dir.path().join("tls"), "rotated");
    rotated.server("server");
    let fresh = trusting(&rotated.ca);
    let started = Instant::now();
    while fresh.get(format!("{proxy}/health")).send().await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the rotated certificate was never served"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Connections opened before the rotation go on; new ones trusting the old CA do not.
    assert!(old
        .get(format!("{proxy}/health"))
        .send()
        .await
        .unwrap()
        .status()
        .is_success());
    let stale = trusting(&tls.ca);
    assert!(stale.get(format!("{proxy}/health")).send().await.is_err());
    cluster.shutdown().await;
}
