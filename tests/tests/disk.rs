//! A hostile disk against the real collector binary on 127.0.0.1:0: an output
//! filesystem below `--min-free-bytes`, and one that really fills up (a tmpfs,
//! which needs root; skipped, with a message, where it cannot be mounted).
//!
//! Nothing accepted may be lost, nothing stored twice, and the agent's resends
//! land once room is back, checked with the real DuckDB CLI.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use rankscope_proto::v1::Batch;
use rankscope_tests::{
    ANSWER_TIMEOUT, CollectorProc, FAST_COMMITS as FAST, batch, count, duckdb, hello, open, table,
    walk,
};
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn below_min_free_bytes_batches_are_refused_until_there_is_room() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let one_eib = (1u64 << 60).to_string();
    let mut args = FAST.to_vec();
    args.extend(["--min-free-bytes", &one_eib]);
    let collector = CollectorProc::start(&out, &args);
    let (mut stream, _) = open(&collector.addr, hello("floor", 0)).await.unwrap();
    stream.send(batch(1, 7, false)).await;
    let status = stream.error().await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    for part in [
        &format!("the filesystem holding {}", out.display()),
        " bytes free, below --min-free-bytes 1152921504606846976",
        "free space there or restart the collector with --out on a larger disk",
        "resend this batch later",
    ] {
        assert!(status.message().contains(part), "{part:?}: {status:?}");
    }
    drop(stream);
    assert!(collector.stop());
    assert!(!out.join("steps").exists(), "nothing was accepted");

    // With the default floor, the agent's resend lands, once.
    let collector = CollectorProc::start(&out, &FAST);
    let (mut stream, durable) = open(&collector.addr, hello("floor", 0)).await.unwrap();
    assert_eq!(durable, 0);
    stream.send(batch(1, 7, false)).await;
    assert_eq!(stream.acked(1).await, 1);
    drop(stream);
    // Resent once more after a reconnect: acknowledged, not stored twice.
    let (mut again, durable) = open(&collector.addr, hello("floor", 0)).await.unwrap();
    assert_eq!(durable, 1);
    again.send(batch(1, 7, false)).await;
    assert_eq!(again.acked(1).await, 1);
    drop(again);
    assert!(collector.stop());
    assert_eq!(count(&out, "steps", "run_id = 'floor'"), 7);
}

/// A tmpfs mounted for one test, unmounted when dropped (also on failure).
struct Tmpfs(PathBuf);

impl Tmpfs {
    /// Mounts a tmpfs of `size` (`512k`) on `dir`; `Err` says why it cannot.
    fn mount(dir: &Path, size: &str) -> Result<Tmpfs, String> {
        let output = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if output.status.success() {
            Ok(Tmpfs(dir.to_path_buf()))
        } else {
            Err(String::from_utf8_lossy(&output.stderr).trim().to_string())
        }
    }

    fn resize(&self, size: &str) {
        let status = Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.0)
            .status()
            .expect("run mount");
        assert!(status.success(), "remount to {size}");
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let unmounted = Command::new("umount")
            .arg(&self.0)
            .status()
            .is_ok_and(|s| s.success());
        if !unmounted {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

/// Batch `seq` of `rows` steps whose floats do not compress (so files are big).
fn incompressible(seq: u64, rows: u64, state: &mut u64) -> Batch {
    let mut next = || {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        f64::from_bits(*state >> 12 | 0x3ff0_0000_0000_0000)
    };
    let mut b = batch(seq, rows, false);
    for row in &mut b.steps {
        row.step_ms = next();
        row.loss = Some(next());
        row.grad_norm = Some(next());
        row.lr = Some(next());
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_commits_cleanly_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mount = match Tmpfs::mount(dir.path(), "512k") {
        Ok(mount) => mount,
        Err(why) => {
            eprintln!("skipping the full-disk test: cannot mount a tmpfs here ({why})");
            return;
        }
    };
    let out = dir.path().join("out");
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut args = FAST.to_vec();
    args.extend(["--min-free-bytes", "0"]);
    let mut collector = CollectorProc::start_logged(&out, &args, log.path());
    let (mut stream, _) = open(&collector.addr, hello("full", 0)).await.unwrap();

    // Fill the disk: send until a batch is not acknowledged.
    let (rows, mut state) = (2000, 0x9e37_79b9_7f4a_7c15u64);
    let mut sent = 0;
    let mut acked = 0;
    while sent < 60 {
        sent += 1;
        stream.send(incompressible(sent, rows, &mut state)).await;
        match stream.ack_within(Duration::from_secs(3)).await {
            Some(seq) => acked = seq,
            None => break,
        }
        while acked < sent {
            match stream.ack_within(Duration::from_secs(3)).await {
                Some(seq) => acked = seq,
                None => break,
            }
        }
        if acked < sent {
            break;
        }
    }
    assert!(acked < sent, "512 KiB never filled up after {sent} batches");
    assert!(acked > 0, "some batches fit before the disk filled");

    // The collector says why, and lives on.
    let deadline = tokio::time::Instant::now() + ANSWER_TIMEOUT;
    while !collector.log().contains("is full") && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let logged = collector.log();
    for part in [
        "commit failed",
        &format!("the filesystem holding {} is full", out.display()),
        "No space left on device",
        "free space there or restart the collector with --out on a larger disk",
    ] {
        assert!(logged.contains(part), "{part:?} not in the log:\n{logged}");
    }
    assert!(collector.alive());
    eprintln!("disk full after {acked} of {sent} batches were acknowledged");
    // The agent reconnects (its process's new stream takes over the old one).
    drop(stream);
    let (mut stream, durable) = open(&collector.addr, hello("full", 0)).await.unwrap();
    assert_eq!(durable, acked, "the Welcome carries what is durable");

    // Nothing partial is visible: every globbed file is a whole Parquet file,
    // holding exactly the acknowledged rows.
    for path in walk(&out) {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        // A running collector's lock (`_rankscope/collectors/<id>.lock`) is no data.
        let lock = name.ends_with(".lock")
            && path
                .parent()
                .is_some_and(|p| p.ends_with("_rankscope/collectors"));
        assert!(
            lock || name.starts_with('.') || name.ends_with(".parquet") || name.ends_with(".json"),
            "unexpected visible file {}",
            path.display()
        );
    }
    assert_eq!(count(&out, "steps", ""), acked * rows);

    // Free space: the retried commit lands what was held, then the rest arrives.
    mount.resize("64m");
    let deadline = tokio::time::Instant::now() + ANSWER_TIMEOUT;
    while acked < sent {
        let left = deadline - tokio::time::Instant::now();
        acked = stream
            .ack_within(left)
            .await
            .expect("the held batches are acknowledged once there is room");
    }
    stream
        .send(incompressible(sent + 1, rows, &mut state))
        .await;
    assert_eq!(stream.acked(sent + 1).await, sent + 1);
    drop(stream);
    assert!(collector.stop(), "the collector exits 0");

    let leftovers: Vec<_> = walk(&out)
        .into_iter()
        .filter(|p| p.to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    assert_eq!(count(&out, "steps", ""), (sent + 1) * rows, "no row lost");
    let dups = duckdb(&format!(
        "select count(*) from (select seq, step from {} group by all having count(*) > 1)",
        table(&out, "steps")
    ));
    assert_eq!(dups.trim(), "0", "no row stored twice");
    drop(mount);
}
