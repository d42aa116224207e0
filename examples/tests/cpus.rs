//! `pd-bench --proxy-cpus`'s CPU split as a benchmark uses it: after the split every process
//! started through `pd_examples::process` runs on the last CPUs and the calling thread on the
//! others. A test binary of its own, since the split pins the thread that calls it.

use std::path::Path;

use pd_examples::cpus;
use pd_examples::process::spawn;

/// The CPUs of a `Cpus_allowed_list:` line of `/proc/.../status` ("1", "0,2-3").
fn allowed_cpus(status_file: &str) -> Vec<usize> {
    let status = std::fs::read_to_string(status_file).expect("read the status file");
    let list = status
        .lines()
        .find_map(|line| line.strip_prefix("Cpus_allowed_list:"))
        .expect("a Cpus_allowed_list line")
        .trim();
    list.split(',')
        .flat_map(|part| {
            let (first, last) = part.split_once('-').unwrap_or((part, part));
            let (first, last): (usize, usize) = (first.parse().unwrap(), last.parse().unwrap());
            first..=last
        })
        .collect()
}

#[tokio::test(flavor = "current_thread")]
async fn processes_started_after_a_split_run_on_the_other_cpus() {
    let before = allowed_cpus("/proc/thread-self/status");
    if before.len() < 2 {
        eprintln!("skipped: this test needs two CPUs, it may use {before:?}");
        return;
    }
    // More CPUs than there are, or none, for the systems: refused, nothing pinned.
    assert!(cpus::split(Some(before.len())).is_err());
    assert!(cpus::split(Some(0)).is_err());
    assert_eq!(allowed_cpus("/proc/thread-self/status"), before);

    let split = cpus::split(Some(1)).expect("split the CPUs");
    assert_eq!(split.own, before[..before.len() - 1]);
    assert_eq!(split.children, [before[before.len() - 1]]);
    assert_eq!(allowed_cpus("/proc/thread-self/status"), split.own);

    let dir = tempfile::tempdir().expect("a run folder");
    let mut sleeper = spawn(
        dir.path(),
        "sleeper",
        Path::new("/bin/sleep"),
        &["30".to_owned()],
        String::new(),
    )
    .expect("start a process");
    let pid = sleeper.pid().expect("it runs");
    // spawn() returns once the program is executing, so the child's CPUs are set by now.
    assert_eq!(allowed_cpus(&format!("/proc/{pid}/status")), split.children);
    sleeper.kill().await;
}
