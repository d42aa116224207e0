//! `pd-bench fleet --timed`: public traces (a Mooncake window with its block ids, an Azure one
//! without) replayed open-loop through pd-proxy on a small fleet of sim-engines running the
//! engine model; every answer comes whole, and the report holds each system's latency, hit
//! rate, spread, lag and CPU rows and its goodput. Azure's code and conversation windows joined
//! into one shifting replay run on a fixed split, on engines of both roles and autoscaled by
//! the bench from the planner's gauges: the verdicts compare them. A bad timed flag stops the
//! run before any fleet starts.

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

#[test]
fn a_timed_replay_answers_every_request_and_reports_each_system() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("fleet.md");
    let conversation = traces().join("mooncake-fast25/conversation_trace.jsonl");
    let azure = traces().join("azure-llm-2023/AzureLLMInferenceTrace_conv.csv");
    let both = format!("{},{}", conversation.display(), azure.display());
    let args = [
        "--out",
        report.to_str().unwrap(),
        "fleet",
        "--trace",
        &both,
        "--to",
        "300",
        "--timed",
        "--splits",
        "2:2",
        "--max-requests",
        "12",
        "--systems",
        "round_robin,precise_prefix",
        "--rates",
        "1",
        "--ttft-slo",
        "60",
        "--tpot-slo",
        "1",
    ];
    let run = pd_bench(&args);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    let rows: Value =
        serde_json::from_slice(&std::fs::read(report.with_extension("json")).unwrap()).unwrap();
    let timed = rows["fleet-timed"].as_array().unwrap();
    assert_eq!(timed.len(), 4, "{rows}");
    for row in timed {
        let number = |field: &str| {
            row[field]
                .as_f64()
                .unwrap_or_else(|| panic!("{field}: {row}"))
        };
        assert_eq!(row["requests"], 12, "{row}");
        assert_eq!(row["complete"], 12, "every answer whole: {row}");
        assert_eq!(
            (row["refused"].clone(), row["failed"].clone()),
            (0.into(), 0.into())
        );
        assert!(number("ttft_p50_ms") > 0.0 && number("ttft_p99_ms") >= number("ttft_p50_ms"));
        assert!(number("tpot_p90_ms") >= number("tpot_p50_ms") && number("tpot_p50_ms") > 0.0);
        assert!((0.0..=1.0).contains(&number("attainment")), "{row}");
        assert!(number("lag_max_ms") >= number("lag_p99_ms"), "{row}");
        assert!(
            number("sim_cpu_ms") > 0.0 && number("front_cpu_ms") > 0.0,
            "{row}"
        );
        assert!(number("spread") >= 1.0, "{row}");
        if row["trace"] == "AzureLLMInferenceTrace_conv.csv" {
            // No block ids: every prompt its own letters.
            assert!(number("hit_rate") < 0.01, "{row}");
        }
    }
    let goodput = rows["fleet-goodput"].as_array().unwrap();
    assert_eq!(goodput.len(), 4, "{rows}");
    for row in goodput {
        let timed_row = (timed.iter())
            .find(|t| t["system"] == row["system"] && t["trace"] == row["trace"])
            .filter(|t| t["split"] == row["split"])
            .unwrap();
        let expected = match timed_row["attainment"].as_f64().unwrap() >= 0.9 {
            true => timed_row["offered_rps"].as_f64().unwrap(),
            false => 0.0,
        };
        assert_eq!(row["goodput_rps"].as_f64().unwrap(), expected, "{row}");
    }
    let markdown = std::fs::read_to_string(&report).unwrap();
    assert!(markdown.contains("| goodput req/s |"), "{markdown}");
    assert!(report.with_file_name("fleet-fleet-goodput.svg").exists());
}

#[test]
fn a_shifting_replay_compares_moving_roles_and_the_autoscaler_with_a_fixed_split() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("fleet.md");
    let code = traces().join("azure-llm-2023/AzureLLMInferenceTrace_code.csv");
    let conv = traces().join("azure-llm-2023/AzureLLMInferenceTrace_conv.csv");
    let both = format!("{},{}", code.display(), conv.display());
    // 100 s of each at 10x: 20 s a run; the planner's pace is 10x too (its window 3 s, and
    // with --scale-down-after 30 its scale-down after 3 s safe), so the autoscaler has time to
    // stop an engine.
    let args = [
        "--out",
        report.to_str().unwrap(),
        "fleet",
        "--trace",
        &both,
        "--to",
        "100",
        "--shift",
        "--timed",
        "--splits",
        "2:2",
        "--systems",
        "precise_prefix,moving,autoscaled",
        "--rates",
        "1",
        "--ttft-slo",
        "2",
        "--tpot-slo",
        "0.1",
        "--start-delay",
        "5",
        "--scale-down-after",
        "30",
    ];
    let run = pd_bench(&args);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    let rows: Value =
        serde_json::from_slice(&std::fs::read(report.with_extension("json")).unwrap()).unwrap();
    let timed = rows["fleet-timed"].as_array().unwrap();
    let of = |roles: &str| {
        (timed.iter())
            .find(|r| r["roles"] == roles)
            .unwrap_or_else(|| panic!("no {roles} run: {rows}"))
    };
    let (fixed, moving, scaled) = (of("fixed"), of("moving"), of("autoscaled"));
    for row in [fixed, moving, scaled] {
        let name = "AzureLLMInferenceTrace_code.csv then AzureLLMInferenceTrace_conv.csv";
        assert_eq!(row["trace"], name, "{row}");
        assert!(row["requests"].as_u64().unwrap() > 100, "{row}");
        assert_eq!(
            row["complete"], row["requests"],
            "every answer whole: {row}"
        );
        assert!(row["engine_seconds"].as_f64().unwrap() > 0.0, "{row}");
    }
    assert_eq!(
        (fixed["split"].clone(), scaled["split"].clone()),
        ("2:2".into(), "2:2".into())
    );
    assert_eq!(moving["split"], "4 both");
    // The fixed fleet's four engines all the run long; the autoscaler stopped some.
    let stops = scaled["stops"].as_u64().unwrap();
    assert!(stops >= 1, "the light load needs fewer engines: {scaled}");
    let saved = |row: &Value| row["engine_seconds"].as_f64().unwrap();
    assert!(saved(scaled) < saved(fixed), "{scaled} against {fixed}");
    let verdict = &rows["fleet-roles"][0];
    assert_eq!(verdict["best_split"], "2:2", "{rows}");
    assert_eq!(verdict["fleet"], "4 both", "{rows}");
    let autoscale = &rows["fleet-autoscale"][0];
    assert_eq!(autoscale["stops"], stops, "{rows}");
    let markdown = std::fs::read_to_string(&report).unwrap();
    assert!(markdown.contains("| vs best | vs median |"), "{markdown}");
    for chart in ["fleet-fleet-roles.svg", "fleet-fleet-autoscale.svg"] {
        assert!(report.with_file_name(chart).exists(), "{chart}");
    }
}

#[test]
fn bad_timed_flags_stop_the_run_before_any_fleet() {
    let trace = traces().join("mooncake-fast25/synthetic_trace.jsonl");
    let trace = trace.to_str().unwrap();
    for (flag, value, says) in [
        ("--rates", "1,0", "`0` is not a number above 0"),
        ("--time-scale", "-2", "`-2` is not a number of at least 0"),
        ("--engine-model", "gpt-9", "invalid value 'gpt-9'"),
        ("--splits", "0:4", "each side of P:D is 1 to 256 engines"),
        ("--splits", "8", "`8` is not PREFILLS:DECODES"),
        (
            "--shift",
            "1,2",
            "--shift has 2 rates for 1 traces: one each",
        ),
        ("--shift", "0", "`0` is not a number above 0"),
        ("--start-delay", "-1", "`-1` is not a number of at least 0"),
        (
            "--scale-down-after",
            "x",
            "`x` is not a number of at least 0",
        ),
    ] {
        let given = format!("{flag}={value}");
        let run = pd_bench(&["fleet", "--trace", trace, "--timed", &given]);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(!run.status.success(), "{flag} {value}");
        assert!(stderr.contains(says), "{flag} {value}: {stderr}");
        assert!(run.stdout.is_empty(), "{flag} {value}: nothing ran");
    }
}
