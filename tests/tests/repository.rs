//! The repository itself: a run's output is never committed. A tracked Parquet
//! file or commit record would be read by every collector started on a checkout
//! (`make demo` once began with "recovered durable watermarks" from one). And the
//! Python package's lock file agrees with the workspace's, so that the two builds
//! that share `target/` compile each dependency once.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

/// Whether `path` (as `git ls-files` prints it) is a run's output: a Parquet file,
/// a commit record, anything under the default output directory, or a spill
/// segment.
fn is_run_output(path: &str) -> bool {
    path.ends_with(".parquet")
        || path.ends_with(".parquet.tmp")
        || path.contains("_rankscope/commits/")
        || path.starts_with("rankscope-out/")
        || path.ends_with(".rsq")
}

#[test]
fn recognises_run_output() {
    for output in [
        "rankscope-out/steps/run_id=r/part-1-0.parquet",
        "elsewhere/layers/run_id=r/part-2-0.parquet",
        "out/_rankscope/commits/0000000001.json",
        "rankscope-out/README",
        "spill/run/rank-0/seg-0000000001.rsq",
    ] {
        assert!(is_run_output(output), "{output}");
    }
    for source in ["collector/src/store.rs", "docs/columns.md", "Cargo.lock"] {
        assert!(!is_run_output(source), "{source}");
    }
}

#[test]
fn no_run_output_is_tracked_by_git() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let listed = Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(&root)
        .output();
    let listed = match listed {
        Ok(out) if out.status.success() => out.stdout,
        // A source archive, or no git: nothing is tracked, so nothing to check.
        other => {
            eprintln!("not a git checkout, skipped: {other:?}");
            return;
        }
    };
    let tracked: Vec<String> = listed
        .split(|&b| b == 0)
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .filter(|p| is_run_output(p))
        .collect();
    assert!(
        tracked.is_empty(),
        "a run's output is tracked by git; remove it with `git rm -r --cached PATH` (the files stay on disk, .gitignore keeps them out): {tracked:?}"
    );
}

/// Every package's versions in a `Cargo.lock`, read line by line (the format
/// writes `name` and then `version` for each `[[package]]`).
fn locked_versions(lock: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut versions: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut name = None;
    for line in lock.lines() {
        if let Some(n) = line.strip_prefix("name = ") {
            name = Some(n.trim_matches('"').to_string());
        } else if let (Some(v), Some(n)) = (line.strip_prefix("version = "), name.take()) {
            versions
                .entry(n)
                .or_default()
                .insert(v.trim_matches('"').to_string());
        }
    }
    versions
}

#[test]
fn the_python_package_locks_the_workspaces_versions() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let read = |path: &str| {
        std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
    };
    let workspace = locked_versions(&read("Cargo.lock"));
    let python = locked_versions(&read("agent/python/Cargo.lock"));
    assert!(
        python.contains_key("tokio") && python.contains_key("pyo3"),
        "{python:?}"
    );
    let differ: Vec<_> = python
        .iter()
        .filter_map(|(name, versions)| {
            let ours = workspace.get(name)?;
            (!versions.is_subset(ours)).then(|| format!("{name}: {versions:?} vs {ours:?}"))
        })
        .collect();
    assert!(
        differ.is_empty(),
        "agent/python/Cargo.lock resolves other versions than Cargo.lock, so `make python` \
         compiles them again; run `cargo update -p NAME --precise VERSION` in agent/python: {differ:?}"
    );
}
