//! Real training ranks: `rankscope train` of the transformer (slow enough per
//! step to be interrupted), started alone or under `rankscope launch`; the Python
//! package's DDP example under the real `torchrun`; and the exact-count checks of
//! what they sent.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::{bin, count, count_by_rank, duckdb, spill_dir, table, tool, workspace, wrapped};

/// Layer rows are sampled every this many steps by [`train`].
pub const SAMPLE_EVERY: u64 = 10;

/// `rankscope train` of the transformer on CPU, sending to `collector`.
pub fn train(collector: &str, run_id: &str, steps: u64, spill: &Path, finish: &str) -> Command {
    let mut cmd = Command::new(bin("rankscope"));
    cmd.args(["train", "--model", "transformer", "--device", "cpu"])
        .args(["--steps", &steps.to_string()])
        .args(["--sample-every", &SAMPLE_EVERY.to_string()])
        .args(["--batch-size", "32", "--collector", collector])
        .args(["--run-id", run_id, "--finish-timeout", finish])
        .env("RANKSCOPE_SPILL_DIR", spill)
        // Exact layer counts need every planned sample taken, which the default
        // 2 % overhead budget does not promise.
        .env("RANKSCOPE_OVERHEAD_BUDGET", "100%")
        .env("RANKSCOPE_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// `rankscope launch --nproc-per-node RANKS LAUNCH_ARGS... -- INNER`: `ranks`
/// local ranks of `inner` (its program, arguments and environment).
pub fn launch(ranks: u32, launch_args: &[&str], inner: &Command) -> Command {
    let ranks = ranks.to_string();
    let mut args = vec!["launch", "--nproc-per-node", &ranks];
    args.extend_from_slice(launch_args);
    args.push("--");
    let mut cmd = wrapped(bin("rankscope"), &args, inner);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

/// Waits for `child`; panics with its output unless it exited 0. Returns its
/// stdout and stderr.
pub fn wait_ok(child: Child, what: &str) -> String {
    let output = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{what} failed: {text}");
    text
}

/// Waits until some `steps` file is committed (data is flowing).
pub fn wait_for_data(out: &Path, limit: Duration) {
    let start = Instant::now();
    while start.elapsed() < limit {
        let any = std::fs::read_dir(out.join("steps"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|run| {
                std::fs::read_dir(run.path())
                    .into_iter()
                    .flatten()
                    .flatten()
                    .any(|f| f.path().extension().is_some_and(|e| e == "parquet"))
            });
        if any {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("no data reached the collector within {limit:?}");
}

/// Per rank `0..ranks` of [`train`]: steps rows = `steps`, no duplicate (rank,
/// step) or (rank, step, layer), layers rows = sampled steps × the layers seen,
/// and a finished `ranks` row.
pub fn assert_exact(out: &Path, ranks: u32, steps: u64) {
    let per_rank = |n: u64| (0..ranks).map(|r| (r, n)).collect::<Vec<_>>();
    assert_eq!(count_by_rank(out, "steps"), per_rank(steps));
    let layers = duckdb(&format!(
        "select count(distinct layer) from {}",
        table(out, "layers")
    ));
    let layers: u64 = layers.trim().parse().unwrap();
    assert!(layers > 0);
    assert_eq!(
        count_by_rank(out, "layers"),
        per_rank(steps.div_ceil(SAMPLE_EVERY) * layers)
    );
    for (name, key) in [("steps", "rank, step"), ("layers", "rank, step, layer")] {
        let dups = duckdb(&format!(
            "select count(*) from (select {key} from {} group by all having count(*) > 1)",
            table(out, name)
        ));
        assert_eq!(dups.trim(), "0", "duplicates in {name}");
    }
    assert_eq!(count(out, "ranks", "finished_at is not null"), ranks as u64);
}

static DDP_JOB: Mutex<()> = Mutex::new(());

/// Held by a test for as long as its DDP jobs run, so that a test binary runs one
/// at a time. Side by side on a 2-core machine, the jobs' ranks starved each
/// other: a straggler's measured wait shrank below the test's margin (seen under
/// `make test`, never alone).
pub fn one_ddp_job() -> MutexGuard<'static, ()> {
    DDP_JOB
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The PyTorch DDP example of the Python package.
pub fn example() -> PathBuf {
    workspace().join("python/rankscope/examples/ddp_train.py")
}

/// `torchrun ARGS... ddp_train.py SCRIPT_ARGS...` with the agent's variables
/// (`make test` installs the `rankscope` package into `.venv` first).
pub fn ddp_example(torchrun_args: &[&str], script_args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(tool("torchrun"));
    cmd.args(torchrun_args)
        .arg(example())
        .args(script_args)
        .env("RANKSCOPE_LOG", "warn")
        .env("RANKSCOPE_SPILL_DIR", spill_dir())
        // Layer rows are counted exactly: every planned sample must be taken, which
        // the default 2 % overhead budget does not promise.
        .env("RANKSCOPE_OVERHEAD_BUDGET", "100%")
        .env("OMP_NUM_THREADS", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Runs `cmd`; panics with its output unless it succeeds.
pub fn run_ok(mut cmd: Command) -> String {
    let output: std::process::Output = cmd.output().expect("run torchrun (make setup installs it)");
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{cmd:?} failed:\n{text}");
    text
}
