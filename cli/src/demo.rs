//! `rankscope demo`: an embedded collector, 4 ranks of training, then the run's
//! summary, where its Parquet files are, and its HTML report. The ranks are real PyTorch DDP ranks of
//! a Python script under the real `torchrun` (`--script`, what `make demo` runs), or
//! `rankscope train` launched the torchrun way.

use std::path::PathBuf;

use anyhow::{Context, bail};

use crate::launch;

/// Train 4 ranks into an embedded collector and summarise the run.
#[derive(clap::Args, Clone, Debug)]
#[command(after_help = "Examples:
  rankscope demo --script agent/python/examples/ddp_train.py --steps 100   # PyTorch DDP
  rankscope demo                                                          # Rust tch ranks
  rankscope demo --model transformer --steps 300 --nproc-per-node 2")]
pub struct Args {
    /// Output directory of the embedded collector.
    #[arg(long, default_value = "rankscope-out")]
    pub out: PathBuf,
    /// Ranks to launch.
    #[arg(long, default_value_t = 4)]
    pub nproc_per_node: u32,
    /// mlp, cnn or transformer.
    #[arg(long, default_value = "mlp")]
    pub model: String,
    #[arg(long, default_value_t = 300)]
    pub steps: u64,
    #[arg(long, default_value_t = 10)]
    pub sample_every: u64,
    /// A PyTorch training script to run under `torchrun --standalone` instead of
    /// `rankscope train` (it gets `--steps`; rankscope reads its variables).
    #[arg(long)]
    pub script: Option<PathBuf>,
    /// The torchrun to use with `--script`.
    #[arg(long, default_value = "torchrun")]
    pub torchrun: PathBuf,
    /// The ranks' overhead budget (RANKSCOPE_OVERHEAD_BUDGET). A demo lasts
    /// seconds, and the default 2% of that buys about one sample per layer, so
    /// the demo gives the agent more.
    #[arg(long, default_value = "20%", value_parser = crate::bench::parse_budget)]
    pub overhead_budget: rankscope_agent::config::OverheadBudget,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .context("cannot listen on 127.0.0.1")?;
    let addr = listener.local_addr()?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut config = rankscope_collector::CollectorConfig::new(&args.out);
    config.max_file_age = std::time::Duration::from_secs(2);
    let collector = runtime.spawn(rankscope_collector::serve(listener, config, async {
        let _ = stop_rx.await;
    }));
    println!(
        "embedded collector on {addr}, writing {}",
        args.out.display()
    );

    let run_id = launch::fresh_run_id();
    let statuses = match &args.script {
        Some(script) => vec![run_script(&args, script, &addr.to_string(), &run_id)?],
        None => run_train(&args, &addr.to_string(), &run_id)?,
    };
    let _ = stop_tx.send(());
    let summary = runtime
        .block_on(collector)
        .context("collector task")?
        .context("embedded collector failed")?;
    if statuses.iter().any(|s| !s.success()) {
        bail!("some ranks failed: {statuses:?}");
    }
    println!(
        "collector: {} rows in {} files, {} duplicate batches dropped\n",
        summary.rows, summary.files, summary.duplicates
    );
    let dataset = crate::query::Dataset::open(&args.out)?;
    print!("{}", crate::summary::summarise_dataset(&dataset, &run_id)?);
    let (report, data) = crate::report::build(&dataset, Some(&run_id))?;
    let page = crate::report::default_path(&args.out, &run_id);
    std::fs::write(&page, crate::report::html::page(&report, &data)?)
        .with_context(|| format!("cannot write {}", page.display()))?;
    println!();
    for d in &report.diagnoses {
        println!("diagnosis: {}", d.message);
    }
    let out = args.out.display();
    println!(
        "\nParquet files: {out}/<table>/run_id={run_id}/*.parquet (tables: runs, ranks, steps, layers, model, events)"
    );
    println!("explore them with DuckDB (installed in .venv/bin by `make setup`):");
    println!(
        "  duckdb -c \"select layer, step, avg(stable_rank) sr, avg(effective_rank) er from read_parquet('{out}/layers/*/*.parquet', hive_partitioning=true) where run_id='{run_id}' group by all order by layer, step\""
    );
    println!("\nreport: {}", page.display());
    Ok(())
}

/// `torchrun --standalone --nproc-per-node N SCRIPT --steps S` with the agent's
/// variables.
fn run_script(
    args: &Args,
    script: &std::path::Path,
    collector: &str,
    run_id: &str,
) -> anyhow::Result<std::process::ExitStatus> {
    if !script.exists() {
        bail!(
            "--script {}: no such file; give the path of a PyTorch training script",
            script.display()
        );
    }
    println!(
        "launching {} PyTorch DDP ranks of {} under torchrun (run {run_id})",
        args.nproc_per_node,
        script.display()
    );
    std::process::Command::new(&args.torchrun)
        .args(["--standalone", "--nproc-per-node"])
        .arg(args.nproc_per_node.to_string())
        .arg(script)
        .args(["--steps", &args.steps.to_string()])
        .env("RANKSCOPE_COLLECTOR", collector)
        .env("RANKSCOPE_RUN_ID", run_id)
        .env("RANKSCOPE_SAMPLE_EVERY", args.sample_every.to_string())
        .env("RANKSCOPE_OVERHEAD_BUDGET", budget_text(args))
        .env("OMP_NUM_THREADS", "1")
        .status()
        .with_context(|| {
            format!(
                "cannot run {}: install torch in the environment (make setup) or pass --torchrun",
                args.torchrun.display()
            )
        })
}

/// `rankscope train` ranks, launched with torchrun's variables.
fn run_train(
    args: &Args,
    collector: &str,
    run_id: &str,
) -> anyhow::Result<Vec<std::process::ExitStatus>> {
    let exe = std::env::current_exe().context("locating the rankscope binary")?;
    let launch_args = launch::Args {
        nproc_per_node: args.nproc_per_node,
        nnodes: 1,
        node_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: 29500,
        run_id: Some(run_id.to_string()),
        command: vec![
            exe.display().to_string(),
            "train".into(),
            "--model".into(),
            args.model.clone(),
            "--steps".into(),
            args.steps.to_string(),
            "--sample-every".into(),
            args.sample_every.to_string(),
            "--device".into(),
            "cpu".into(),
        ],
    };
    println!(
        "launching {} ranks of `rankscope train --model {}` (run {run_id})",
        args.nproc_per_node, args.model
    );
    launch::launch(
        &launch_args,
        &[
            ("RANKSCOPE_COLLECTOR", collector.to_string()),
            ("RANKSCOPE_OVERHEAD_BUDGET", budget_text(args)),
        ],
    )
}

/// `--overhead-budget` as RANKSCOPE_OVERHEAD_BUDGET reads it.
fn budget_text(args: &Args) -> String {
    format!("{}%", args.overhead_budget.percent())
}
