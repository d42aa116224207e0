//! docs/architecture.md is the map of the code: every module of the crates it maps is named in
//! that crate's section (a file by its name, a folder of modules by `name/`), so a module added
//! without a place on the map fails here.

use std::path::{Path, PathBuf};

/// Each mapped crate's source folder (from the repository's root) and its section's heading.
const CRATES: &[(&str, &str)] = &[
    ("bootstrap-server/src", "## bootstrap-server"),
    ("proxy/router/src", "## pd-router"),
    ("proxy/src", "## pd-proxy"),
    ("proxy/epp/src", "## pd-epp"),
    ("proxy/epp/conformance/src", "## pd-epp"),
    ("worker-client/src", "## worker-client"),
    ("worker-client/python/src", "## worker-client"),
    ("examples/src", "## examples (pd-examples)"),
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The text of `heading`'s section: from it to the next `## `.
fn section<'a>(doc: &'a str, heading: &str) -> &'a str {
    let start = doc
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("docs/architecture.md has no section {heading:?}"));
    let rest = &doc[start + heading.len() + 2..];
    &rest[..rest.find("\n## ").unwrap_or(rest.len())]
}

/// The names a map must show for the modules under `dir`: each file's name, each folder's
/// `name/` (its `mod.rs` is the folder's), tests left out.
fn modules(dir: &Path, names: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            names.push(format!("{name}/"));
            modules(&path, names);
        } else if name.ends_with(".rs")
            && !["lib.rs", "main.rs", "mod.rs"].contains(&name.as_str())
            && !name.starts_with("tests")
        {
            names.push(name);
        }
    }
}

/// Whether `text` names `name` as a word of its own (not inside a longer name).
fn names(text: &str, name: &str) -> bool {
    let stem = name.trim_end_matches(".rs").trim_end_matches('/');
    text.match_indices(stem).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + stem.len()..].chars().next();
        let word = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        !word(before) && !word(after)
    })
}

#[test]
fn every_module_is_on_the_map() {
    let doc = std::fs::read_to_string(repo().join("docs/architecture.md")).unwrap();
    let mut missing = Vec::new();
    for (dir, heading) in CRATES {
        let text = section(&doc, heading);
        let mut found = Vec::new();
        modules(&repo().join(dir), &mut found);
        assert!(!found.is_empty(), "{dir} has no modules");
        for name in found {
            if !names(text, &name) {
                missing.push(format!("{dir}: {name} (section {heading:?})"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "not in docs/architecture.md:\n{}",
        missing.join("\n")
    );
}

#[test]
fn a_name_inside_a_longer_one_does_not_count() {
    assert!(names("  flow/    the stages", "flow/"));
    assert!(names("concurrent.rs, sequential.rs", "sequential.rs"));
    assert!(!names("dispatcher.rs", "dispatch/"));
    assert!(!names("kv_events_more", "kv_events/"));
}
