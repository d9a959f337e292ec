//! The collector end to end: the real binary on 127.0.0.1:0, simulated ranks on
//! the real protocol, and the real DuckDB CLI reading what it wrote.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use rankscope_proto::v1::{LayerColumns, LayerRow};
use rankscope_tests::{
    CollectorProc, batch, count, count_by_rank, duckdb, hello, open, rankscope, table,
};
use tonic::Code;

#[test]
fn loadgen_rows_land_exactly_per_rank_and_table() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &[]);
    let (ranks, steps, layers) = (8u64, 60u64, 7u64);
    rankscope(&[
        "loadgen",
        "--ranks",
        &ranks.to_string(),
        "--steps",
        &steps.to_string(),
        "--layers",
        &layers.to_string(),
        "--collector",
        &collector.addr,
        "--run-id",
        "exact-1",
    ]);
    assert!(collector.stop(), "collector exits 0 after SIGTERM");
    let out = dir.path();
    let expect = |per_rank: u64| (0..ranks as u32).map(|r| (r, per_rank)).collect::<Vec<_>>();
    assert_eq!(count_by_rank(out, "layers"), expect(steps * layers));
    assert_eq!(count_by_rank(out, "steps"), expect(steps));
    assert_eq!(count_by_rank(out, "model"), expect(layers));
    assert_eq!(count_by_rank(out, "ranks"), expect(1));
    assert_eq!(count(out, "runs", ""), 1);
    assert!(!out.join("events").exists(), "no drops, so no events");
    // The hive partition and the column agree.
    assert_eq!(
        duckdb(&format!(
            "select distinct run_id from {}",
            table(out, "steps")
        ))
        .trim(),
        "exact-1"
    );
    // Every rank finished.
    assert_eq!(count(out, "ranks", "finished_at is null"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resent_acknowledged_batches_are_not_duplicated() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &["--max-file-age", "200ms"]);
    let (mut first, durable) = open(&collector.addr, hello("resend", 1)).await.unwrap();
    assert_eq!(durable, 0);
    for seq in 1..=5 {
        first.send(batch(seq, 10, false)).await;
    }
    assert_eq!(first.acked(5).await, 5);
    drop(first);

    // A reconnecting agent that lost track resends everything, then more.
    let (mut second, durable) = open(&collector.addr, hello("resend", 1)).await.unwrap();
    assert_eq!(durable, 5, "the Welcome carries the durable watermark");
    for seq in 1..=6 {
        second.send(batch(seq, 10, seq == 6)).await;
    }
    assert_eq!(second.acked(6).await, 6);
    drop(second);
    assert!(collector.stop());
    let out = dir.path();
    assert_eq!(count(out, "steps", ""), 60);
    let dups = duckdb(&format!(
        "select count(*) from (select rank, step from {} group by all having count(*) > 1)",
        table(out, "steps")
    ));
    assert_eq!(dups.trim(), "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_carry_clear_statuses() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &["--max-message-bytes", "65536"]);
    let addr = collector.addr.clone();

    for bad in ["../etc", "a/b", "..", "", "x y", &"r".repeat(200)] {
        let status = open(&addr, hello(bad, 0)).await.err().expect("refused");
        assert_eq!(status.code(), Code::InvalidArgument, "{bad:?}");
        assert!(status.message().contains("run id"), "{}", status.message());
    }

    let mut wrong_schema = hello("schema", 0);
    wrong_schema.schema_major = 2;
    let status = open(&addr, wrong_schema).await.err().expect("refused");
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().contains("schema major version 2"));

    let mut wrong_rank = hello("rank", 0);
    wrong_rank.rank = 9;
    let status = open(&addr, wrong_rank).await.err().expect("refused");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("world_size"));

    // An oversized message ends that stream with a clear status.
    let (mut big, _) = open(&addr, hello("big", 0)).await.unwrap();
    big.send(batch(1, 10_000, false)).await;
    let status = big.error().await;
    assert!(
        status.message().contains("message length too large"),
        "{status:?}"
    );

    // A garbage layer name is refused; the stream ends, the collector lives on.
    let (mut garbage, _) = open(&addr, hello("garbage", 0)).await.unwrap();
    let mut b = batch(1, 0, false);
    b.layers.push(LayerRow {
        layer: "evil\u{7}\n".into(),
        ..Default::default()
    });
    garbage.send(b).await;
    let status = garbage.error().await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("control characters"));

    // And a well-formed stream still works.
    let (mut fine, _) = open(&addr, hello("fine", 0)).await.unwrap();
    fine.send(batch(1, 3, true)).await;
    assert_eq!(fine.acked(1).await, 1);
    drop(fine);
    assert!(collector.stop());
    assert_eq!(count(dir.path(), "steps", ""), 3);
}

/// `layers` rows as an agent of schema minor 3 sends them to this collector
/// (columns), as older agents and their spill files send them (rows), and both
/// in one batch: the same rows land, value for value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layers_as_rows_and_as_columns_land_alike() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &["--max-file-age", "200ms"]);
    let rows: Vec<LayerRow> = (0..40u64)
        .map(|i| LayerRow {
            step: i / 4,
            time: 1_700_000_000_000_000 + i as i64,
            layer: format!("blocks.{}.mlp", i % 4),
            rows: 256,
            cols: 1024,
            centered: true,
            stable_rank: Some(1.0 + i as f64 / 8.0),
            participation_ratio: (i % 3 != 0).then_some(2.0 + i as f64),
            cum_energy_90: Some(i as u32),
            effective_rank: Some(5.5),
            mean: Some(-0.125),
            nonfinite: i % 2,
            compute_ms: 0.25,
            method: if i.is_multiple_of(5) {
                "sketch"
            } else {
                "exact"
            }
            .into(),
            effective_rank_err: i.is_multiple_of(5).then_some(0.01),
            ..Default::default()
        })
        .collect();
    for rank in 0..3u32 {
        let mut hello = hello("formats", rank);
        hello.schema_minor = if rank == 0 { 2 } else { 3 };
        let (mut stream, _) = open(&collector.addr, hello).await.unwrap();
        let mut b = batch(1, 0, true);
        b.layers = rows.clone();
        match rank {
            // An old agent, or a spill file of one: rows.
            0 => {}
            // This agent: columns.
            1 => b.layers_as_columns(),
            // Both in one batch: rows first, then two column entries.
            _ => {
                let tail = b.layers.split_off(10);
                b.layer_columns
                    .push(LayerColumns::from_rows(tail[..15].to_vec()));
                b.layer_columns
                    .push(LayerColumns::from_rows(tail[15..].to_vec()));
            }
        }
        stream.send(b).await;
        assert_eq!(stream.acked(1).await, 1, "rank {rank}");
    }
    assert!(collector.stop());
    let out = dir.path();
    assert_eq!(count_by_rank(out, "layers"), [(0, 40), (1, 40), (2, 40)]);
    // Every rank's rows, all columns but the head ones, are rank 0's.
    let layers = table(out, "layers");
    for rank in [1, 2] {
        let differ = duckdb(&format!(
            "select count(*) from ((select * exclude (run_id, rank) from {layers} where rank = 0) \
             except all (select * exclude (run_id, rank) from {layers} where rank = {rank}))"
        ));
        assert_eq!(differ.trim(), "0", "rank {rank}'s rows are rank 0's");
    }
    let nulls = duckdb(&format!(
        "select count(*) filter (participation_ratio is null), count(*) filter (effective_rank_err is not null), \
         count(distinct method), max(cum_energy_90) from {layers} where rank = 1"
    ));
    assert_eq!(nulls.trim(), "14,8,2,39");
}

/// Lists every file a `*/*.parquet` glob would match.
fn globbed(out: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for table in std::fs::read_dir(out).into_iter().flatten().flatten() {
        for run in std::fs::read_dir(table.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            for f in std::fs::read_dir(run.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let name = f.file_name();
                let name = name.to_string_lossy();
                if name.ends_with(".parquet") && !name.starts_with('.') {
                    files.push(f.path());
                }
            }
        }
    }
    files
}

#[test]
fn no_partial_file_is_ever_visible_to_a_glob() {
    let dir = tempfile::tempdir().unwrap();
    // Small files and frequent rotation: many renames while we watch.
    let collector = CollectorProc::start(
        dir.path(),
        &["--max-file-age", "50ms", "--max-file-rows", "500"],
    );
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (out, done) = (dir.path().to_path_buf(), done.clone());
        std::thread::spawn(move || {
            let mut checked = 0u64;
            while !done.load(Ordering::Relaxed) {
                for path in globbed(&out) {
                    let Ok(file) = std::fs::File::open(&path) else {
                        continue;
                    };
                    // A complete Parquet file has a readable footer.
                    parquet::file::reader::SerializedFileReader::new(file)
                        .unwrap_or_else(|e| panic!("{} is partial: {e}", path.display()));
                    checked += 1;
                }
            }
            checked
        })
    };
    rankscope(&[
        "loadgen",
        "--ranks",
        "4",
        "--steps",
        "300",
        "--layers",
        "4",
        "--step-interval",
        "1ms",
        "--collector",
        &collector.addr,
    ]);
    assert!(collector.stop());
    done.store(true, Ordering::Relaxed);
    let checked = watcher.join().expect("no partial file seen");
    assert!(checked > 0, "the watcher saw files while they were written");
    let files = globbed(dir.path());
    assert!(
        files.len() > 4,
        "rotation made several files: {}",
        files.len()
    );
    assert_eq!(count(dir.path(), "layers", ""), 4 * 300 * 4);
}

#[test]
fn absurd_flags_are_refused_without_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    for (flag, value) in [
        ("--max-file-age", "1e20"),
        ("--rank-grace", "1e300m"),
        ("--max-file-age", "ten"),
        // Host names are not looked up; the message says what to give.
        ("--http", "localhost:9464"),
        ("--min-free-bytes", "1GB"),
    ] {
        let output = std::process::Command::new(rankscope_tests::bin("rankscope"))
            .args(["collector", "--listen", "127.0.0.1:0", "--out"])
            .arg(dir.path())
            .args([flag, value])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{flag} {value}: {stderr}");
        assert!(!stderr.contains("panicked"), "{flag} {value}: {stderr}");
        assert!(stderr.contains(value) && stderr.contains(flag), "{stderr}");
        assert!(
            stderr.contains("e.g."),
            "{flag} {value}: no fix given: {stderr}"
        );
    }
}

#[test]
fn bounds_the_collector_cannot_work_with_are_refused() {
    let dir = tempfile::tempdir().unwrap();

    for (args, names) in [
        (
            &["--max-memory-bytes", "0"][..],
            &["--max-memory-bytes 0", "268435456"][..],
        ),
        (
            &["--max-message-bytes", "0"],
            &["--max-message-bytes 0", "4096"],
        ),
        (
            &["--max-message-bytes", "99999999999"],
            &["--max-message-bytes 99999999999", "799999999992"],
        ),
        (
            &[
                "--max-memory-bytes",
                "268435456",
                "--max-message-bytes",
                "67108864",
            ],
            &["--max-message-bytes 67108864", "an eighth", "536870912"],
        ),
        (&["--max-streams", "0"], &["--max-streams 0", "at least 1"]),
        (
            &["--max-file-rows", "0"],
            &["--max-file-rows 0", "at least 1"],
        ),
    ] {
        let output = std::process::Command::new(rankscope_tests::bin("rankscope"))
            .args(["collector", "--listen", "127.0.0.1:0", "--out"])
            .arg(dir.path())
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        for name in names {
            assert!(
                stderr.contains(name),
                "{args:?} should name {name:?}: {stderr}"
            );
        }
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            !stdout.contains("listening"),
            "refused before listening: {stdout}"
        );
    }
    // A file where the output directory should be.
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let output = std::process::Command::new(rankscope_tests::bin("rankscope"))
        .args(["collector", "--listen", "127.0.0.1:0", "--out"])
        .arg(&file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("is a file, not a directory"), "{stderr}");
    assert!(!String::from_utf8_lossy(&output.stdout).contains("listening"));
    // The smallest accepted bounds start, written with binary suffixes.
    let collector = CollectorProc::start(
        dir.path(),
        &[
            "--max-memory-bytes",
            "256M",
            "--max-message-bytes",
            "4K",
            "--max-streams",
            "1",
        ],
    );
    drop(collector);
}

#[test]
fn a_closed_stdout_does_not_stop_the_collector() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(rankscope_tests::bin("rankscope"))
        .args(["collector", "--listen", "127.0.0.1:0", "--out"])
        .arg(dir.path())
        .env("RANKSCOPE_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    stdout.read_line(&mut first).unwrap();
    let addr = first
        .split_whitespace()
        .map(|w| w.trim_end_matches(','))
        .find(|w| w.parse::<std::net::SocketAddr>().is_ok())
        .unwrap()
        .to_string();
    // Whoever read its stdout is gone (`rankscope collector | head -1`).
    drop(stdout);
    rankscope(&[
        "loadgen",
        "--ranks",
        "2",
        "--steps",
        "5",
        "--layers",
        "2",
        "--collector",
        &addr,
    ]);
    rankscope_tests::signal(child.id(), "TERM");
    let status = child.wait().unwrap();
    assert!(status.success(), "the collector exits 0: {status}");
    assert_eq!(count(dir.path(), "layers", ""), 2 * 5 * 2);
}
