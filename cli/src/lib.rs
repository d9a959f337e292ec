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
mod bytes_arg;
mod commands;
mod duration_arg;
#[cfg(feature = "torch")]
mod example_models;
#[cfg(feature = "torch")]
mod npy_reader;
mod output_query;
mod overhead_budget_arg;
mod run_id_arg;

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
  rankscope launch --nproc-per-node 4 -- python train.py  # torchrun's variables, no torchrun
  rankscope loadgen --ranks 8 --steps 100 --layers 12 --collector 127.0.0.1:50051
  rankscope report rankscope-out                  # HTML page + diagnoses of the latest run
  rankscope compare RUN_A RUN_B                   # two runs side by side
  rankscope collector --out s3://bucket/rankscope # Delta Lake tables (docs/past-one-machine.md)
  rankscope compact --out s3://bucket/rankscope --run-id RUN   # merge a finished run's files
  rankscope jumps stable_rank.csv                 # level shifts in a step,value series
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
    // A build without libtorch (the wheel's command) names what it lacks, rather than
    // clap's "unrecognized subcommand".
    #[cfg(not(feature = "torch"))]
    #[command(hide = true)]
    Train(NeedsTorch),
    #[cfg(not(feature = "torch"))]
    #[command(hide = true)]
    Spectrum(NeedsTorch),
    #[cfg(not(feature = "torch"))]
    #[command(hide = true)]
    Bench(NeedsTorch),
}

/// Whatever follows a command that this build lacks.
#[cfg(not(feature = "torch"))]
#[derive(clap::Args)]
struct NeedsTorch {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    _args: Vec<std::ffi::OsString>,
}

/// The error for `rankscope <command>` in a build without libtorch.
#[cfg(not(feature = "torch"))]
fn needs_torch(command: &str) -> anyhow::Result<()> {
    anyhow::bail!(
        "`rankscope {command}` runs on libtorch, and this rankscope was built without it (the \
         wheel's command is): build it with `cargo build --release -p rankscope` (docs/running.md). \
         For a PyTorch script: `rankscope demo --script train.py` or \
         `rankscope launch --nproc-per-node N -- python train.py`"
    )
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
        #[cfg(not(feature = "torch"))]
        Command::Train(_) => needs_torch("train"),
        #[cfg(not(feature = "torch"))]
        Command::Spectrum(_) => needs_torch("spectrum"),
        #[cfg(not(feature = "torch"))]
        Command::Bench(_) => needs_torch("bench"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, String> {
        Cli::try_parse_from(std::iter::once("rankscope").chain(args.iter().copied()))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn summary_and_report_read_the_output_and_run_alike() {
        for command in ["summary", "report"] {
            for args in [
                &[command, "out-dir", "--run-id", "r"][..],
                &[command, "--out", "out-dir", "--run", "r"],
            ] {
                let input = match parse(args).unwrap().command {
                    Command::Summary(a) => a.input,
                    Command::Report(a) => a.input,
                    _ => unreachable!(),
                };
                assert_eq!(input.out(), std::path::PathBuf::from("out-dir"), "{args:?}");
                assert_eq!(input.run_id.as_deref(), Some("r"), "{args:?}");
            }
            let error = parse(&[command, "a", "--out", "b"]).err().unwrap();
            assert!(error.contains("cannot be used with"), "{error}");
        }
    }

    #[test]
    fn demo_refuses_zero_ranks_and_a_zero_interval() {
        for (flag, named) in [
            ("--nproc-per-node", "'0' for '--nproc-per-node"),
            ("--sample-every", "'0' for '--sample-every"),
        ] {
            let error = parse(&["demo", flag, "0"]).err().unwrap();
            assert!(
                error.contains(named) && error.contains("0 is not in 1.."),
                "{error}"
            );
        }
    }
}
