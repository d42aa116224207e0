//! One P, several pulls at once over UCX's TCP transport: a pull that runs out of its own time
//! gives up without closing the endpoint the other pulls from the same P still use. (A file of
//! its own: it pins `UCX_TLS=tcp` for its process before UCX starts.)

#![cfg(feature = "ucx")]

use std::time::Duration;

use pd_transfer::pattern;
use pd_transfer::ucx::{PullConfig, UcxExporter, UcxPuller};
use pd_transfer::{ExportConfig, TransferError, Transport};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_out_of_time_leaves_the_others_from_the_same_p_running() {
    // Before any UCX context exists in this process (one test in this binary).
    std::env::set_var("UCX_TLS", "tcp");
    let config = ExportConfig {
        pool_bytes: 160 << 20,
        block_bytes: 1 << 20,
        ..ExportConfig::new(Transport::Ucx, Duration::from_secs(30))
    };
    let exporter = UcxExporter::bind("127.0.0.1:0".parse().unwrap(), config)
        .await
        .unwrap();
    let addr = exporter.transfer_addr();
    let puller = UcxPuller::new(PullConfig {
        chunk_bytes: 1 << 20,
        window: 4,
        ..PullConfig::default()
    })
    .unwrap();
    // Connect and map once, so both pulls below start at once.
    exporter.publish("warm", &pattern(1, 1 << 20)).unwrap();
    puller
        .pull(&addr, "warm", Duration::from_secs(10), Vec::new())
        .await
        .unwrap();

    let (short, long) = (pattern(2, 96 << 20), pattern(3, 48 << 20));
    exporter.publish("short", &short).unwrap();
    exporter.publish("long", &long).unwrap();
    let (out_of_time, healthy) = tokio::join!(
        puller.pull(&addr, "short", Duration::from_millis(30), Vec::new()),
        puller.pull(&addr, "long", Duration::from_secs(20), Vec::new()),
    );
    assert!(
        matches!(out_of_time, Err(TransferError::Deadline { .. })),
        "96 MiB over TCP in 30 ms: {out_of_time:?}"
    );
    assert_eq!(healthy.expect("the other pull from the same P"), long);
}
