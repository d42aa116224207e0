//! `examples/release.sh` as a release is made, on the binaries `cargo test --workspace` built:
//! the archive's binaries run, are stripped and point at their debug info, which the debug
//! archive holds; the checksums check. And `cargo install --locked`, the other way onto a host.

use std::path::{Path, PathBuf};
use std::process::Command;

fn run(command: &mut Command) -> String {
    let done = command.output().expect("run the command");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&done.stdout),
        String::from_utf8_lossy(&done.stderr)
    );
    assert!(done.status.success(), "{command:?}: {said}");
    said
}

/// The section names of the ELF file `path`.
fn sections(path: &Path) -> String {
    run(Command::new("readelf").arg("-S").arg("-W").arg(path))
}

#[test]
fn release_archives_hold_stripped_binaries_their_symbols_apart_and_checksums() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let bin_dir = PathBuf::from(env!("CARGO_BIN_EXE_pd-cluster"))
        .parent()
        .unwrap()
        .to_path_buf();
    let out = tempfile::tempdir().unwrap();
    run(Command::new("bash")
        .arg(root.join("examples/release.sh"))
        .arg("--bin-dir")
        .arg(&bin_dir)
        .arg("--out")
        .arg(out.path()));
    run(Command::new("sha256sum")
        .args(["-c", "SHA256SUMS"])
        .current_dir(out.path()));
    let archives: Vec<String> = std::fs::read_dir(out.path())
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".tar.gz"))
        .collect();
    assert_eq!(archives.len(), 2, "{archives:?}");
    for archive in &archives {
        run(Command::new("tar")
            .arg("-xzf")
            .arg(archive)
            .current_dir(out.path()));
    }
    let release = archives.iter().find(|a| !a.contains("-debug")).unwrap();
    let folder = out.path().join(release.trim_end_matches(".tar.gz"));
    let debug = out.path().join(format!("{}-debug", folder.display()));
    assert!(folder.join("docs").exists() || folder.join("compatibility.md").exists());
    for binary in ["bootstrap-server", "pd-proxy", "pd-epp", "worker-client"] {
        let shipped = folder.join("bin").join(binary);
        let version = run(Command::new(&shipped).arg("--version"));
        assert!(
            version.contains(env!("CARGO_PKG_VERSION")),
            "{binary}: {version}"
        );
        let shipped_sections = sections(&shipped);
        assert!(
            !shipped_sections.contains(".symtab"),
            "{binary} is not stripped"
        );
        assert!(
            shipped_sections.contains(".gnu_debuglink"),
            "{binary}: no debug link"
        );
        let symbols = debug.join("bin").join(format!("{binary}.debug"));
        assert!(
            sections(&symbols).contains(".debug_line"),
            "{binary}: no debug info"
        );
        let original = std::fs::metadata(bin_dir.join(binary)).unwrap().len();
        let stripped = std::fs::metadata(&shipped).unwrap().len();
        // Symbols and line tables out: well under the built size.
        assert!(
            stripped * 10 < original * 7,
            "{binary}: {stripped} of {original} bytes"
        );
    }
}

/// `cargo install --locked --path worker-client`, as the deployment guide gives it, into a
/// folder of its own (its own target folder too: this test runs inside `cargo test`, whose
/// target folder it must not wait for). `--debug` keeps the build short; the profile is not what
/// is checked, the lock file and the package's install are.
#[test]
fn cargo_install_puts_a_working_binary_where_asked() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let install = tempfile::tempdir().unwrap();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    run(Command::new(cargo)
        .args([
            "install",
            "--locked",
            "--debug",
            "--path",
            "worker-client",
            "--root",
        ])
        .arg(install.path())
        .env("CARGO_TARGET_DIR", root.join("target/install-check"))
        .current_dir(root));
    let installed = install.path().join("bin/worker-client");
    let version = run(Command::new(&installed).arg("--version"));
    assert!(version.contains(env!("CARGO_PKG_VERSION")), "{version}");
}
