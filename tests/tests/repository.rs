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
    let python = locked_versions(&read("python/Cargo.lock"));
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
        "python/Cargo.lock resolves other versions than Cargo.lock, so `make python` \
         compiles them again; run `cargo update -p NAME --precise VERSION` in python: {differ:?}"
    );
}

/// The features each package resolves to in one build, from `cargo tree`: the
/// dependencies compiled for the target (normal ones, and dev ones with `dev`).
/// Build scripts' and proc macros' dependencies are compiled for the host with
/// features of their own; they are left out, as `cargo tree` does not mark
/// which copy a line is.
fn resolved_features(dir: &Path, args: &[&str], dev: bool) -> BTreeMap<String, BTreeSet<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let edges = if dev {
        "normal,dev,no-proc-macro"
    } else {
        "normal,no-proc-macro"
    };
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "--prefix",
            "none",
            "-f",
            "{p}|{f}",
            "-e",
            edges,
        ])
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree {args:?} in {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut resolved: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some((package, features)) = line.replace(" (*)", "").split_once('|').map(|(p, f)| {
            let name_version = p.split_whitespace().take(2).collect::<Vec<_>>().join(" ");
            (name_version, f.to_string())
        }) else {
            continue;
        };
        let entry = resolved.entry(package).or_default();
        entry.extend(
            features
                .split(',')
                .map(str::trim)
                .filter(|f| !f.is_empty())
                .map(String::from),
        );
    }
    resolved
}

/// Packages whose features differ between two builds, leaving out ours (the
/// agent and the command differ on purpose: `torch`).
fn feature_differences(
    a: &BTreeMap<String, BTreeSet<String>>,
    b: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<String> {
    a.iter()
        .filter(|(package, _)| !package.starts_with("rankscope"))
        .filter_map(|(package, features)| {
            let other = b.get(package)?;
            (features != other).then(|| {
                let only_a: Vec<_> = features.difference(other).collect();
                let only_b: Vec<_> = other.difference(features).collect();
                format!("{package}: {only_a:?} in the first only, {only_b:?} in the second only")
            })
        })
        .collect()
}

/// `make python` builds the command without libtorch and then the extension,
/// `make test` both and then the workspace, all into one `target/`: a shared
/// dependency resolved with other features in one of them is compiled twice
/// (with everything above it). The feature-unification lines in cli/Cargo.toml
/// and python/Cargo.toml keep them equal.
#[test]
fn the_command_the_extension_and_the_workspace_share_their_dependencies_features() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let command = resolved_features(
        &root,
        &[
            "-p",
            "rankscope",
            "--no-default-features",
            "--features",
            "delta",
        ],
        false,
    );
    let extension = resolved_features(&root.join("python"), &[], false);
    let workspace = resolved_features(&root, &["--workspace"], true);
    let fix = "add the features to the feature-unification lines of cli/Cargo.toml (what \
               libtorch's crates turn on) or python/Cargo.toml (what the command's crates turn on)";
    let differ = feature_differences(&command, &extension);
    assert!(
        differ.is_empty(),
        "the command and the extension resolve shared dependencies differently; {fix}: {differ:#?}"
    );
    let differ = feature_differences(&command, &workspace);
    assert!(
        differ.is_empty(),
        "the command and the workspace resolve shared dependencies differently; {fix}: {differ:#?}"
    );
    // The parse found the trees (an empty parse would compare nothing).
    assert!(
        command.keys().any(|p| p.starts_with("datafusion v"))
            && extension.keys().any(|p| p.starts_with("pyo3 v"))
            && workspace.keys().any(|p| p.starts_with("tch v")),
        "cargo tree printed no packages"
    );
    // The extension links no libtorch: one wheel for every supported torch.
    let linked: Vec<_> = extension
        .keys()
        .filter(|p| p.starts_with("tch v") || p.starts_with("torch-sys v"))
        .collect();
    assert!(
        linked.is_empty(),
        "the Python extension depends on {linked:?}"
    );
}
