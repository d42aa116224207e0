//! `epp-conformance ADDR`: checks the endpoint picker at ADDR (its ext_proc service) against the
//! Gateway API Inference Extension's endpoint picker protocol, one line per rule; exits 1 when a
//! rule fails, 2 when the picker cannot be reached.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use pd_epp_conformance::Checker;

/// Check an endpoint picker (GIE's protocol over Envoy's ext_proc) without a cluster.
#[derive(Debug, Parser)]
#[command(name = "epp-conformance", version, about)]
struct Args {
    /// The picker's ext_proc address, `host:port`.
    addr: String,
    /// The `model` of the requests sent (default: none named).
    #[arg(long)]
    model: Option<String>,
    /// Seconds one answer may take.
    #[arg(long, default_value_t = 5.0)]
    wait: f64,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    let wait = Duration::from_secs_f64(args.wait.max(0.001));
    let mut checker = match Checker::connect(&args.addr, args.model, wait).await {
        Ok(checker) => checker,
        Err(err) => {
            eprintln!("epp-conformance: {}: {err}", args.addr);
            return ExitCode::from(2);
        }
    };
    let verdicts = checker.run(|verdict| println!("{verdict}")).await;
    let failed = verdicts.iter().filter(|v| v.outcome.is_err()).count();
    println!("{} passed, {failed} failed", verdicts.len() - failed);
    match failed {
        0 => ExitCode::SUCCESS,
        _ => ExitCode::FAILURE,
    }
}
