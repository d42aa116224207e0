//! What a `pd-bench` run produces: the Markdown report, every section's rows as JSON, and a
//! chart of each section that has one (SVG), written side by side with `--out`.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::report::{self, Row};
use super::routing::{self, RoutingRow, Scenario};

/// The report being built.
#[derive(Debug, Default)]
pub struct Output {
    markdown: String,
    sections: Map<String, Value>,
    charts: Vec<(String, String)>,
}

impl Output {
    /// A report starting with `text`.
    pub fn new(text: &str) -> Self {
        Output {
            markdown: text.to_owned(),
            ..Output::default()
        }
    }

    /// Appends Markdown (a section without rows to chart).
    pub fn text(&mut self, markdown: &str) {
        self.markdown.push_str(markdown);
    }

    /// A section of load-generator rows: their table, their JSON under `name`, and a chart of
    /// requests per second titled `title`.
    pub fn rows(&mut self, name: &str, title: &str, rows: &[Row]) -> Result<(), String> {
        self.markdown.push_str(&report::table(rows));
        self.sections.insert(name.to_owned(), json(rows)?);
        self.charts
            .push((name.to_owned(), report::chart(title, rows)?));
        Ok(())
    }

    /// A routing scenario's section: its table, its JSON, its TTFT and hit-rate charts.
    pub fn routing(&mut self, scenario: &Scenario, rows: &[RoutingRow]) -> Result<(), String> {
        let charts = routing::charts(scenario, rows)?;
        let charts = charts
            .iter()
            .map(|(name, svg)| (name.as_str(), svg.clone()));
        self.section(
            scenario.chart,
            &routing::table(rows),
            rows,
            charts.collect(),
        )
    }

    /// Any section: its Markdown, its rows as JSON under `name`, and its charts by name.
    pub fn section<T: serde::Serialize>(
        &mut self,
        name: &str,
        markdown: &str,
        rows: &[T],
        charts: Vec<(&str, String)>,
    ) -> Result<(), String> {
        self.markdown.push_str(markdown);
        self.sections.insert(name.to_owned(), json(rows)?);
        for (chart, svg) in charts {
            self.charts.push((chart.to_owned(), svg));
        }
        Ok(())
    }

    /// The Markdown report.
    pub fn markdown(&self) -> &str {
        &self.markdown
    }

    /// Writes the report to `path`, the rows to `path` with a `.json` extension, and each chart
    /// to `<stem>-<section>.svg` beside it; returns the files written.
    pub fn write(&self, path: &Path) -> Result<Vec<PathBuf>, String> {
        let mut written = vec![path.to_path_buf()];
        write(path, self.markdown.as_bytes())?;
        let json_path = path.with_extension("json");
        let rows = serde_json::to_vec_pretty(&self.sections).map_err(|e| e.to_string())?;
        write(&json_path, &rows)?;
        written.push(json_path);
        let stem = path
            .file_stem()
            .map_or_else(|| "results".into(), |s| s.to_string_lossy().into_owned());
        for (name, svg) in &self.charts {
            let chart = path.with_file_name(format!("{stem}-{name}.svg"));
            write(&chart, svg.as_bytes())?;
            written.push(chart);
        }
        Ok(written)
    }
}

fn json<T: serde::Serialize>(rows: &[T]) -> Result<Value, String> {
    serde_json::to_value(rows).map_err(|e| e.to_string())
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), String> {
    std::fs::write(path, bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))
}
