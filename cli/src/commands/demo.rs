//! `rankscope demo`: an embedded collector, 4 ranks of training, then the run's
//! summary, where its Parquet files are, and its HTML report. The ranks are real
//! PyTorch DDP ranks under the real `torchrun`: the package's example
//! (`python -m rankscope.examples.ddp_train`, what `make demo` and the wheel run) or
//! a script of the user's (`--script`). With `--rust` (a build with the `torch`
//! feature) they are `rankscope train` ranks launched the torchrun way.

use std::path::PathBuf;

use anyhow::{Context, bail};

use crate::commands::launch;

/// Train 4 ranks into an embedded collector and summarise the run.
#[derive(clap::Args, Clone, Debug)]
#[command(after_help = "Examples:
  rankscope demo --steps 100                          # the package's PyTorch DDP example
  rankscope demo --script train.py                    # your script (the README's quick start)
  rankscope demo --script train.py --steps 50         # ... passed --steps 50
  rankscope demo --rust --model transformer --nproc-per-node 2   # Rust tch ranks")]
pub struct Args {
    /// Output directory of the embedded collector.
    #[arg(long, default_value = "rankscope-out")]
    pub out: PathBuf,
    /// Ranks to launch (at least 1).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    pub nproc_per_node: u32,
    /// With `--rust`: mlp, cnn or transformer.
    #[arg(long, default_value = "mlp", requires = "rust")]
    pub model: String,
    /// Steps to train: the package's example trains 300 unless told; a script
    /// gets `--steps N` only when it is given here.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Sample every layer's activations every N steps (RANKSCOPE_SAMPLE_EVERY; at
    /// least 1).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub sample_every: u64,
    /// A PyTorch training script to run under `torchrun --standalone` instead of
    /// the package's example: it calls `rankscope.init()`, which reads the
    /// collector's address and the run id that the demo sets.
    #[arg(long, conflicts_with = "rust")]
    pub script: Option<PathBuf>,
    /// Run `rankscope train` ranks (Rust tch) instead of PyTorch; needs a
    /// rankscope built with the `torch` feature (`cargo build -p rankscope`).
    #[arg(long)]
    pub rust: bool,
    /// The torchrun to use for PyTorch ranks. The default is the `torchrun`
    /// beside this binary (the wheel installs both in the environment's `bin/`),
    /// else the one on PATH.
    #[arg(long, default_value = DEFAULT_TORCHRUN)]
    pub torchrun: PathBuf,
    /// The ranks' overhead budget (RANKSCOPE_OVERHEAD_BUDGET). A demo lasts
    /// seconds, and the default 2% of that buys about one sample per layer, so
    /// the demo gives the agent more.
    #[arg(long, default_value = "20%", value_parser = crate::overhead_budget_arg::parse)]
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
    let statuses = if args.rust {
        run_train(&args, &addr.to_string(), &run_id)?
    } else {
        vec![run_torchrun(&args, &addr.to_string(), &run_id)?]
    };
    let _ = stop_tx.send(());
    let summary = runtime
        .block_on(collector)
        .context("collector task")?
        .context("embedded collector failed")?;
    if let Some(failed) = failed(&statuses, args.rust) {
        bail!("{failed}");
    }
    println!(
        "collector: {} rows in {} files, {} duplicate batches dropped\n",
        summary.rows, summary.files, summary.duplicates
    );
    if summary.rows == 0 {
        bail!(
            "the ranks sent nothing to the embedded collector: a script must call \
             rankscope.init() (it reads RANKSCOPE_COLLECTOR and RANKSCOPE_RUN_ID, which the demo \
             sets) and record its steps with agent.step(i); the README's quick start shows where"
        );
    }
    let dataset = crate::output_query::Dataset::open(&args.out)?;
    print!(
        "{}",
        crate::commands::summary::summarise_dataset(&dataset, &run_id)?
    );
    let (report, data) = crate::commands::report::build(&dataset, Some(&run_id))?;
    let page = crate::commands::report::default_path(&args.out, &run_id);
    std::fs::write(&page, crate::commands::report::html::page(&report, &data)?)
        .with_context(|| format!("cannot write {}", page.display()))?;
    println!();
    for d in &report.diagnoses {
        println!("diagnosis: {}", d.message);
    }
    let out = args.out.display();
    println!(
        "\nParquet files: {out}/<table>/run_id={run_id}/*.parquet (tables: runs, ranks, steps, layers, model, events, comm)"
    );
    println!(
        "explore them with DuckDB (`pip install duckdb-cli`; `make setup` put it in .venv/bin):"
    );
    println!(
        "  duckdb -c \"select layer, step, avg(stable_rank) sr, avg(effective_rank) er from read_parquet('{out}/layers/*/*.parquet', hive_partitioning=true) where run_id='{run_id}' group by all order by layer, step\""
    );
    println!("\nreport: {}", page.display());
    Ok(())
}

const DEFAULT_TORCHRUN: &str = "torchrun";

/// What failed, where a launch did: torchrun (one status) or the `--rust` ranks
/// (one each); their own errors are printed above.
fn failed(statuses: &[std::process::ExitStatus], rust: bool) -> Option<String> {
    if rust {
        return launch::failure(statuses).map(|f| format!("{f}: their errors are above"));
    }
    let status = statuses.iter().find(|s| !s.success())?;
    Some(format!(
        "torchrun failed ({status}): the ranks' errors are above"
    ))
}

/// `--torchrun`, with the default looked for beside this binary first: so the
/// wheel's `rankscope demo` works from a venv that is not activated.
fn torchrun(args: &Args) -> PathBuf {
    if args.torchrun.as_os_str() == DEFAULT_TORCHRUN {
        let beside = std::env::current_exe()
            .ok()
            .and_then(|exe| Some(exe.parent()?.join(DEFAULT_TORCHRUN)));
        if let Some(beside) = beside.filter(|path| path.is_file()) {
            return beside;
        }
    }
    args.torchrun.clone()
}

/// Steps of the package's example (and of `--rust` ranks) unless `--steps` says.
const EXAMPLE_STEPS: u64 = 300;

/// The package's example, run as a module so that it is found wherever the
/// `rankscope` Python package is installed.
const EXAMPLE_MODULE: &str = "rankscope.examples.ddp_train";

/// `torchrun --standalone --nproc-per-node N (SCRIPT | -m EXAMPLE) --steps S` with
/// the agent's variables.
fn run_torchrun(
    args: &Args,
    collector: &str,
    run_id: &str,
) -> anyhow::Result<std::process::ExitStatus> {
    let torchrun = torchrun(args);
    let mut command = std::process::Command::new(&torchrun);
    command
        .args(["--standalone", "--nproc-per-node"])
        .arg(args.nproc_per_node.to_string());
    let what = match &args.script {
        Some(script) => {
            if !script.is_file() {
                bail!(
                    "--script {}: no such file; give the path of a PyTorch training script \
                     (the README's quick start is one: save it as train.py, or copy \
                     rankscope/examples/train.py from the installed package)",
                    script.display()
                );
            }
            command.arg(script);
            script.display().to_string()
        }
        None => {
            command.args(["-m", EXAMPLE_MODULE]);
            format!("`python -m {EXAMPLE_MODULE}`")
        }
    };
    println!(
        "launching {} PyTorch DDP ranks of {what} under torchrun (run {run_id})",
        args.nproc_per_node
    );
    // A script of the user's gets `--steps` only when asked: it may take no arguments.
    if let Some(steps) = args
        .steps
        .or(args.script.is_none().then_some(EXAMPLE_STEPS))
    {
        command.args(["--steps", &steps.to_string()]);
    }
    command
        .env("RANKSCOPE_COLLECTOR", collector)
        .env("RANKSCOPE_RUN_ID", run_id)
        .env("RANKSCOPE_SAMPLE_EVERY", args.sample_every.to_string())
        .env("RANKSCOPE_OVERHEAD_BUDGET", budget_text(args))
        .env("OMP_NUM_THREADS", "1")
        .status()
        .with_context(|| {
            format!(
                "cannot run {}: install torch in the environment (make setup) or pass --torchrun",
                torchrun.display()
            )
        })
}

/// Without libtorch in this build there are no Rust ranks to launch.
#[cfg(not(feature = "torch"))]
fn run_train(
    _args: &Args,
    _collector: &str,
    _run_id: &str,
) -> anyhow::Result<Vec<std::process::ExitStatus>> {
    bail!(
        "--rust: this rankscope was built without libtorch (the wheel's command is); \
         leave out --rust to run the PyTorch example, or build with `cargo build -p rankscope`"
    )
}

/// `rankscope train` ranks, launched with torchrun's variables.
#[cfg(feature = "torch")]
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
            args.steps.unwrap_or(EXAMPLE_STEPS).to_string(),
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
