//! `worker-client`: the bootstrap server from a shell, for operators and start-up scripts.
//!
//! Exit codes: 0 success; 1 the server refused the call (4xx), the topology is not ready, or a
//! request id did not resolve; 2 bad command-line usage; 3 the server could not be reached in
//! time (connection failure, timeout, 5xx).

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use worker_client::protocol::{
    Deregister, QueryRequestsResponse, Rank, RegisterWorker, RequestLocation, Topology,
};
use worker_client::service::{init_logging, parse_seconds, parse_seconds_or_zero, LogFormat};
use worker_client::{BootstrapClient, ClientError, RequestOutcome};

/// Talk to a pd-bootstrap (or vLLM Mooncake) bootstrap server.
#[derive(Debug, Parser)]
#[command(name = "worker-client", version, about)]
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
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Register one P worker, retrying until the server answers or --deadline passes.
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
        /// Take the dp rank over from another engine (a restarted engine).
        #[arg(long)]
        replace: bool,
        /// Seconds to keep retrying.
        #[arg(long, default_value = "600", value_parser = parse_seconds)]
        deadline: Duration,
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
            ClientError::InvalidUrl { .. } => 2,
            _ => 3,
        };
        Failure {
            code,
            message: err.to_string(),
        }
    }
}

fn print_json(value: &impl serde::Serialize) {
    println!(
        "{}",
        serde_json::to_string_pretty(value).expect("wire types serialize")
    );
}

fn print_topology(topology: &Topology) {
    if topology.is_empty() {
        println!("no workers registered");
        return;
    }
    println!(
        "{:<4} {:<38} {:<4} {:<4} ADDRESS",
        "DP", "ENGINE", "TP", "PP"
    );
    for (dp, group) in topology {
        for (tp, pps) in &group.worker_addr {
            for (pp, addr) in pps {
                let engine = group.engine_id.as_deref().unwrap_or("-");
                println!("{dp:<4} {engine:<38} {tp:<4} {pp:<4} {addr}");
            }
        }
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let mut builder = BootstrapClient::builder(&cli.url).request_timeout(cli.timeout);
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
        } => {
            client
                .register_worker(&RegisterWorker {
                    engine_id,
                    dp_rank,
                    tp_rank,
                    pp_rank,
                    addr,
                    replace,
                    lease_ttl: None,
                })
                .await?;
            println!("registered");
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
    }
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(LogFormat::Text);
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("error: {}", failure.message);
            ExitCode::from(failure.code)
        }
    }
}
