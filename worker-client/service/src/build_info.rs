//! What a scrape tells of the binary serving it: a gauge `NAME{version, commit} 1`, so that a
//! dashboard or an alert can say which build runs where. The commit is the one the release
//! script builds (`PD_BUILD_COMMIT` at compile time), `unknown` for other builds.

use prometheus::{IntGaugeVec, Opts, Registry};

/// The version every binary of the workspace carries.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The commit the binary was built from, or `unknown`.
pub const COMMIT: &str = match option_env!("PD_BUILD_COMMIT") {
    Some(commit) => commit,
    None => "unknown",
};

/// Registers `name` (e.g. `build_info` in a registry that prefixes it) in `registry`, set to
/// 1 with the version and commit as labels.
pub fn register(registry: &Registry, name: &str) -> prometheus::Result<()> {
    let gauge = IntGaugeVec::new(
        Opts::new(name, "The build serving: its version and commit (always 1)"),
        &["version", "commit"],
    )?;
    gauge.with_label_values(&[VERSION, COMMIT]).set(1);
    registry.register(Box::new(gauge))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gauge_names_the_build() {
        let registry = Registry::new();
        register(&registry, "test_build_info").unwrap();
        let mut text = Vec::new();
        prometheus::Encoder::encode(
            &prometheus::TextEncoder::new(),
            &registry.gather(),
            &mut text,
        )
        .unwrap();
        let text = String::from_utf8(text).unwrap();
        let line = format!("test_build_info{{commit=\"{COMMIT}\",version=\"{VERSION}\"}} 1");
        assert!(text.contains(&line), "{text}");
    }
}
