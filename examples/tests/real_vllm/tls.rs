//! Mutual TLS between pd-proxy and real vLLM engines: the engines serve HTTPS with vLLM's own
//! flags and require a client certificate (`--ssl-keyfile`, `--ssl-certfile`, `--ssl-ca-certs`,
//! `--ssl-cert-reqs 2`); the proxy serves HTTPS and presents its certificate to them
//! (`--tls-cert`, `--upstream-ca`, `--upstream-cert`). Answers equal one engine's alone; a
//! caller without a certificate is refused by the engine.

use pd_examples::cluster::ClusterTls;

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_between_the_proxy_and_real_vllm_engines() {
    let _one = ONE_CLUSTER.lock().await;
    let (mut spec, dir) = spec("real-tls-", engines(Connector::Mooncake).await);
    let tls = ClusterTls::make(dir.path()).unwrap();
    spec.tls = Some(tls.clone());
    let cluster = start(&spec).await;
    for process in [&cluster.proxy, &cluster.prefills[0], &cluster.decodes[0]] {
        assert!(process.url.starts_with("https://"), "{}", process.url);
    }

    assert_pd_equals_one_engine(&cluster).await;

    // vLLM refuses a caller that trusts it but presents no certificate, at the handshake.
    let anonymous = (worker_client::ClientTls::load(Some(&tls.ca), None, None).unwrap())
        .apply(reqwest::Client::builder())
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let refused = anonymous
        .get(format!("{}/health", cluster.decodes[0].url))
        .send()
        .await;
    assert!(refused.is_err(), "{refused:?}");
    // The proxy itself needs none from its clients.
    let ready = anonymous
        .get(format!("{}/ready", cluster.proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    cluster.shutdown().await;
}
