//! Faults end to end: the collector killed with SIGKILL and restarted mid-run,
//! and bearer-token auth. Checked with the real DuckDB CLI.

use std::process::{Command, Stdio};
use std::time::Duration;

use rankscope_tests::{CollectorProc, bin, count, count_by_rank, duckdb, rankscope, table};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn collector_killed_and_restarted_mid_run_loses_and_duplicates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let args = ["--max-file-age", "150ms"];
    let mut collector = CollectorProc::start_on(&listen, dir.path(), &args);
    let (ranks, steps, layers) = (4u64, 400u64, 3u64);
    let mut loadgen = Command::new(bin("rankscope"))
        .args([
            "loadgen",
            "--run-id",
            "chaos",
            "--step-interval",
            "5ms",
            "--finish-timeout",
            "60s",
        ])
        .args(["--ranks", &ranks.to_string(), "--steps", &steps.to_string()])
        .args(["--layers", &layers.to_string(), "--collector", &listen])
        .env("RANKSCOPE_LOG", "error")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // Two crashes at different moments of the run, each followed by a restart.
    for pause_ms in [700, 500] {
        std::thread::sleep(Duration::from_millis(pause_ms));
        collector.kill();
        std::thread::sleep(Duration::from_millis(200));
        collector = CollectorProc::start_on(&listen, dir.path(), &args);
    }
    let status = loadgen.wait().unwrap();
    assert!(
        status.success(),
        "every row was acknowledged after the restarts"
    );
    assert!(collector.stop());
    let out = dir.path();
    let per_rank = |n: u64| (0..ranks as u32).map(|r| (r, n)).collect::<Vec<_>>();
    assert_eq!(count_by_rank(out, "steps"), per_rank(steps));
    assert_eq!(count_by_rank(out, "layers"), per_rank(steps * layers));
    assert_eq!(count_by_rank(out, "model"), per_rank(layers));
    let dups = duckdb(&format!(
        "select count(*) from (select rank, step, layer from {} group by all having count(*) > 1)",
        table(out, "layers")
    ));
    assert_eq!(dups.trim(), "0");
    // No temporary file was left visible or half-read.
    let leftovers = walk(out)
        .into_iter()
        .filter(|p| p.ends_with(".tmp"))
        .count();
    assert_eq!(leftovers, 0);
}

fn walk(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p.display().to_string());
        }
    }
    out
}

#[test]
fn bearer_token_is_required_when_configured() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret-token\n").unwrap();
    let out = dir.path().join("out");
    let collector = CollectorProc::start(&out, &["--token-file", token.to_str().unwrap()]);
    let common = ["loadgen", "--ranks", "2", "--steps", "5", "--layers", "2"];

    let refused = Command::new(bin("rankscope"))
        .args(common)
        .args(["--collector", &collector.addr, "--finish-timeout", "2s"])
        .env_remove("RANKSCOPE_TOKEN")
        .output()
        .unwrap();
    assert!(!refused.status.success(), "no token, no write");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("bearer token"), "{stderr}");

    let wrong = Command::new(bin("rankscope"))
        .args(common)
        .args(["--collector", &collector.addr, "--finish-timeout", "2s"])
        .env("RANKSCOPE_TOKEN", "guess")
        .output()
        .unwrap();
    assert!(!wrong.status.success(), "a wrong token is refused");

    rankscope(&[
        "loadgen",
        "--ranks",
        "2",
        "--steps",
        "5",
        "--layers",
        "2",
        "--collector",
        &collector.addr,
        "--token",
        "s3cret-token",
    ]);
    assert!(collector.stop());
    assert_eq!(count(&out, "steps", ""), 10);
    assert_eq!(count(&out, "layers", ""), 20);
}
