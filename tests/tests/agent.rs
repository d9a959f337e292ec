//! The agent end to end: real tch training ranks launched by `rankscope launch`
//! and by the real `torchrun --no-python`, into a real collector, checked with the
//! real DuckDB CLI.

use std::process::Command;

use rankscope_tests::{
    CollectorProc, bin, count, count_by_rank, duckdb, rankscope, spill_dir, table, tool,
};

const MLP_LAYERS: u64 = 4; // fc1, fc2, fc3, head

fn train_args<'a>(steps: &'a str, sample_every: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "train",
        "--model",
        "mlp",
        "--steps",
        steps,
        "--sample-every",
        sample_every,
        "--device",
        "cpu",
        "--batch-size",
        "32",
    ];
    args.extend_from_slice(extra);
    args
}

#[test]
fn launch_of_four_ranks_lands_exact_counts() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &[]);
    let exe = bin("rankscope");
    let exe = exe.to_str().unwrap();
    let mut args = vec![
        "launch",
        "--nproc-per-node",
        "4",
        "--run-id",
        "launch-4",
        "--",
        exe,
    ];
    args.extend(train_args("25", "10", &["--collector", &collector.addr]));
    rankscope(&args);
    assert!(collector.stop());
    let out = dir.path();
    let sampled_steps = 3; // steps 0, 10, 20 of 25
    let per_rank = |n: u64| (0..4).map(|r| (r, n)).collect::<Vec<_>>();
    assert_eq!(
        count_by_rank(out, "layers"),
        per_rank(sampled_steps * MLP_LAYERS)
    );
    assert_eq!(count_by_rank(out, "steps"), per_rank(25));
    assert_eq!(count_by_rank(out, "ranks"), per_rank(1));
    assert_eq!(count_by_rank(out, "model"), per_rank(MLP_LAYERS));
    assert_eq!(count(out, "runs", "world_size = 4 and workload = 'mlp'"), 1);
    // Identity came from the launcher's torchrun variables.
    assert_eq!(
        duckdb(&format!(
            "select count(distinct run_id), sum(local_rank), max(world_size), count(finished_at) from {}",
            table(out, "ranks")
        ))
        .trim(),
        "1,6,4,4"
    );
    // Metrics are present and sane for a finite run.
    assert_eq!(
        count(
            out,
            "layers",
            "stable_rank is null or stable_rank < 1 - 1e-9"
        ),
        0
    );
    assert_eq!(
        count(
            out,
            "layers",
            "layer = 'fc1' and cols = 64 and rows = 32 and compute_ms >= 0"
        ),
        4 * sampled_steps
    );
    // 32 × 64 is far below the sketch threshold: every spectrum is exact, and says so.
    assert_eq!(
        count(out, "layers", "method = 'exact'"),
        4 * sampled_steps * MLP_LAYERS
    );
    assert_eq!(
        count(
            out,
            "steps",
            "loss is null or forward_ms is null or rss_bytes is null"
        ),
        0
    );
    // On CPU the accelerator columns are null.
    assert_eq!(count(out, "steps", "device_allocated_bytes is not null"), 0);
    assert_eq!(
        count(
            out,
            "model",
            "layer = 'fc1' and params = 384 and forward_flops = 2*32*5*64"
        ),
        4
    );
}

#[test]
fn rank0_mode_records_rank_zero_only() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &[]);
    let exe = bin("rankscope");
    let exe = exe.to_str().unwrap();
    let mut args = vec!["launch", "--nproc-per-node", "3", "--", exe];
    args.extend(train_args(
        "12",
        "5",
        &["--collector", &collector.addr, "--mode", "rank0"],
    ));
    rankscope(&args);
    assert!(collector.stop());
    let out = dir.path();
    assert_eq!(count_by_rank(out, "steps"), vec![(0, 12)]);
    assert_eq!(count_by_rank(out, "layers"), vec![(0, 3 * MLP_LAYERS)]);
    assert_eq!(count_by_rank(out, "ranks"), vec![(0, 1)]);
    assert_eq!(count(out, "runs", "mode = 'rank0'"), 1);
}

#[test]
fn training_without_a_collector_finishes_and_reports_unacknowledged_rows() {
    // A port nothing listens on: bind, note it, close.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let output = Command::new(bin("rankscope"))
        .env("RANKSCOPE_SPILL_DIR", spill_dir())
        .env("RANKSCOPE_OVERHEAD_BUDGET", "100%")
        .args(train_args(
            "15",
            "5",
            &["--collector", &addr, "--finish-timeout", "1s"],
        ))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("15 steps"), "{stdout}");
    assert!(stdout.contains("0 acknowledged"), "{stdout}");
    assert!(
        !stdout.contains(" 0 unacknowledged"),
        "unacknowledged rows are reported: {stdout}"
    );
    assert!(stderr.contains("telemetry incomplete"), "{stderr}");
}

#[test]
fn wrong_rank_variables_fail_clearly_or_disable_on_request() {
    let output = Command::new(bin("rankscope"))
        .env("RANKSCOPE_SPILL_DIR", spill_dir())
        .env("RANKSCOPE_OVERHEAD_BUDGET", "100%")
        .args(train_args("2", "1", &[]))
        .env("RANK", "7")
        .env("WORLD_SIZE", "4")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("RANK=7 but WORLD_SIZE=4"), "{stderr}");

    let output = Command::new(bin("rankscope"))
        .env("RANKSCOPE_SPILL_DIR", spill_dir())
        .env("RANKSCOPE_OVERHEAD_BUDGET", "100%")
        .args(train_args("2", "1", &["--finish-timeout", "1s"]))
        .env("RANKSCOPE_MODE", "sometimes")
        .env("RANKSCOPE_ON_CONFIG_ERROR", "disable")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("rankscope disabled"), "{stderr}");
}

#[test]
fn real_torchrun_launch_lands_in_the_collector() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &[]);
    let exe = bin("rankscope");
    let output = Command::new(tool("torchrun"))
        .env("RANKSCOPE_SPILL_DIR", spill_dir())
        .env("RANKSCOPE_OVERHEAD_BUDGET", "100%")
        .args([
            "--standalone",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--no-python",
        ])
        .arg(&exe)
        .args(train_args(
            "10",
            "5",
            &["--collector", &collector.addr, "--run-id", "torchrun-2"],
        ))
        .output()
        .expect("run torchrun from the project venv (make setup)");
    assert!(
        output.status.success(),
        "torchrun failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(collector.stop());
    let out = dir.path();
    assert_eq!(count_by_rank(out, "steps"), vec![(0, 10), (1, 10)]);
    assert_eq!(
        count_by_rank(out, "layers"),
        vec![(0, 2 * MLP_LAYERS), (1, 2 * MLP_LAYERS)]
    );
    assert_eq!(
        count(out, "ranks", "world_size = 2 and run_id = 'torchrun-2'"),
        2
    );
}

#[test]
fn samples_skipped_for_the_overhead_budget_are_counted_as_events() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &[]);
    let steps = 30;
    let output = Command::new(bin("rankscope"))
        .env("RANKSCOPE_SPILL_DIR", spill_dir())
        // So small that after the first planned sample (always taken: it tells
        // what a sample costs) no other fits in this short run.
        .env("RANKSCOPE_OVERHEAD_BUDGET", "0.0001%")
        .args(train_args(
            &steps.to_string(),
            "1",
            &["--collector", &collector.addr, "--run-id", "budget-1"],
        ))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(collector.stop());
    let out = dir.path();
    let layers = count(out, "layers", "");
    let event = |kind: &str| -> Vec<u64> {
        duckdb(&format!(
            "select value from {} where kind = '{kind}'",
            table(out, "events")
        ))
        .lines()
        .map(|v| v.trim().parse().unwrap())
        .collect()
    };
    let skipped = event("samples_skipped");
    assert_eq!(skipped.len(), 1, "one samples_skipped event: {skipped:?}");
    assert!(layers >= MLP_LAYERS, "the first planned sample is taken");
    assert!(skipped[0] > 0);
    // Every planned sample (every layer of every step) is taken or skipped;
    // nothing is dropped.
    assert_eq!(layers + skipped[0], steps * MLP_LAYERS);
    assert_eq!(event("samples_dropped"), Vec::<u64>::new());
    assert_eq!(event("overhead_share").len(), 1);
    // The agent's threads set up at init (the metrics thread's warm-up, the
    // transport's start and first connection), and that time is named apart (left
    // out of the budget), not charged to the first sample.
    let message = duckdb(&format!(
        "select message from {} where kind = 'overhead_share'",
        table(out, "events")
    ));
    let warm_up_ms: f64 = message
        .split("set-up at init (")
        .nth(1)
        .and_then(|rest| rest.split(" ms").next())
        .and_then(|ms| ms.parse().ok())
        .unwrap_or_else(|| panic!("no set-up time in {message:?}"));
    assert!(warm_up_ms > 0.0, "{message}");
    // The budget is recorded with the run, as a fraction, and the summary
    // states it as it was given.
    assert_eq!(
        count(out, "runs", "abs(overhead_budget - 0.000001) < 1e-12"),
        1
    );
    let summary = rankscope_tests::rankscope(&["summary", "--out", out.to_str().unwrap()]);
    assert!(
        summary.contains("the run's overhead budget is 0.0001% of each process's CPU time"),
        "{summary}"
    );
    // The summary shows the agent's CPU share as the agent reported it, and
    // the agent_overhead diagnosis holds that share to the budget.
    let share = event("overhead_share")[0];
    let row: Vec<&str> = summary
        .lines()
        .find(|l| l.trim_start().starts_with("0 "))
        .unwrap_or_else(|| panic!("no row for rank 0: {summary}"))
        .split_whitespace()
        .collect();
    assert_eq!(row[5], format!("{:.3}", share as f64 / 1e4), "{summary}");
    let json = dir.path().join("report.json");
    rankscope_tests::rankscope(&[
        "report",
        out.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ]);
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let cpu_pct = report["ranks"][0]["cpu_pct"].as_f64().unwrap();
    assert!((cpu_pct - share as f64 / 1e4).abs() < 1e-9, "{report}");
    let overhead = report["diagnoses"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["kind"] == "agent_overhead")
        .unwrap_or_else(|| panic!("no agent_overhead diagnosis: {report}"));
    let cpu_share = overhead["ranks"][0]["cpu_share"].as_f64().unwrap();
    assert!((cpu_share - share as f64 / 1e6).abs() < 1e-12, "{overhead}");
    // The budget left room for the first planned sample only, which the agent
    // always takes: the diagnosis says so instead of advising fewer samples.
    assert_eq!(overhead["ranks"][0]["sampled_steps"], 1, "{overhead}");
    let message = overhead["message"].as_str().unwrap();
    assert!(
        message.contains("its one sample is the first, always taken"),
        "{message}"
    );
    assert_eq!(
        count(
            out,
            "events",
            "kind = 'samples_skipped' and message like '%RANKSCOPE_OVERHEAD_BUDGET=0.0001%'"
        ),
        1
    );
}
