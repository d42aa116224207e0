//! Checking a shipped dashboard against the metrics a process really exports: the names a
//! dashboard queries ([`named_metrics`]) must each be in the process's Prometheus text
//! ([`exports_metric`]), or the panel would stay empty after a rename.

/// Every distinct metric name starting with `prefix` that `text` mentions (a Grafana
/// dashboard's queries, an alert file), sorted.
pub fn named_metrics<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
    let mut names: Vec<&str> = text
        .match_indices(prefix)
        .map(|(at, _)| {
            let rest = &text[at..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            &rest[..end]
        })
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// Whether `rendered` (Prometheus text) has a sample of `name`, with labels or without; a
/// histogram counts by its own name too (its samples are `NAME_bucket`, `NAME_sum` and
/// `NAME_count`).
pub fn exports_metric(rendered: &str, name: &str) -> bool {
    [
        format!("\n{name}{{"),
        format!("\n{name} "),
        format!("\n{name}_bucket{{"),
    ]
    .iter()
    .any(|sample| rendered.contains(sample.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_found_and_checked() {
        let dashboard = r#"{"expr": "rate(app_calls_total{x=\"1\"}[1m]) / app_up", "other": "app_calls_total"}"#;
        assert_eq!(
            named_metrics(dashboard, "app_"),
            ["app_calls_total", "app_up"]
        );
        let rendered = "# HELP app_up up\napp_up 1\napp_calls_total{x=\"1\"} 3\n\
                        app_wait_seconds_bucket{le=\"1\"} 2\napp_wait_seconds_count 2\n";
        assert!(exports_metric(rendered, "app_up"));
        assert!(exports_metric(rendered, "app_calls_total"));
        assert!(exports_metric(rendered, "app_wait_seconds"));
        assert!(exports_metric(rendered, "app_wait_seconds_count"));
        assert!(!exports_metric(rendered, "app_calls"));
        assert!(!exports_metric(rendered, "app_wait"));
    }
}
