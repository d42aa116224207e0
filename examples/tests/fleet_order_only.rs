//! `pd-bench fleet`, the order-only replay, against the traces' own oracle
//! (`../shared/bench/traces/cache_sim.py`, run here by Python): on both Mooncake traces, each
//! routing rule's hit rate on 10 engines of 3M cached tokens, and one engine's hit rate at each
//! cache size, equal the oracle's to within 0.005 (and the load spread to within 0.01). A
//! malformed trace stops the run before anything is replayed, naming its file, line and field.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn traces() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/bench/traces")
}

fn pd_bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pd-bench"))
        .args(args)
        .output()
        .unwrap()
}

/// The oracle's figures for `trace`: `rules` (hit rate, imbalance by rule) and `one` (one
/// engine's hit rate by cache tokens).
fn oracle(trace: &Path) -> Value {
    const SCRIPT: &str = r#"
import json, sys
sys.path.insert(0, sys.argv[1])
import cache_sim
reqs = [json.loads(line) for line in open(sys.argv[2])]
rules = {p: cache_sim.simulate(reqs, 10, 3e6, p, 512)
         for p in ["random", "round_robin", "least_load", "prefix_greedy", "prefix_bounded"]}
one = {str(int(c)): cache_sim.simulate(reqs, 1, c, "round_robin", 512)[0]
       for c in [1e5, 1e6, 3e6, 1e7, 3e7, 5e7, 1e9]}
print(json.dumps({"rules": rules, "one": one}))
"#;
    let output = Command::new("python3")
        .args(["-c", SCRIPT])
        .arg(traces())
        .arg(trace)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

#[test]
fn the_order_only_replay_finds_the_oracles_hit_rates() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("fleet.md");
    let conversation = traces().join("mooncake-fast25/conversation_trace.jsonl");
    let synthetic = traces().join("mooncake-fast25/synthetic_trace.jsonl");
    let both = format!("{},{}", conversation.display(), synthetic.display());
    let run = pd_bench(&["--out", report.to_str().unwrap(), "fleet", "--trace", &both]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    let rows: Value =
        serde_json::from_slice(&std::fs::read(report.with_extension("json")).unwrap()).unwrap();
    for trace in [&conversation, &synthetic] {
        let name = trace.file_name().unwrap().to_str().unwrap();
        let expected = oracle(trace);
        let ours = |section: &str| {
            let rows = rows[section].as_array().unwrap().iter();
            rows.filter(|row| row["trace"] == name)
                .cloned()
                .collect::<Vec<Value>>()
        };
        let by_rule = ours("fleet-order");
        assert_eq!(by_rule.len(), 5, "{rows}");
        for row in by_rule {
            let rule = row["rule"].as_str().unwrap();
            let [hit, imbalance] = [&expected["rules"][rule][0], &expected["rules"][rule][1]]
                .map(|v| v.as_f64().unwrap());
            let (our_hit, our_imbalance) = (
                row["hit_rate"].as_f64().unwrap(),
                row["imbalance"].as_f64().unwrap(),
            );
            eprintln!("{name} {rule}: hit {our_hit:.4} (oracle {hit:.4}), imbalance {our_imbalance:.3} (oracle {imbalance:.3})");
            assert!(
                (our_hit - hit).abs() <= 0.005,
                "{name} {rule}: {our_hit} vs {hit}"
            );
            assert!(
                (our_imbalance - imbalance).abs() <= 0.01,
                "{name} {rule}: {our_imbalance} vs {imbalance}"
            );
        }
        let one_cache = ours("fleet-one-cache");
        assert_eq!(one_cache.len(), 7, "{rows}");
        for row in one_cache {
            let tokens = row["cache_tokens"].to_string();
            let hit = expected["one"][&tokens].as_f64().unwrap();
            let our_hit = row["hit_rate"].as_f64().unwrap();
            eprintln!("{name} one engine of {tokens} tokens: hit {our_hit:.4} (oracle {hit:.4})");
            assert!(
                (our_hit - hit).abs() <= 0.005,
                "{name} {tokens}: {our_hit} vs {hit}"
            );
        }
    }
}

#[test]
fn a_malformed_trace_stops_the_run_before_any_replay() {
    let dir = tempfile::tempdir().unwrap();
    let good = traces().join("mooncake-fast25/synthetic_trace.jsonl");
    let bad = dir.path().join("bad.jsonl");
    let lines = [
        r#"{"timestamp": 0, "input_length": 600, "output_length": 9, "hash_ids": [0, 1]}"#,
        r#"{"timestamp": 3, "input_length": 600, "output_length": 9, "hash_ids": [0]}"#,
    ];
    std::fs::write(&bad, lines.join("\n")).unwrap();
    let both = format!("{},{}", good.display(), bad.display());
    // Timed too: the traces are all read before any fleet starts.
    let run = pd_bench(&["fleet", "--trace", &both, "--timed"]);
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    let expected = format!(
        "error: {}:2: `hash_ids` holds 1 ids where input_length 600 needs 2",
        bad.display()
    );
    assert!(stderr.contains(&expected), "{stderr}");
    assert!(run.stdout.is_empty(), "nothing was replayed");

    let missing = dir.path().join("missing.csv");
    let run = pd_bench(&["fleet", "--trace", missing.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("cannot read the trace"), "{stderr}");
    let run = pd_bench(&["fleet", "--trace", good.to_str().unwrap(), "--from=-1"]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        stderr.contains("`-1` is not a number of at least 0"),
        "{stderr}"
    );
}
