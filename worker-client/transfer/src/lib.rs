//! The KV data plane of pd-bootstrap: a P worker exports KV under a transfer id, a D worker pulls
//! it. Only engines (and the simulated ones) build this crate; the bootstrap server and the proxy
//! never do.
//!
//! A worker's transfer address names its transport, so D picks the right one:
//! - `tcp://host:port` ([`tcp`], always built): the KV bytes travel over HTTP/1.1 on a plain TCP
//!   listener (`GET /kv/{transfer_id}?wait_ms=N`).
//! - `ucx://host:port` (`ucx` module, cargo feature `ucx`): the same listener serves a small
//!   descriptor (UCX worker address, packed remote key, block layout) and D pulls the blocks
//!   one-sidedly with UCX RMA gets (shared memory, TCP or RDMA, whatever `UCX_TLS` allows), then
//!   releases them with `DELETE /kv/{transfer_id}`.
//!
//! [`KvExporter`] and [`KvPuller`] are the transport-neutral front: a sim or real engine picks a
//! [`Transport`] at start-up and the rest of its code is the same. docs/transfer.md explains the
//! data plane, the transports and the measured bandwidth.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;

mod pull;
mod shelf;
pub mod tcp;
#[cfg(feature = "ucx")]
pub mod ucx;

/// The scheme of addresses served by the TCP transport.
pub const TCP_SCHEME: &str = "tcp";
/// The scheme of addresses served by the UCX transport.
pub const UCX_SCHEME: &str = "ucx";

/// Why a transfer failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TransferError {
    /// The address is not `tcp://host:port` or `ucx://host:port`, or names a transport this
    /// build lacks.
    #[error("transfer address {addr:?} is not supported: {reason}")]
    UnsupportedAddress {
        /// The address given.
        addr: String,
        /// Why (the expected forms, or the cargo feature to build with).
        reason: String,
    },
    /// The transport was not compiled into this build.
    #[error("the {transport} transport is not built in: rebuild with `--features ucx`")]
    TransportDisabled {
        /// The transport asked for.
        transport: Transport,
    },
    /// The exporter could not be reached or broke the connection.
    #[error("cannot pull {transfer_id} from {addr}: {reason}")]
    Unreachable {
        /// The exporter's address.
        addr: String,
        /// The transfer id.
        transfer_id: String,
        /// What failed.
        reason: String,
    },
    /// The KV did not appear before the deadline.
    #[error("KV for {transfer_id} was not published at {addr} within {waited:?}")]
    NotPublished {
        /// The exporter's address.
        addr: String,
        /// The transfer id.
        transfer_id: String,
        /// How long D waited.
        waited: Duration,
    },
    /// The data did not all arrive before the deadline (e.g. P died mid-transfer).
    #[error("pulling {transfer_id} from {addr} missed its {deadline:?} deadline ({done} of {total} bytes arrived)")]
    Deadline {
        /// The exporter's address.
        addr: String,
        /// The transfer id.
        transfer_id: String,
        /// The deadline of the whole pull.
        deadline: Duration,
        /// Bytes that had arrived.
        done: u64,
        /// Bytes asked for.
        total: u64,
    },
    /// The exporter's descriptor of the KV was malformed or inconsistent.
    #[error("bad KV descriptor for {transfer_id} from {addr}: {reason}")]
    Descriptor {
        /// The exporter's address.
        addr: String,
        /// The transfer id.
        transfer_id: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The data transport failed (a UCX status, with its name).
    #[error("pulling {transfer_id} from {addr} failed: {reason}")]
    Transport {
        /// The exporter's address.
        addr: String,
        /// The transfer id.
        transfer_id: String,
        /// What failed.
        reason: String,
    },
    /// The exporter's KV memory has no room for this transfer until earlier ones are pulled or
    /// expire.
    #[error("no room for {needed} bytes of KV ({free} bytes free in the exporter's pool)")]
    PoolFull {
        /// Bytes asked for.
        needed: u64,
        /// Bytes free.
        free: u64,
    },
    /// The exporter could not be started.
    #[error("cannot start the KV exporter on {addr}: {reason}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// What failed.
        reason: String,
    },
}

/// A KV transport, named by the scheme of the transfer address P registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    /// The KV bytes over HTTP on TCP (`tcp://`); always built.
    Tcp,
    /// UCX RMA gets, one-sided over shared memory (`ucx://`); cargo feature `ucx`.
    Ucx,
}

impl Transport {
    /// The scheme of this transport's addresses.
    pub fn scheme(self) -> &'static str {
        match self {
            Transport::Tcp => TCP_SCHEME,
            Transport::Ucx => UCX_SCHEME,
        }
    }

    /// Whether this build can use the transport.
    pub fn is_built(self) -> bool {
        self == Transport::Tcp || cfg!(feature = "ucx")
    }

    /// Splits `scheme://host:port` into its transport and `host:port`.
    pub fn parse(addr: &str) -> Result<(Transport, &str), TransferError> {
        let unsupported = |reason: String| TransferError::UnsupportedAddress {
            addr: addr.to_owned(),
            reason,
        };
        let (scheme, host_port) = addr
            .split_once("://")
            .ok_or_else(|| unsupported("expected tcp://host:port or ucx://host:port".into()))?;
        let transport = match scheme {
            TCP_SCHEME => Transport::Tcp,
            UCX_SCHEME => Transport::Ucx,
            other => return Err(unsupported(format!("unknown transport {other:?}"))),
        };
        if host_port.is_empty() || host_port.contains('/') {
            return Err(unsupported(format!("expected {scheme}://host:port")));
        }
        if !transport.is_built() {
            return Err(unsupported(format!(
                "this build has no {scheme} transport: rebuild with `--features ucx`"
            )));
        }
        Ok((transport, host_port))
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.scheme())
    }
}

/// How a [`KvExporter`] serves.
#[derive(Debug, Clone, Copy)]
pub struct ExportConfig {
    /// The transport.
    pub transport: Transport,
    /// How long published KV is held for D (and, for UCX, how long a pulled region stays
    /// reserved if D never releases it).
    pub hold: Duration,
    /// UCX only: bytes of UCX-allocated KV memory (the pool transfers are carved from).
    pub pool_bytes: usize,
    /// UCX only: the pool's block size; a transfer occupies whole blocks.
    pub block_bytes: usize,
}

impl ExportConfig {
    /// `transport` with a 256 MiB pool of 64 KiB blocks for UCX.
    pub fn new(transport: Transport, hold: Duration) -> Self {
        ExportConfig {
            transport,
            hold,
            pool_bytes: 256 << 20,
            block_bytes: 64 << 10,
        }
    }
}

#[derive(Clone)]
enum Exporter {
    Tcp(tcp::TcpExporter),
    #[cfg(feature = "ucx")]
    Ucx(ucx::UcxExporter),
}

/// P side: holds KV under transfer ids and serves it to D over the configured transport.
#[derive(Clone)]
pub struct KvExporter {
    inner: Exporter,
}

impl KvExporter {
    /// A TCP exporter listening on `addr` (port 0 picks one); KV nobody pulls is dropped after
    /// `hold`.
    pub async fn bind(addr: SocketAddr, hold: Duration) -> Result<Self, TransferError> {
        Self::start(addr, ExportConfig::new(Transport::Tcp, hold)).await
    }

    /// An exporter for `config.transport` whose listener binds `addr`.
    pub async fn start(addr: SocketAddr, config: ExportConfig) -> Result<Self, TransferError> {
        let inner = match config.transport {
            Transport::Tcp => Exporter::Tcp(tcp::TcpExporter::bind(addr, config.hold).await?),
            #[cfg(feature = "ucx")]
            Transport::Ucx => Exporter::Ucx(ucx::UcxExporter::bind(addr, config).await?),
            #[cfg(not(feature = "ucx"))]
            transport @ Transport::Ucx => {
                return Err(TransferError::TransportDisabled { transport })
            }
        };
        Ok(KvExporter { inner })
    }

    /// The address to register: `tcp://host:port` or `ucx://host:port`.
    pub fn transfer_addr(&self) -> String {
        match &self.inner {
            Exporter::Tcp(tcp) => tcp.transfer_addr(),
            #[cfg(feature = "ucx")]
            Exporter::Ucx(ucx) => ucx.transfer_addr(),
        }
    }

    /// Makes `kv` available under `transfer_id` and wakes a D worker already waiting for it.
    /// UCX copies it into the exporter's UCX-allocated memory, which can be full.
    pub fn publish(&self, transfer_id: &str, kv: &[u8]) -> Result<(), TransferError> {
        match &self.inner {
            Exporter::Tcp(tcp) => {
                tcp.publish(transfer_id, Bytes::copy_from_slice(kv));
                Ok(())
            }
            #[cfg(feature = "ucx")]
            Exporter::Ucx(ucx) => ucx.publish(transfer_id, kv),
        }
    }

    /// How many transfers D is reading right now: UCX transfers described and not yet released
    /// (TCP sends the bytes in the answer, so never any).
    pub fn in_flight(&self) -> usize {
        match &self.inner {
            Exporter::Tcp(_) => 0,
            #[cfg(feature = "ucx")]
            Exporter::Ucx(ucx) => ucx.in_flight(),
        }
    }

    /// How many transfers are held or awaited (UCX: plus those pulled and not yet released).
    pub fn pending(&self) -> usize {
        match &self.inner {
            Exporter::Tcp(tcp) => tcp.pending(),
            #[cfg(feature = "ucx")]
            Exporter::Ucx(ucx) => ucx.pending() + ucx.in_flight(),
        }
    }
}

/// D side: pulls KV from exporters of any built transport, chosen by the address's scheme.
/// Cheap to clone; share one per process (UCX starts its context on the first `ucx://` pull).
#[derive(Clone)]
pub struct KvPuller {
    tcp: tcp::TcpPuller,
    #[cfg(feature = "ucx")]
    ucx: std::sync::Arc<tokio::sync::OnceCell<ucx::UcxPuller>>,
}

impl Default for KvPuller {
    fn default() -> Self {
        Self::new(Duration::from_secs(3))
    }
}

impl KvPuller {
    /// A puller whose HTTP connections must open within `connect_timeout`.
    pub fn new(connect_timeout: Duration) -> Self {
        KvPuller {
            tcp: tcp::TcpPuller::new(connect_timeout),
            #[cfg(feature = "ucx")]
            ucx: Default::default(),
        }
    }

    /// Pulls the KV published under `transfer_id` at `addr`, waiting for P to publish it for at
    /// most `deadline`, which bounds the whole call.
    pub async fn pull(
        &self,
        addr: &str,
        transfer_id: &str,
        deadline: Duration,
    ) -> Result<Bytes, TransferError> {
        self.pull_into(addr, transfer_id, deadline, Vec::new())
            .await
            .map(Bytes::from)
    }

    /// [`KvPuller::pull`] into `buffer`, whose allocation is reused when large enough (a D
    /// worker's KV memory, already faulted in): returns it holding the KV.
    pub async fn pull_into(
        &self,
        addr: &str,
        transfer_id: &str,
        deadline: Duration,
        buffer: Vec<u8>,
    ) -> Result<Vec<u8>, TransferError> {
        match Transport::parse(addr)? {
            (Transport::Tcp, host_port) => {
                self.tcp
                    .pull(addr, host_port, transfer_id, deadline, buffer)
                    .await
            }
            #[cfg(feature = "ucx")]
            (Transport::Ucx, _) => {
                let puller = self
                    .ucx
                    .get_or_try_init(|| async { ucx::UcxPuller::new(ucx::PullConfig::default()) })
                    .await?;
                puller.pull(addr, transfer_id, deadline, buffer).await
            }
            #[cfg(not(feature = "ucx"))]
            (transport @ Transport::Ucx, _) => Err(TransferError::TransportDisabled { transport }),
        }
    }
}

/// `len` bytes of a xorshift64 stream seeded by `seed`: reproducible KV contents, so that the
/// receiving side can check every byte of a transfer without a second copy (the `kv-transfer`
/// tool and the simulated engines fill and verify KV with it).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn patterns_are_reproducible_and_seed_dependent() {
        let a = super::pattern(7, 1001);
        assert_eq!(a.len(), 1001);
        assert_eq!(a, super::pattern(7, 1001));
        assert_eq!(&a[..500], &super::pattern(7, 500)[..]);
        assert_ne!(a, super::pattern(9, 1001));
        assert!(a.iter().any(|b| *b != 0));
    }

    use super::*;

    #[test]
    fn addresses_name_their_transport() {
        assert_eq!(
            Transport::parse("tcp://10.0.0.5:4000").unwrap(),
            (Transport::Tcp, "10.0.0.5:4000")
        );
        for bad in ["10.0.0.5:4000", "tcp://", "tcp://h:1/kv", "rdma://h:1"] {
            let err = Transport::parse(bad).unwrap_err();
            assert!(
                matches!(err, TransferError::UnsupportedAddress { .. }),
                "{bad}: {err:?}"
            );
        }
        let ucx = Transport::parse("ucx://10.0.0.5:4000");
        if cfg!(feature = "ucx") {
            assert_eq!(ucx.unwrap(), (Transport::Ucx, "10.0.0.5:4000"));
        } else {
            let message = ucx.unwrap_err().to_string();
            assert!(message.contains("--features ucx"), "{message}");
        }
    }

    #[cfg(not(feature = "ucx"))]
    #[tokio::test]
    async fn a_build_without_ucx_says_how_to_get_it() {
        let config = ExportConfig::new(Transport::Ucx, Duration::from_secs(1));
        let err = KvExporter::start("127.0.0.1:0".parse().unwrap(), config)
            .await
            .err()
            .unwrap();
        assert!(err.to_string().contains("--features ucx"), "{err}");
        let pulled = KvPuller::default()
            .pull("ucx://127.0.0.1:1", "x", Duration::from_secs(1))
            .await;
        assert!(
            matches!(pulled, Err(TransferError::UnsupportedAddress { .. })),
            "{pulled:?}"
        );
    }
}
