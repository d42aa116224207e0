//! A public serving trace, read and checked before anything replays it: Mooncake's JSONL
//! (arrival in ms, prompt and answer lengths, chained hashes of the prompt's 512-token blocks)
//! or Azure's 2023 CSV (arrival time, prompt and answer lengths; no prefix data). The first bad
//! line stops the read, naming the file, the line and the field.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Map, Value};

/// Tokens per block of a Mooncake trace's `hash_ids`.
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRequest {
    /// When it arrives, from the trace's start.
    pub at: Duration,
    /// Prompt tokens.
    pub input: u32,
    /// Answer tokens: the answer is exactly this long.
    pub output: u32,
    /// Chained hashes of the prompt's blocks (the last one partial): two requests whose first
    /// k hashes are equal share their first k blocks' tokens. Empty when the trace has none.
    pub blocks: Vec<u64>,
}

/// A whole trace, in arrival order.
#[derive(Debug, Clone)]
pub struct Trace {
    /// The file's name (for reports).
    pub name: String,
    /// Tokens per block of [`TraceRequest::blocks`].
    pub block_tokens: u32,
    /// The requests, their arrivals never decreasing.
    pub requests: Vec<TraceRequest>,
}

/// Why a trace cannot be replayed.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file cannot be read.
    #[error("cannot read the trace {file}: {source}")]
    Io {
        /// The trace.
        file: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// A line does not fit the format.
    #[error("{file}:{line}: `{field}` {problem}")]
    Line {
        /// The trace.
        file: PathBuf,
        /// The line, from 1.
        line: usize,
        /// The field at fault (`line` for the line as a whole).
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// Neither format, or nothing to replay.
    #[error("{file}: {problem}")]
    File {
        /// The trace.
        file: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
}

impl Trace {
    /// Reads and checks the trace at `path`: `.jsonl` is Mooncake's format, `.csv` Azure's.
    pub fn read(path: &Path) -> Result<Self, TraceError> {
        let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
            file: path.to_path_buf(),
            source,
        })?;
        let requests = match path.extension().and_then(|e| e.to_str()) {
            Some("jsonl") => mooncake(path, &text)?,
            Some("csv") => azure(path, &text)?,
            _ => {
                return Err(file_error(
                    path,
                    "not a Mooncake .jsonl or an Azure .csv trace",
                ))
            }
        };
        if requests.is_empty() {
            return Err(file_error(path, "holds no requests"));
        }
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |name| name.to_string_lossy().into_owned(),
        );
        Ok(Trace {
            name,
            block_tokens: MOONCAKE_BLOCK_TOKENS,
            requests,
        })
    }

    /// The requests arriving in `[from, to)`, their arrivals counted from `from`.
    pub fn window(&self, from: Duration, to: Option<Duration>) -> Trace {
        let requests = (self.requests.iter())
            .filter(|r| r.at >= from && to.is_none_or(|to| r.at < to))
            .map(|r| TraceRequest {
                at: r.at - from,
                ..r.clone()
            })
            .collect();
        Trace {
            requests,
            ..self.clone()
        }
    }

    /// The trace with its arrivals `speed` times as fast (2: twice as many requests a second).
    pub fn sped(&self, speed: f64) -> Trace {
        let requests = (self.requests.iter())
            .map(|r| TraceRequest {
                at: r.at.div_f64(speed),
                ..r.clone()
            })
            .collect();
        Trace {
            requests,
            ..self.clone()
        }
    }

    /// This trace, then `next` arriving from `after` on: one replay whose shape shifts. The
    /// second's block ids are moved past the first's, so the two share no prefix; named
    /// `A then B`. Both must count their blocks in the same tokens.
    pub fn then(&self, next: &Trace, after: Duration) -> Result<Trace, String> {
        if self.has_blocks() && next.has_blocks() && self.block_tokens != next.block_tokens {
            return Err(format!(
                "{} and {} count their blocks in different tokens ({} and {})",
                self.name, next.name, self.block_tokens, next.block_tokens
            ));
        }
        let past = (self.requests.iter())
            .flat_map(|r| r.blocks.iter().copied())
            .max()
            .map_or(0, |most| most + 1);
        let moved = (next.requests.iter()).map(|r| TraceRequest {
            at: after + r.at,
            blocks: r.blocks.iter().map(|block| block + past).collect(),
            ..r.clone()
        });
        let block_tokens = match self.has_blocks() {
            true => self.block_tokens,
            false => next.block_tokens,
        };
        Ok(Trace {
            name: format!("{} then {}", self.name, next.name),
            block_tokens,
            requests: self.requests.iter().cloned().chain(moved).collect(),
        })
    }

    /// Whether the trace names its prompts' blocks (Mooncake's does, Azure's does not).
    pub fn has_blocks(&self) -> bool {
        self.requests.iter().any(|r| !r.blocks.is_empty())
    }
}

fn file_error(path: &Path, problem: &str) -> TraceError {
    TraceError::File {
        file: path.to_path_buf(),
        problem: problem.to_owned(),
    }
}

/// Checks every line and field of a Mooncake JSONL trace.
fn mooncake(path: &Path, text: &str) -> Result<Vec<TraceRequest>, TraceError> {
    let mut requests: Vec<TraceRequest> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let bad = |field: &str, problem: String| line_error(path, i + 1, field, problem);
        if line.trim().is_empty() {
            continue;
        }
        let object: Map<String, Value> = serde_json::from_str(line)
            .map_err(|err| bad("line", format!("is not a JSON object: {err}")))?;
        let number = |field: &str| match object.get(field) {
            None => Err(bad(field, "is missing".into())),
            Some(value) => value
                .as_u64()
                .ok_or_else(|| bad(field, format!("must be a whole number >= 0, not {value}"))),
        };
        let at = Duration::from_millis(number("timestamp")?);
        let count = |field: &str| {
            let value = number(field)?;
            match u32::try_from(value) {
                Ok(count) if count > 0 => Ok(count),
                _ => Err(bad(
                    field,
                    format!("must be from 1 to {}, not {value}", u32::MAX),
                )),
            }
        };
        let (input, output) = (count("input_length")?, count("output_length")?);
        let blocks = match object.get("hash_ids") {
            None => return Err(bad("hash_ids", "is missing".into())),
            Some(Value::Array(ids)) => (ids.iter())
                .map(|id| id.as_u64())
                .collect::<Option<Vec<u64>>>()
                .ok_or_else(|| bad("hash_ids", "must hold whole numbers >= 0".into()))?,
            Some(other) => return Err(bad("hash_ids", format!("must be a list, not {other}"))),
        };
        let expected = input.div_ceil(MOONCAKE_BLOCK_TOKENS) as usize;
        if blocks.len() != expected {
            return Err(bad(
                "hash_ids",
                format!(
                    "holds {} ids where input_length {input} needs {expected} (one per \
                     {MOONCAKE_BLOCK_TOKENS} tokens)",
                    blocks.len()
                ),
            ));
        }
        check_order(&requests, at, || {
            bad("timestamp", "goes back in time".into())
        })?;
        requests.push(TraceRequest {
            at,
            input,
            output,
            blocks,
        });
    }
    Ok(requests)
}

/// One row of Azure's CSV.
#[derive(serde::Deserialize)]
struct AzureRow {
    #[serde(rename = "TIMESTAMP")]
    timestamp: String,
    #[serde(rename = "ContextTokens")]
    context: u32,
    #[serde(rename = "GeneratedTokens")]
    generated: u32,
}

/// Checks every row of an Azure CSV trace (`TIMESTAMP,ContextTokens,GeneratedTokens`).
fn azure(path: &Path, text: &str) -> Result<Vec<TraceRequest>, TraceError> {
    const FIELDS: [&str; 3] = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"];
    let mut reader = csv::Reader::from_reader(text.as_bytes());
    let header = (reader.headers().cloned()).map_err(|err| file_error(path, &err.to_string()))?;
    if header.iter().ne(FIELDS) {
        let problem = format!("the header must be {}", FIELDS.join(","));
        return Err(line_error(path, 1, "header", problem));
    }
    let mut requests: Vec<TraceRequest> = Vec::new();
    let mut start = None;
    for record in reader.records() {
        let at_line = |err: &csv::Error| err.position().map_or(0, |p| p.line() as usize);
        let record = record.map_err(|err| {
            line_error(path, at_line(&err), "line", format!("does not fit: {err}"))
        })?;
        let line = record.position().map_or(0, |p| p.line() as usize);
        let bad = |field: &str, problem: String| line_error(path, line, field, problem);
        let row: AzureRow = record.deserialize(Some(&header)).map_err(|err| {
            let field = match err.kind() {
                csv::ErrorKind::Deserialize { err, .. } => err.field(),
                _ => None,
            };
            let field = field
                .and_then(|f| FIELDS.get(f as usize))
                .unwrap_or(&"line");
            bad(field, format!("does not fit: {err}"))
        })?;
        let time: jiff::civil::DateTime = (row.timestamp.parse())
            .map_err(|err| bad("TIMESTAMP", format!("is not a date and time: {err}")))?;
        let start = *start.get_or_insert(time);
        let at = (time.duration_since(start).try_into())
            .map_err(|_| bad("TIMESTAMP", "goes back in time".into()))?;
        for (field, count) in [
            ("ContextTokens", row.context),
            ("GeneratedTokens", row.generated),
        ] {
            if count == 0 {
                return Err(bad(field, "must be at least 1".into()));
            }
        }
        check_order(&requests, at, || {
            bad("TIMESTAMP", "goes back in time".into())
        })?;
        requests.push(TraceRequest {
            at,
            input: row.context,
            output: row.generated,
            blocks: Vec::new(),
        });
    }
    Ok(requests)
}

fn line_error(path: &Path, line: usize, field: &str, problem: String) -> TraceError {
    TraceError::Line {
        file: path.to_path_buf(),
        line,
        field: field.to_owned(),
        problem,
    }
}

/// Arrivals never decrease: an open-loop replay sends in the trace's order.
fn check_order(
    requests: &[TraceRequest],
    at: Duration,
    bad: impl FnOnce() -> TraceError,
) -> Result<(), TraceError> {
    match requests.last() {
        Some(last) if last.at > at => Err(bad()),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What reading `text` as a trace named `name` says.
    fn read(name: &str, text: &str) -> Result<Trace, String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        Trace::read(&path).map_err(|err| {
            let shown = err.to_string();
            shown.replace(&dir.path().display().to_string(), "DIR")
        })
    }

    const GOOD: &str =
        r#"{"timestamp": 0, "input_length": 600, "output_length": 9, "hash_ids": [0, 1]}"#;

    #[test]
    fn a_mooncake_trace_is_read_with_its_blocks() {
        let text = format!("{GOOD}\n{{\"timestamp\": 1500, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [0], \"extra\": true}}\n");
        let trace = read("t.jsonl", &text).unwrap();
        assert_eq!(trace.name, "t.jsonl");
        assert_eq!(trace.requests.len(), 2);
        assert_eq!(trace.requests[1].at, Duration::from_millis(1500));
        assert_eq!(trace.requests[0].blocks, [0, 1]);
        assert!(trace.has_blocks());
        let window = trace.window(Duration::from_secs(1), None);
        assert_eq!(window.requests.len(), 1);
        assert_eq!(window.requests[0].at, Duration::from_millis(500));
    }

    #[test]
    fn two_traces_join_into_one_whose_second_part_shares_no_block() {
        let text = format!("{GOOD}\n{{\"timestamp\": 2000, \"input_length\": 512, \"output_length\": 3, \"hash_ids\": [0]}}\n");
        let first = read("a.jsonl", &text).unwrap();
        let second = read("b.jsonl", &text).unwrap().sped(2.0);
        assert_eq!(second.requests[1].at, Duration::from_secs(1));
        let joined = first.then(&second, Duration::from_secs(10)).unwrap();
        assert_eq!(joined.name, "a.jsonl then b.jsonl");
        let arrivals: Vec<u64> = (joined.requests.iter())
            .map(|r| r.at.as_millis() as u64)
            .collect();
        assert_eq!(arrivals, [0, 2000, 10_000, 11_000]);
        let blocks: Vec<&[u64]> = joined.requests.iter().map(|r| &r.blocks[..]).collect();
        assert_eq!(blocks, [&[0, 1][..], &[0], &[2, 3], &[2]]);
        let mut other = second.clone();
        other.block_tokens = 16;
        let refused = first.then(&other, Duration::ZERO).unwrap_err();
        assert!(
            refused.contains("different tokens (512 and 16)"),
            "{refused}"
        );
    }

    #[test]
    fn a_bad_mooncake_line_names_its_line_and_field() {
        let cases = [
            ("not json", "DIR/t.jsonl:2: `line` is not a JSON object"),
            (
                r#"{"input_length": 1, "output_length": 1, "hash_ids": [0]}"#,
                "DIR/t.jsonl:2: `timestamp` is missing",
            ),
            (
                r#"{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [0]}"#,
                "DIR/t.jsonl:2: `timestamp` must be a whole number >= 0, not -1",
            ),
            (
                r#"{"timestamp": 5, "input_length": 0, "output_length": 1, "hash_ids": []}"#,
                "DIR/t.jsonl:2: `input_length` must be from 1 to",
            ),
            (
                r#"{"timestamp": 5, "input_length": 1, "hash_ids": [0]}"#,
                "DIR/t.jsonl:2: `output_length` is missing",
            ),
            (
                r#"{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": "0"}"#,
                "DIR/t.jsonl:2: `hash_ids` must be a list",
            ),
            (
                r#"{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [-3]}"#,
                "DIR/t.jsonl:2: `hash_ids` must hold whole numbers >= 0",
            ),
            (
                r#"{"timestamp": 5, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1]}"#,
                "DIR/t.jsonl:2: `hash_ids` holds 2 ids where input_length 1025 needs 3",
            ),
        ];
        for (line, expected) in cases {
            let err = read("t.jsonl", &format!("{GOOD}\n{line}\n")).unwrap_err();
            assert!(err.starts_with(expected), "{line}: {err}");
        }
        let late = r#"{"timestamp": 10, "input_length": 1, "output_length": 1, "hash_ids": [0]}"#;
        let early = r#"{"timestamp": 9, "input_length": 1, "output_length": 1, "hash_ids": [0]}"#;
        let err = read("t.jsonl", &format!("{late}\n{early}\n")).unwrap_err();
        assert_eq!(err, "DIR/t.jsonl:2: `timestamp` goes back in time");
    }

    #[test]
    fn an_azure_trace_is_read_from_its_times() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                    2023-11-16 18:15:46.6805900,374,44\n\
                    2023-11-16 18:15:50.9951690,396,109";
        let trace = read("a.csv", text).unwrap();
        assert_eq!(trace.requests.len(), 2);
        assert_eq!(trace.requests[1].at, Duration::from_nanos(4_314_579_000));
        assert_eq!(
            (trace.requests[1].input, trace.requests[1].output),
            (396, 109)
        );
        assert!(!trace.has_blocks());
    }

    #[test]
    fn a_bad_azure_row_names_its_line_and_field() {
        let header =
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n";
        let cases = [
            (
                "2023-11-16 18:15:47.0,many,44",
                "DIR/a.csv:3: `ContextTokens` does not fit",
            ),
            (
                "2023-11-16 18:15:47.0,4,-1",
                "DIR/a.csv:3: `GeneratedTokens` does not fit",
            ),
            (
                "2023-11-16 18:15:47.0,4",
                "DIR/a.csv:3: `line` does not fit",
            ),
            (
                "yesterday,4,4",
                "DIR/a.csv:3: `TIMESTAMP` is not a date and time",
            ),
            (
                "2023-11-16 18:15:47.0,0,4",
                "DIR/a.csv:3: `ContextTokens` must be at least 1",
            ),
            (
                "2023-11-16 18:15:40.0,4,4",
                "DIR/a.csv:3: `TIMESTAMP` goes back in time",
            ),
        ];
        for (row, expected) in cases {
            let err = read("a.csv", &format!("{header}{row}\n")).unwrap_err();
            assert!(err.starts_with(expected), "{row}: {err}");
        }
        let err = read("a.csv", "time,in,out\n1,2,3\n").unwrap_err();
        assert!(
            err.starts_with("DIR/a.csv:1: `header` the header must be"),
            "{err}"
        );
    }

    #[test]
    fn an_unknown_or_empty_trace_is_refused() {
        assert_eq!(
            read("t.txt", GOOD).unwrap_err(),
            "DIR/t.txt: not a Mooncake .jsonl or an Azure .csv trace"
        );
        assert_eq!(
            read("t.jsonl", "\n").unwrap_err(),
            "DIR/t.jsonl: holds no requests"
        );
    }
}
