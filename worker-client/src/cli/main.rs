//! `worker-client`: the bootstrap server from a shell, for operators and start-up scripts.
//!
//! Exit codes: 0 success (for `register --lease-ttl` and `watch`: stopped by SIGINT/SIGTERM); 1
//! the server refused the call (4xx; for `register --lease-ttl`: also refused to register the
//! worker again after its lease was lost), the topology is not ready, a request id did not
//! resolve, or (`drain --wait-idle`) a proxy still had requests in flight to the engine at the
//! idle timeout or refused the poll; 2 bad command-line usage; 3 the server could not be reached
//! in time (connection failure, timeout, 5xx).

mod drain;
mod idle;
mod output;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use pd_protocol::native::Deregister;
use pd_protocol::vllm::{QueryRequestsResponse, RegisterWorker, RequestLocation};
use pd_protocol::{Rank, Revision, MAX_LEASE_TTL};
use pd_service::{init_logging, parse_seconds, parse_seconds_or_zero, shutdown_signal, LogFormat};
use worker_client::{
    BootstrapClient, ClientError, ClientTls, LeaseKeeper, LeaseState, RequestOutcome,
};

use output::{print_changes, print_json, print_topology};

/// Talk to a pd-bootstrap (or vLLM Mooncake) bootstrap server.
///
/// Exit codes: 0 success (for `register --lease-ttl` and `watch`: stopped by SIGINT/SIGTERM);
/// 1 the server refused the call (4xx), the topology is not ready, a request id did not resolve,
/// a lost lease could not be registered again, or (`drain --wait-idle`) a proxy still had
/// requests in flight to the engine at the idle timeout or refused the poll; 2 bad usage; 3 the server could not be reached
/// in time (connection failure, timeout, 5xx).
#[derive(Debug, Parser)]
#[command(name = "worker-client", version, about, long_about)]
struct Cli {
    /// The bootstrap server's base URL.
    #[arg(
        long,
        env = "PD_BOOTSTRAP_URL",
        default_value = "http://127.0.0.1:8998",
        global = true
    )]
    url: String,
    /// Bearer token for write routes (the server's --auth-token).
    #[arg(
        long,
        env = "PD_BOOTSTRAP_TOKEN",
        hide_env_values = true,
        global = true
    )]
    token: Option<String>,
    /// Seconds allowed for one HTTP attempt.
    #[arg(long, default_value = "5", value_parser = parse_seconds, global = true)]
    timeout: Duration,
    /// CA certificates (PEM) trusted for an https:// server, beside the system's.
    #[arg(long, env = "PD_BOOTSTRAP_CA_FILE", global = true)]
    ca_file: Option<PathBuf>,
    /// Client certificate (PEM) for a server with --tls-client-ca. Needs --key-file.
    #[arg(
        long,
        env = "PD_BOOTSTRAP_CERT_FILE",
        global = true,
        requires = "key_file"
    )]
    cert_file: Option<PathBuf>,
    /// The private key (PEM) of --cert-file.
    #[arg(
        long,
        env = "PD_BOOTSTRAP_KEY_FILE",
        global = true,
        requires = "cert_file"
    )]
    key_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Register one P worker, retrying until the server answers or --deadline passes. With
    /// --lease-ttl, stay in the foreground keeping the lease alive until SIGINT/SIGTERM, then
    /// revoke it (a sidecar for workers that are not written in Rust).
    Register {
        /// The engine id.
        #[arg(long)]
        engine_id: String,
        /// Data-parallel rank.
        #[arg(long, default_value_t = 0)]
        dp_rank: Rank,
        /// Tensor-parallel rank.
        #[arg(long, default_value_t = 0)]
        tp_rank: Rank,
        /// Pipeline-parallel rank.
        #[arg(long, default_value_t = 0)]
        pp_rank: Rank,
        /// The worker's transfer address, e.g. tcp://10.0.0.5:41231.
        #[arg(long)]
        addr: String,
        /// Take the slot over from the engine holding it (`--replace` or `--replace true`), never
        /// do (`--replace false`); without it the server's --engine-conflict policy decides
        /// (takeover by default).
        #[arg(long, num_args = 0..=1, default_missing_value = "true")]
        replace: Option<bool>,
        /// Seconds to keep retrying.
        #[arg(long, default_value = "600", value_parser = parse_seconds)]
        deadline: Duration,
        /// Register under a lease of this many seconds and keep it alive until SIGINT/SIGTERM:
        /// if this process dies, the registration expires by itself.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_LEASE_TTL)))]
        lease_ttl: Option<u32>,
    },
    /// Remove an engine's registrations (all of them, or the ranks given).
    Deregister {
        /// The engine id.
        #[arg(long)]
        engine_id: String,
        /// Only this dp rank.
        #[arg(long)]
        dp_rank: Option<Rank>,
        /// Only this tp rank.
        #[arg(long)]
        tp_rank: Option<Rank>,
        /// Only this pp rank.
        #[arg(long)]
        pp_rank: Option<Rank>,
    },
    /// Mark an engine draining (routers that follow the server's watch, such as pd-proxy, send
    /// it no new requests within a second) or, with --undo, take requests again. With
    /// --wait-idle, then wait until every proxy named has no request in flight to it (an engine
    /// pod's preStop hook).
    Drain(drain::DrainArgs),
    /// Show the registered topology.
    Query {
        /// Only this engine.
        #[arg(long)]
        engine_id: Option<String>,
        /// Print the server's JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Request-id mappings (vLLM's request-keyed API).
    #[command(subcommand)]
    Requests(RequestsCommand),
    /// Wait until the configured topology is complete (exit 0) or --wait-timeout passes (exit 1).
    WaitReady {
        /// Seconds to wait.
        #[arg(long, default_value = "60", value_parser = parse_seconds)]
        wait_timeout: Duration,
    },
    /// Print worker changes as they happen, one line each, until SIGINT/SIGTERM. Without --since
    /// the registered workers are listed first (`listed` lines after a `snapshot` line), and
    /// again whenever the server's history no longer reaches back far enough.
    Watch {
        /// Print the changes after this registry revision (no initial list).
        #[arg(long)]
        since: Option<Revision>,
        /// Print one JSON object per line: `{"type":"snapshot","revision":R,"workers":[...]}`
        /// or the server's event (`{"revision":R,"type":"put"|"delete","worker":{...}}`).
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum RequestsCommand {
    /// Map a request id to a dp rank.
    Register {
        /// The request id.
        #[arg(long)]
        req_id: String,
        /// The dp rank holding its KV.
        #[arg(long)]
        dp_rank: Rank,
    },
    /// Ask where request ids' KV lives, re-asking for unregistered ones until --wait passes.
    Query(QueryArgs),
    /// Forget a request id.
    Release {
        /// The request id.
        req_id: String,
    },
}

#[derive(Debug, Args)]
struct QueryArgs {
    /// The asking D worker's tp rank.
    #[arg(long, default_value_t = 0)]
    tp_rank: Rank,
    /// The D deployment's tp size.
    #[arg(long, default_value_t = 1)]
    tp_size: Rank,
    /// Seconds to keep re-asking for ids P has not registered yet (0: ask once).
    #[arg(long, default_value = "0", value_parser = parse_seconds_or_zero)]
    wait: Duration,
    /// Print JSON instead of lines.
    #[arg(long)]
    json: bool,
    /// The request ids.
    #[arg(required = true)]
    req_ids: Vec<String>,
}

/// A failed command: what to print and the exit code.
struct Failure {
    code: u8,
    message: String,
}

impl From<ClientError> for Failure {
    fn from(err: ClientError) -> Self {
        let code = match &err {
            ClientError::Rejected { .. } | ClientError::UnknownEngine { .. } => 1,
            ClientError::InvalidUrl { .. } | ClientError::InvalidInput { .. } => 2,
            _ => 3,
        };
        Failure {
            code,
            message: err.to_string(),
        }
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let tls = ClientTls::load(
        cli.ca_file.as_deref(),
        cli.cert_file.as_deref(),
        cli.key_file.as_deref(),
    )
    .map_err(|err| Failure {
        code: 2,
        message: err.to_string(),
    })?;
    let mut builder = BootstrapClient::builder(&cli.url)
        .request_timeout(cli.timeout)
        .tls(tls.clone());
    if let Some(token) = &cli.token {
        builder = builder.token(token);
    }
    if let Command::Register { deadline, .. } = &cli.command {
        builder = builder.register_deadline(*deadline);
    }
    let client = builder.build()?;
    match cli.command {
        Command::Register {
            engine_id,
            dp_rank,
            tp_rank,
            pp_rank,
            addr,
            replace,
            deadline: _,
            lease_ttl,
        } => {
            let worker = RegisterWorker {
                engine_id,
                dp_rank,
                tp_rank,
                pp_rank,
                addr,
                replace,
                lease_ttl: None,
                meta: Default::default(),
            };
            match lease_ttl {
                Some(ttl) => keep_registered(client.register_leased(&worker, ttl).await?).await?,
                None => {
                    client.register_worker(&worker).await?;
                    println!("registered");
                }
            }
        }
        Command::Deregister {
            engine_id,
            dp_rank,
            tp_rank,
            pp_rank,
        } => {
            let removed = client
                .deregister(&Deregister {
                    engine_id,
                    dp_rank,
                    tp_rank,
                    pp_rank,
                })
                .await?;
            println!("removed {removed} worker(s)");
        }
        Command::Drain(args) => drain::drain(&client, args, cli.timeout, &tls).await?,
        Command::Query { engine_id, json } => {
            let topology = client.topology(engine_id.as_deref()).await?;
            if json {
                print_json(&topology);
            } else {
                print_topology(&topology);
            }
        }
        Command::Requests(RequestsCommand::Register { req_id, dp_rank }) => {
            client.register_request(&req_id, dp_rank).await?;
            println!("registered {req_id} -> dp rank {dp_rank}");
        }
        Command::Requests(RequestsCommand::Release { req_id }) => {
            let released = client.release_request(&req_id).await?;
            println!("{}", if released { "released" } else { "not live" });
        }
        Command::Requests(RequestsCommand::Query(args)) => {
            let outcomes = client
                .query_requests(&args.req_ids, args.tp_rank, args.tp_size, args.wait)
                .await?;
            let unresolved = outcomes
                .values()
                .any(|o| !matches!(o, RequestOutcome::Ready(_)));
            if args.json {
                let results = outcomes
                    .into_iter()
                    .map(|(id, outcome)| (id, RequestLocation::from(outcome)))
                    .collect();
                print_json(&QueryRequestsResponse { results });
            } else {
                for (id, outcome) in &outcomes {
                    match outcome {
                        RequestOutcome::Ready(addrs) => println!("{id}\tok\t{}", addrs.join(",")),
                        RequestOutcome::Failed(text) => println!("{id}\terror\t{text}"),
                        RequestOutcome::TimedOut => println!("{id}\tretry"),
                    }
                }
            }
            if unresolved {
                return Err(Failure {
                    code: 1,
                    message: "some request ids did not resolve".to_owned(),
                });
            }
        }
        Command::WaitReady { wait_timeout } => {
            let status = client.wait_ready(wait_timeout).await?;
            if status.status != "ready" {
                return Err(Failure {
                    code: 1,
                    message: status
                        .detail
                        .unwrap_or_else(|| format!("not ready after {wait_timeout:?}")),
                });
            }
            match status.expected {
                Some(expected) => {
                    println!("ready: {}/{expected} workers registered", status.registered)
                }
                None => println!(
                    "ready: {} workers registered (no expected topology configured)",
                    status.registered
                ),
            }
        }
        Command::Watch { since, json } => {
            tokio::select! {
                result = print_changes(&client, since, json) => result?,
                () = shutdown_signal() => {}
            }
        }
    }
    Ok(())
}

/// `register --lease-ttl`: keeps the lease alive until a signal, then revokes it.
async fn keep_registered(keeper: LeaseKeeper) -> Result<(), Failure> {
    if let LeaseState::Alive { lease_id, ttl } = keeper.state() {
        println!("registered under lease {lease_id} (ttl {ttl} s); keeping it alive until SIGINT/SIGTERM");
    }
    let mut state = keeper.subscribe();
    tokio::select! {
        failed = state.wait_for(|s| matches!(s, LeaseState::Failed { .. })) => {
            let reason = match failed.as_deref() {
                Ok(LeaseState::Failed { reason }) => reason.clone(),
                _ => "the lease keeper stopped".to_owned(),
            };
            return Err(Failure { code: 1, message: reason });
        }
        () = shutdown_signal() => {}
    }
    let revoked = keeper.release().await?;
    println!(
        "{}",
        if revoked {
            "lease revoked"
        } else {
            "lease was already gone"
        }
    );
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let _logging = init_logging(LogFormat::Text);
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("error: {}", failure.message);
            ExitCode::from(failure.code)
        }
    }
}
