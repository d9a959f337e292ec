//! The `rankscope` command, as a library (`main.rs` only calls [`run_from`]): the
//! collector, the load generator, the launcher, the reports and the demo, and (with the
//! `torch` feature) the example training workloads and the offline spectrum tool. Built
//! without `torch` it is the command the wheel installs (`python -m rankscope` execs it).
//!
//! Layout:
//! - `commands`: one module per subcommand, named after it (`commands/collector.rs` is
//!   `rankscope collector`, ...; its header lists them);
//! - `output_query`: SQL over the collector's output directory (DataFusion), for
//!   `summary`, `report` and `compare`;
//! - `example_models`: the example models of `train` and `bench`, and their synthetic
//!   data;
//! - `npy_reader`: reads the `.npy` files that `spectrum` measures;
//! - `duration_arg`: the `10s` / `500ms` argument parser;
//! - `overhead_budget_arg`: the `--overhead-budget` parser of `demo` and `bench`;
//! - [`analysis`]: the jump detector and the run diagnoses, as pure functions over
//!   plain structs (no file formats, no query engine), for `jumps` and for anything
//!   that reports on or compares runs.

pub mod analysis;
mod commands;
mod duration_arg;
#[cfg(feature = "torch")]
mod example_models;
#[cfg(feature = "torch")]
mod npy_reader;
mod output_query;
mod overhead_budget_arg;

use clap::{Parser, Subcommand};

#[cfg(feature = "delta")]
use commands::compact;
#[cfg(feature = "torch")]
use commands::{bench, spectrum, train};
use commands::{collector, compare, demo, jumps, launch, loadgen, replay, report, summary, top};

#[derive(Parser)]
#[command(
    name = "rankscope",
    version,
    about = "Dimensionality, timing and memory telemetry for distributed training",
    after_help = "Examples:
  rankscope demo                                  # 4 PyTorch DDP ranks, embedded collector, summary
  rankscope demo --script train.py                # the same for your script (the README's quick start)
  rankscope collector --out ./rankscope-out       # the central collector
  rankscope collector --http 127.0.0.1:9464       # ... with its live view, then:
  rankscope top --collector 127.0.0.1:9464        # every rank live in the terminal
  rankscope launch --nproc-per-node 4 -- rankscope train --model cnn
  rankscope loadgen --ranks 8 --steps 100 --layers 12 --collector 127.0.0.1:50051
  rankscope report rankscope-out                  # HTML page + diagnoses of the latest run
  rankscope compare RUN_A RUN_B                   # two runs side by side
  rankscope collector --out s3://bucket/rankscope # Delta Lake tables (docs/past-one-machine.md)
  rankscope compact --out s3://bucket/rankscope --run-id RUN   # merge a finished run's files
  rankscope jumps fc1_stable_rank.csv             # level shifts in a step,value series
  duckdb -c \"select rank, count(*) from read_parquet('rankscope-out/steps/*/*.parquet', hive_partitioning=true) group by rank\"

Logs: RANKSCOPE_LOG=debug (tracing's env-filter syntax)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Collector(collector::Args),
    Loadgen(loadgen::Args),
    Launch(launch::Args),
    Replay(replay::Args),
    Summary(summary::Args),
    Report(report::Args),
    Compare(compare::Args),
    #[cfg(feature = "delta")]
    Compact(compact::Args),
    Jumps(jumps::Args),
    Top(top::Args),
    #[cfg(feature = "torch")]
    Train(train::Args),
    Demo(demo::Args),
    #[cfg(feature = "torch")]
    Spectrum(spectrum::Args),
    #[cfg(feature = "torch")]
    Bench(bench::Args),
}

/// The log filter without `RANKSCOPE_LOG`: ours at info; the Delta Lake libraries
/// log a line per request and per snapshot at info, and one per commit race (routine
/// with several collectors) at warn.
pub const DEFAULT_LOG: &str = "info,buoyant_kernel=warn,deltalake_core=error,object_store=warn";

/// Parses `args` (the program name first) and runs the command. Help, version and
/// usage errors print and exit the process, as clap does.
pub fn run_from<I, T>(args: I) -> anyhow::Result<()>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    // Before any TLS client or server is built (see the function).
    #[cfg(feature = "delta")]
    rankscope_collector::delta::choose_tls_provider();
    let cli = Cli::parse_from(args);
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RANKSCOPE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG)),
        )
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal, never in a log file or a journal.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        // A host process (Python) may have installed a subscriber already.
        .try_init()
        .ok();
    match cli.command {
        Command::Collector(args) => collector::run(args),
        Command::Loadgen(args) => loadgen::run(args),
        Command::Launch(args) => launch::run(args),
        Command::Replay(args) => replay::run(args),
        Command::Summary(args) => summary::run(args),
        Command::Report(args) => report::run(args),
        Command::Compare(args) => compare::run(args),
        #[cfg(feature = "delta")]
        Command::Compact(args) => compact::run(args),
        Command::Jumps(args) => jumps::run(args),
        Command::Top(args) => top::run(args),
        #[cfg(feature = "torch")]
        Command::Train(args) => train::run(args),
        Command::Demo(args) => demo::run(args),
        #[cfg(feature = "torch")]
        Command::Spectrum(args) => spectrum::run(args),
        #[cfg(feature = "torch")]
        Command::Bench(args) => bench::run(args),
    }
}
