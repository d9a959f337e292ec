//! Sharded collectors: two collectors split a run's ranks (rank r goes to entry
//! r % 2 of the collector list), one is SIGKILLed and restarted on the same port
//! mid-run, and the dataset is still exact, read with one DuckDB glob, whether the
//! two write separate folders or share one.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rankscope_tests::{
    CollectorProc, bin, count, count_by_rank, duckdb, free_port, random_ms, table, walk,
};

const RANKS: u32 = 8;
const STEPS: u64 = 400;
const LAYERS: u64 = 3;
const ARGS: [&str; 2] = ["--max-file-age", "150ms"];

/// Waits until `out` holds a committed `steps` file.
fn wait_for_data(out: &Path) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        let committed = walk(&out.join("steps"))
            .iter()
            .any(|p| p.extension().is_some_and(|e| e == "parquet"));
        if committed {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("no data reached {} within 60 s", out.display());
}

/// Runs 8 loadgen ranks against two collectors writing `outs[0]` and `outs[1]`,
/// SIGKILLs the second mid-run and restarts it on the same port and folder.
fn run_with_a_crash(outs: [&Path; 2]) {
    let listen: Vec<String> = (0..2)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let first = CollectorProc::start_on(&listen[0], outs[0], &ARGS);
    let second = CollectorProc::start_on(&listen[1], outs[1], &ARGS);
    let mut loadgen = Command::new(bin("rankscope"))
        .args(["loadgen", "--run-id", "sharded", "--step-interval", "5ms"])
        .args(["--finish-timeout", "60s", "--collector", &listen.join(",")])
        .args(["--ranks", &RANKS.to_string(), "--steps", &STEPS.to_string()])
        .args(["--layers", &LAYERS.to_string()])
        .env("RANKSCOPE_LOG", "error")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_data(outs[1]);
    let pause_ms = random_ms(100, 600);
    eprintln!("killing the second collector after {pause_ms} ms more");
    std::thread::sleep(Duration::from_millis(pause_ms));
    assert!(
        loadgen.try_wait().unwrap().is_none(),
        "the run is still going when the collector dies"
    );
    second.kill();
    std::thread::sleep(Duration::from_millis(random_ms(50, 400)));
    let second = CollectorProc::start_on(&listen[1], outs[1], &ARGS);
    assert!(
        loadgen.wait().unwrap().success(),
        "every row was acknowledged after the restart"
    );
    assert!(first.stop());
    assert!(second.stop());
}

/// Exact counts per rank and no duplicates in the dataset under `root`.
fn assert_exact(root: &Path) {
    let per_rank = |n: u64| (0..RANKS).map(|r| (r, n)).collect::<Vec<_>>();
    assert_eq!(count_by_rank(root, "steps"), per_rank(STEPS));
    assert_eq!(count_by_rank(root, "layers"), per_rank(STEPS * LAYERS));
    assert_eq!(count_by_rank(root, "model"), per_rank(LAYERS));
    assert_eq!(count_by_rank(root, "ranks"), per_rank(1));
    assert_eq!(
        count(root, "ranks", "finished_at is not null"),
        RANKS as u64
    );
    assert_eq!(count(root, "runs", ""), 1);
    for (name, key) in [("steps", "rank, step"), ("layers", "rank, step, layer")] {
        let dups = duckdb(&format!(
            "select count(*) from (select {key} from {} group by all having count(*) > 1)",
            table(root, name)
        ));
        assert_eq!(dups.trim(), "0", "duplicates in {name}");
    }
}

/// Recovered: no temporary file left, and no collector lock left once all stopped
/// (the killed collector's was removed by the recovery after it).
fn assert_recovered(out: &Path) {
    let files = walk(out);
    let leftovers: Vec<_> = files
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "tmp" || e == "lock"))
        .collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
}

/// The epochs (collector starts) named by the commit records of `out`.
fn commit_epochs(out: &Path) -> std::collections::BTreeSet<String> {
    walk(&out.join("_rankscope/commits"))
        .iter()
        .filter_map(|p| {
            p.file_name()?
                .to_str()?
                .split('-')
                .next()
                .map(str::to_string)
        })
        .collect()
}

#[test]
fn two_collectors_in_separate_folders_one_killed_read_with_one_glob() {
    let dir = tempfile::tempdir().unwrap();
    let outs = [dir.path().join("shard-0"), dir.path().join("shard-1")];
    run_with_a_crash([&outs[0], &outs[1]]);
    // One glob over both folders reads the whole run.
    assert_exact(&dir.path().join("shard-*"));
    for (i, out) in outs.iter().enumerate() {
        assert_recovered(out);
        // Each collector holds exactly its ranks: r % 2.
        let ranks: Vec<u32> = count_by_rank(out, "steps")
            .iter()
            .map(|(r, _)| *r)
            .collect();
        let expected: Vec<u32> = (0..RANKS).filter(|r| *r as usize % 2 == i).collect();
        assert_eq!(ranks, expected, "ranks in {}", out.display());
    }
    assert_eq!(
        commit_epochs(&outs[1]).len(),
        2,
        "the killed collector and its restart"
    );
}

#[test]
fn two_collectors_sharing_one_folder_one_killed() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    run_with_a_crash([&out, &out]);
    assert_exact(&out);
    assert_recovered(&out);
    // Three collector starts, each naming its own commits.
    assert_eq!(commit_epochs(&out).len(), 3);
}

#[test]
fn a_bad_collector_list_is_refused_with_the_fix() {
    for (list, expected) in [
        ("127.0.0.1:1,,127.0.0.1:2", "entry 2 is empty"),
        (
            "127.0.0.1:1,127.0.0.1",
            "\"127.0.0.1\" is not a collector address (no port)",
        ),
        (
            "https://127.0.0.1:1,127.0.0.1:2",
            "write https:// on every address or on none",
        ),
    ] {
        let output = Command::new(bin("rankscope"))
            .args([
                "loadgen",
                "--ranks",
                "2",
                "--steps",
                "1",
                "--collector",
                list,
            ])
            .output()
            .unwrap();
        assert!(!output.status.success(), "{list} is refused");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("--collector="), "{list}: {stderr}");
        assert!(stderr.contains(expected), "{list}: {stderr}");
    }
}
