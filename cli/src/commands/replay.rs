//! `rankscope replay`: sends what ranks left in their spill directories (a run whose
//! collector was down, or ranks that will not run again) and empties them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use rankscope_agent::config::CollectorList;
use rankscope_agent::transport::spill::SpillLog;
use rankscope_agent::{Transport, TransportConfig};

/// Send spilled telemetry to a collector.
#[derive(clap::Args, Clone)]
#[command(after_help = "Examples:
  rankscope replay --collector 127.0.0.1:50051
  rankscope replay --spill-dir /local/rankscope-spill --run-id my-run --collector collector-host:50051

TLS settings come from RANKSCOPE_TLS_CA, RANKSCOPE_TLS_CERT and RANKSCOPE_TLS_KEY,
as for the ranks. A rank keeps what the collector has not acknowledged in
SPILL_DIR/<run id>/rank-<rank>/, and sends it itself when it runs again under the
same run id. Use this command for runs that are over. Each directory is emptied
once the collector holds everything in it; what is left is reported, and the
command exits non-zero.")]
pub struct Args {
    /// The spill root the ranks used (RANKSCOPE_SPILL_DIR).
    #[arg(long, env = "RANKSCOPE_SPILL_DIR", default_value_os_t = rankscope_agent::config::default_spill_dir())]
    pub spill_dir: PathBuf,
    /// Only this run (default: every run in the spill root).
    #[arg(long)]
    pub run_id: Option<String>,
    /// Collector address, or the run's comma-separated list (rank r goes to entry
    /// r % len, as it did from the rank).
    #[arg(long, default_value = "127.0.0.1:50051", env = "RANKSCOPE_COLLECTOR")]
    pub collector: String,
    /// Bearer token, if the collector requires one.
    #[arg(long, env = "RANKSCOPE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// How long to wait for each rank's rows to become durable.
    #[arg(long, default_value = "60s", value_parser = crate::duration_arg::parse)]
    pub timeout: Duration,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let collectors = CollectorList::parse("--collector", &args.collector)?;
    let ranks = rank_dirs(&args.spill_dir, args.run_id.as_deref())?;
    if ranks.is_empty() {
        // Not an error: a job that never spilled leaves nothing, and scripts replay
        // after every job. What was looked for, and what is there, is said.
        println!(
            "{}",
            nothing_to_replay(&args.spill_dir, args.run_id.as_deref())
        );
        return Ok(());
    }
    let tls = rankscope_agent::config::client_tls_from_env()?;
    let bar = indicatif::ProgressBar::new(ranks.len() as u64);
    let mut incomplete = 0;
    let (mut acked, mut left) = (0, 0);
    for dir in &ranks {
        let hello = SpillLog::read_hello(dir)
            .with_context(|| format!("cannot read the rank recorded in {}", dir.display()))?;
        let mut config = TransportConfig::new(collectors.for_rank(hello.rank));
        config.token = args.token.clone();
        config.tls = tls.clone();
        config.spill_dir = Some(args.spill_dir.clone());
        let transport = Transport::start(config, hello.clone())?;
        let report = transport.finish(Vec::new(), args.timeout);
        acked += report.rows_acked;
        left += report.rows_unacked;
        if !report.complete() {
            incomplete += 1;
            bar.suspend(|| {
                eprintln!(
                    "run {} rank {}: {} rows not acknowledged, {} dropped; they stay in {}",
                    hello.run_id,
                    hello.rank,
                    report.rows_unacked,
                    report.rows_dropped,
                    dir.display()
                )
            });
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    println!(
        "replayed {} rank directories: {acked} rows acknowledged, {left} left",
        ranks.len()
    );
    if incomplete > 0 {
        bail!(
            "{incomplete} rank directories were not fully delivered: is the collector at {} up? run replay again",
            args.collector
        );
    }
    Ok(())
}

/// Why there is nothing to replay: the spill root does not exist (ranks make it only
/// when they spill), or it holds no recorded rank of the run asked for (and which runs
/// it does hold).
fn nothing_to_replay(root: &Path, run_id: Option<&str>) -> String {
    if !root.exists() {
        return format!(
            "nothing to replay: {} does not exist (ranks create it only when they spill; \
             --spill-dir or RANKSCOPE_SPILL_DIR names the one they used)",
            root.display()
        );
    }
    let runs: Vec<String> = rank_dirs(root, None)
        .unwrap_or_default()
        .iter()
        .filter_map(|rank| Some(rank.parent()?.file_name()?.to_string_lossy().into_owned()))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    match (run_id, runs.is_empty()) {
        (Some(run), false) => format!(
            "nothing to replay for run {run} in {}; runs there: {}",
            root.display(),
            runs.join(", ")
        ),
        (Some(run), true) => format!(
            "nothing to replay for run {run}: {} holds no spilled rank",
            root.display()
        ),
        (None, _) => format!(
            "nothing to replay: {} holds no spilled rank",
            root.display()
        ),
    }
}

/// `<root>/<run>/rank-<n>` directories that hold a recorded rank.
fn rank_dirs(root: &Path, run_id: Option<&str>) -> anyhow::Result<Vec<PathBuf>> {
    if !root.exists() {
        return Ok(Vec::new());
    }
    let mut dirs = Vec::new();
    let runs = std::fs::read_dir(root)
        .with_context(|| format!("cannot list the spill directory {}", root.display()))?;
    for run in runs {
        let run = run?.path();
        let name = run.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if run_id.is_some_and(|wanted| wanted != name) || !run.is_dir() {
            continue;
        }
        for rank in std::fs::read_dir(&run)? {
            let rank = rank?.path();
            if rank.join("hello.pb").is_file() {
                dirs.push(rank);
            }
        }
    }
    dirs.sort();
    Ok(dirs)
}
