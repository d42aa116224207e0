//! What the CLI prints: JSON, the topology as a table, and the watch's updates as lines.

use futures_util::StreamExt;
use pd_protocol::native::{WorkerEventKind, WorkerInfo};
use pd_protocol::vllm::Topology;
use pd_protocol::Revision;
use worker_client::{BootstrapClient, WatchUpdate};

use super::Failure;

/// Prints `value` as pretty JSON.
pub fn print_json(value: &impl serde::Serialize) {
    println!(
        "{}",
        serde_json::to_string_pretty(value).expect("wire types serialize")
    );
}

/// Prints a topology as a table, one worker a line.
pub fn print_topology(topology: &Topology) {
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

/// `watch`: prints every update of the watch stream until it ends with an error.
pub async fn print_changes(
    client: &BootstrapClient,
    since: Option<Revision>,
    json: bool,
) -> Result<(), Failure> {
    let mut updates = client.watch(since);
    while let Some(update) = updates.next().await {
        match update {
            Ok(WatchUpdate::Snapshot(list)) if json => println!(
                "{}",
                serde_json::json!({"type": "snapshot", "revision": list.revision, "workers": list.workers})
            ),
            Ok(WatchUpdate::Snapshot(list)) => {
                println!(
                    "{}\tsnapshot\t{} worker(s)",
                    list.revision,
                    list.workers.len()
                );
                for worker in &list.workers {
                    println!("{}\tlisted\t{}", list.revision, worker_line(worker));
                }
            }
            Ok(WatchUpdate::Events(batch)) => {
                for event in &batch.events {
                    if json {
                        println!(
                            "{}",
                            serde_json::to_string(event).expect("wire types serialize")
                        );
                    } else {
                        let kind = match event.kind {
                            WorkerEventKind::Put => "put",
                            WorkerEventKind::Delete => "delete",
                        };
                        println!("{}\t{kind}\t{}", event.revision, worker_line(&event.worker));
                    }
                }
            }
            Err(err) if err.is_retryable() => {
                tracing::warn!(error = %err, "watch failed; retrying");
            }
            Err(err) => return Err(err.into()),
        }
    }
    Ok(())
}

/// `ENGINE<TAB>DP<TAB>TP<TAB>PP<TAB>ADDR<TAB>LEASE` (`-` for what is absent).
fn worker_line(worker: &WorkerInfo) -> String {
    format!(
        "{}\t{}\t{}\t{}\t{}\t{}",
        worker.engine_id.as_deref().unwrap_or("-"),
        worker.dp_rank,
        worker.tp_rank,
        worker.pp_rank,
        worker.addr,
        worker
            .lease_id
            .map_or_else(|| "-".to_owned(), |id| id.to_string())
    )
}
