//! Checking a shipped dashboard against the metrics a process really exports: every name a
//! dashboard queries must be in the process's Prometheus text, or its panel would stay empty
//! after a rename ([`check_dashboard`]).

/// Checks that every metric `dashboard` names under `prefix` is in `rendered` (a process's
/// Prometheus text): how many names were checked, or the ones missing.
pub fn check_dashboard<'a>(
    dashboard: &'a str,
    prefix: &str,
    rendered: &str,
) -> Result<usize, Vec<&'a str>> {
    let named = named_metrics(dashboard, prefix);
    let missing: Vec<&str> = named
        .iter()
        .copied()
        .filter(|name| !exports_metric(rendered, name))
        .collect();
    if missing.is_empty() {
        Ok(named.len())
    } else {
        Err(missing)
    }
}

/// Every distinct metric name starting with `prefix` that `text` mentions (a Grafana
/// dashboard's queries, an alert file), sorted.
fn named_metrics<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
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
fn exports_metric(rendered: &str, name: &str) -> bool {
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
        assert_eq!(check_dashboard(dashboard, "app_", rendered), Ok(2));
        assert_eq!(
            check_dashboard("app_up app_gone", "app_", rendered),
            Err(vec!["app_gone"])
        );
    }
}
