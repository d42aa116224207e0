//! The UCX transport inside one process: an exporter and a puller each with its own UCX
//! context, on UCX's default transports (the environment's `UCX_TLS`; the two-process tests pin
//! shared memory and TCP). Failure paths: wrong scheme, a listener of the other transport, a
//! transfer never published, a full pool, blocks released or reclaimed.

#![cfg(feature = "ucx")]

use std::time::{Duration, Instant};

use pd_transfer::ucx::{PullConfig, UcxExporter, UcxPuller};
use pd_transfer::{ExportConfig, KvExporter, KvPuller, TransferError, Transport};

async fn exporter(pool_bytes: usize, hold: Duration) -> UcxExporter {
    let config = ExportConfig {
        pool_bytes,
        block_bytes: 64 << 10,
        ..ExportConfig::new(Transport::Ucx, hold)
    };
    UcxExporter::bind("127.0.0.1:0".parse().unwrap(), config)
        .await
        .unwrap()
}

fn puller() -> UcxPuller {
    UcxPuller::new(PullConfig {
        chunk_bytes: 256 << 10,
        window: 4,
        ..PullConfig::default()
    })
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_gets_every_byte_and_releases_the_blocks() {
    let exporter = exporter(8 << 20, Duration::from_secs(30)).await;
    let addr = exporter.transfer_addr();
    assert!(addr.starts_with("ucx://127.0.0.1:"), "{addr}");
    let puller = puller();
    // D asks before P publishes: the pull is held open.
    let pulling = {
        let (puller, addr) = (puller.clone(), addr.clone());
        tokio::spawn(async move {
            puller
                .pull(&addr, "x", Duration::from_secs(10), Vec::new())
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Not a multiple of the block or chunk size.
    let kv: Vec<u8> = (0..3_000_001u32).map(|i| (i * 31 % 251) as u8).collect();
    exporter.publish("x", &kv).unwrap();
    assert_eq!(pulling.await.unwrap().unwrap(), kv);
    assert_eq!(exporter.in_flight(), 0, "D released the blocks");
    assert_eq!(exporter.free_bytes(), 8 << 20);

    // The cached endpoint and key serve the next pull, into a reused buffer.
    exporter.publish("y", &kv[..1000]).unwrap();
    let buffer = Vec::with_capacity(1 << 20);
    let again = puller
        .pull(&addr, "y", Duration::from_secs(5), buffer)
        .await
        .unwrap();
    assert_eq!(again, &kv[..1000]);
    assert!(again.capacity() >= 1 << 20, "the buffer was reused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_generic_puller_picks_ucx_from_the_scheme() {
    let config = ExportConfig {
        pool_bytes: 1 << 20,
        ..ExportConfig::new(Transport::Ucx, Duration::from_secs(30))
    };
    let exporter = KvExporter::start("127.0.0.1:0".parse().unwrap(), config)
        .await
        .unwrap();
    exporter.publish("z", b"kv over ucx").unwrap();
    let pulled = KvPuller::default()
        .pull(&exporter.transfer_addr(), "z", Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(&pulled[..], b"kv over ucx");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_transports_are_clear_errors() {
    let puller = puller();
    let tcp = puller
        .pull("tcp://127.0.0.1:1", "x", Duration::from_secs(1), Vec::new())
        .await;
    assert!(
        matches!(&tcp, Err(TransferError::UnsupportedAddress { reason, .. }) if reason.contains("tcp")),
        "{tcp:?}"
    );
    // A ucx:// address that is really a TCP exporter: its answer is KV bytes, not a descriptor.
    let tcp_exporter = KvExporter::bind("127.0.0.1:0".parse().unwrap(), Duration::from_secs(5))
        .await
        .unwrap();
    tcp_exporter.publish("x", b"raw kv bytes").unwrap();
    let disguised = tcp_exporter.transfer_addr().replace("tcp://", "ucx://");
    let wrong = puller
        .pull(&disguised, "x", Duration::from_secs(2), Vec::new())
        .await;
    assert!(
        matches!(wrong, Err(TransferError::Descriptor { .. })),
        "{wrong:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpublished_transfer_fails_at_its_deadline() {
    let exporter = exporter(1 << 20, Duration::from_secs(30)).await;
    let started = Instant::now();
    let missing = puller()
        .pull(
            &exporter.transfer_addr(),
            "never",
            Duration::from_millis(300),
            Vec::new(),
        )
        .await;
    assert!(
        matches!(missing, Err(TransferError::NotPublished { .. })),
        "{missing:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pool_refuses_and_unreleased_blocks_come_back_after_the_hold() {
    let exporter = exporter(1 << 20, Duration::from_millis(300)).await;
    exporter.publish("a", &vec![1u8; 768 << 10]).unwrap();
    let full = exporter.publish("b", &vec![2u8; 512 << 10]);
    assert!(
        matches!(full, Err(TransferError::PoolFull { free, .. }) if free == 256 << 10),
        "{full:?}"
    );
    // Nobody pulls "a": its blocks return when the hold time passes.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(exporter.free_bytes(), 1 << 20);
    assert_eq!(exporter.pending(), 0);
    exporter.publish("b", &vec![2u8; 512 << 10]).unwrap();
}
