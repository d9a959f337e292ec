//! Chaos with real training ranks: the collector SIGKILLed at random moments of a
//! run, the collector down for a whole run, and a rank SIGKILLed mid-run. Every
//! check reads the Parquet files with the real DuckDB CLI.

use std::path::Path;
use std::time::Duration;

use rankscope_tests::training::{assert_exact, launch, train, wait_for_data, wait_ok};
use rankscope_tests::{CollectorProc, count, duckdb, free_port, random_ms, rankscope, table};

#[test]
fn collector_killed_at_random_moments_of_a_training_run_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let spill = tempfile::tempdir().unwrap();
    let out = dir.path();
    let listen = format!("127.0.0.1:{}", free_port());
    let args = ["--max-file-age", "150ms"];
    let mut collector = CollectorProc::start_on(&listen, out, &args);
    let (ranks, steps) = (2, 300);
    let run = launch(
        ranks,
        &[],
        &train(&listen, "chaos-train", steps, spill.path(), "60s"),
    )
    .spawn()
    .unwrap();
    wait_for_data(out, Duration::from_secs(60));
    for _ in 0..2 {
        let pause = random_ms(50, 600);
        eprintln!("killing the collector after {pause} ms");
        std::thread::sleep(Duration::from_millis(pause));
        collector.kill();
        std::thread::sleep(Duration::from_millis(random_ms(50, 400)));
        collector = CollectorProc::start_on(&listen, out, &args);
    }
    let text = wait_ok(run, "training");
    assert!(!text.contains("telemetry incomplete"), "{text}");
    assert!(collector.stop());
    assert_exact(out, ranks, steps);
}

#[test]
fn collector_down_for_the_whole_run_gets_the_backlog_afterwards() {
    let dir = tempfile::tempdir().unwrap();
    let spill = tempfile::tempdir().unwrap();
    let out = dir.path();
    let listen = format!("127.0.0.1:{}", free_port());
    let (ranks, steps) = (2, 40);
    // Nothing listens: the ranks train, give up after the finish timeout, and
    // leave everything in their spill directories.
    let run = launch(
        ranks,
        &[],
        &train(&listen, "backlog", steps, spill.path(), "1s"),
    )
    .spawn()
    .unwrap();
    let text = wait_ok(run, "training without a collector");
    assert!(text.contains("rankscope replay"), "{text}");
    assert!(spill.path().join("backlog/rank-1").is_dir());

    let collector = CollectorProc::start_on(&listen, out, &["--max-file-age", "150ms"]);
    let spill_arg = spill.path().to_str().unwrap();
    // A mistyped run id names the runs that are there, and sends nothing.
    let wrong = rankscope(&[
        "replay",
        "--spill-dir",
        spill_arg,
        "--run-id",
        "backlg",
        "--collector",
        &listen,
    ]);
    assert!(
        wrong.contains("nothing to replay for run backlg") && wrong.contains("runs there: backlog"),
        "{wrong}"
    );
    let replayed = rankscope(&["replay", "--spill-dir", spill_arg, "--collector", &listen]);
    assert!(
        replayed.contains("replayed 2 rank directories"),
        "{replayed}"
    );
    assert!(
        !spill.path().join("backlog").exists(),
        "delivered spill directories are removed"
    );
    assert!(collector.stop());
    assert_exact(out, ranks, steps);
}

#[test]
fn a_restarted_rank_sends_what_its_earlier_process_left() {
    let dir = tempfile::tempdir().unwrap();
    let spill = tempfile::tempdir().unwrap();
    let out = dir.path();
    let listen = format!("127.0.0.1:{}", free_port());
    // First process: no collector.
    let mut first = train(&listen, "restart", 30, spill.path(), "1s");
    wait_ok(first.spawn().unwrap(), "first process");
    // Second process of the same run and rank, with the collector up.
    let collector = CollectorProc::start_on(&listen, out, &["--max-file-age", "150ms"]);
    wait_ok(
        train(&listen, "restart", 20, spill.path(), "60s")
            .spawn()
            .unwrap(),
        "second process",
    );
    assert!(collector.stop());
    // 30 steps of the first process and 20 of the second, nothing twice.
    assert_eq!(count(out, "steps", ""), 50);
    assert_eq!(count(out, "steps", "step < 20"), 40);
    assert_eq!(count(out, "ranks", "finished_at is not null"), 2);
    assert!(!spill.path().join("restart").exists());
}

#[test]
fn a_rank_killed_mid_run_keeps_what_was_acknowledged_and_shows_unfinished() {
    let dir = tempfile::tempdir().unwrap();
    let spill = tempfile::tempdir().unwrap();
    let out = dir.path();
    let collector = CollectorProc::start(out, &["--max-file-age", "150ms", "--rank-grace", "1s"]);
    let mut rank = train(&collector.addr, "killed", 100_000, spill.path(), "60s");
    rank.env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("LOCAL_RANK", "1")
        .env("LOCAL_WORLD_SIZE", "2");
    let mut child = rank.spawn().unwrap();
    wait_for_data(out, Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(random_ms(100, 800)));
    child.kill().unwrap();
    child.wait().unwrap();
    // Past the grace period the collector records the rank as vanished.
    std::thread::sleep(Duration::from_secs(3));
    assert!(collector.stop());
    let unfinished = duckdb(&format!(
        "select rank, count(*) from {} where finished_at is null group by rank",
        table(out, "ranks")
    ));
    assert_eq!(
        unfinished.trim(),
        "1,1",
        "one unfinished ranks row for rank 1"
    );
    // What is durable is a gap-free prefix of the run.
    let prefix = |out: &Path| -> (u64, u64) {
        let row = duckdb(&format!(
            "select count(*), max(step) + 1 from {}",
            table(out, "steps")
        ));
        let (n, end) = row.trim().split_once(',').unwrap();
        (n.parse().unwrap(), end.parse().unwrap())
    };
    let (n, end) = prefix(out);
    assert!(n > 0);
    assert_eq!(n, end, "steps 0..{end} without gaps");
    // The rest waits in its spill directory; replayed, the prefix only grows.
    let collector = CollectorProc::start(out, &["--max-file-age", "150ms"]);
    let spill_arg = spill.path().to_str().unwrap();
    rankscope(&[
        "replay",
        "--spill-dir",
        spill_arg,
        "--collector",
        &collector.addr,
    ]);
    assert!(collector.stop());
    let (n2, end2) = prefix(out);
    assert_eq!(n2, end2, "still gap-free after the replay");
    assert!(n2 >= n);
    let dups = duckdb(&format!(
        "select count(*) from (select step from {} group by all having count(*) > 1)",
        table(out, "steps")
    ));
    assert_eq!(dups.trim(), "0");
}
