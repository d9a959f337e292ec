//! The `rankscope` command: the collector, the load generator, and (with the
//! `torch` feature) the example training workloads, the launcher and the demo.
//!
//! Layout:
//! - `collector_cmd`: `rankscope collector`;
//! - `loadgen`: `rankscope loadgen`, simulated ranks on the real protocol;
//! - `duration`: the `10s` / `500ms` argument parser.

mod collector_cmd;
mod duration;
mod loadgen;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "rankscope",
    version,
    about = "Dimensionality, timing and memory telemetry for distributed training",
    after_help = "Examples:
  rankscope collector --out ./rankscope-out
  rankscope loadgen --ranks 8 --steps 100 --layers 12 --collector 127.0.0.1:50051
  duckdb -c \"select rank, count(*) from read_parquet('rankscope-out/steps/*/*.parquet', hive_partitioning=true) group by rank\""
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Collector(collector_cmd::Args),
    Loadgen(loadgen::Args),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RANKSCOPE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Collector(args) => collector_cmd::run(args),
        Command::Loadgen(args) => loadgen::run(args),
    }
}
