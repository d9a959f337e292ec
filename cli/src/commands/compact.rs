//! `rankscope compact`: merges the small files of a finished run in every Delta
//! table into one file per table (Delta `OPTIMIZE`), through the collector's
//! `delta::compact`.

use anyhow::Context;
use rankscope_collector::delta::compact::compact_run;
use rankscope_collector::output::{DeltaRoot, Output};
use rankscope_collector::table::Table;

/// Merge a finished run's small files in each Delta table (Delta OPTIMIZE).
#[derive(clap::Args, Clone, Debug)]
#[command(after_help = "Examples:
  rankscope compact --out delta:/data/rankscope --run-id run-1763790000-123
  rankscope compact --out s3://bucket/rankscope --run-id run-1763790000-123

Each table's files of the run become one file, in one Delta transaction per table; readers
see the same rows before and after. The old files stay on storage, unreferenced, until a
VACUUM older than its retention deletes them (docs/past-one-machine.md). Compact runs that
have finished: files a collector adds meanwhile stay as they are.")]
pub struct Args {
    /// The collector's Delta tables: `delta:PATH` or an object store URL
    /// (`s3://BUCKET/PREFIX`, `gs://…`, `az://…`).
    #[arg(long, value_parser = Output::parse)]
    pub out: Output,
    /// The run whose files to merge.
    #[arg(long)]
    pub run_id: String,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let root: DeltaRoot = match args.out {
        Output::Delta(root) => root,
        Output::Dir(dir) => anyhow::bail!(
            "--out {} is a folder of Parquet files, not Delta tables: compact works on \
             delta:PATH or s3://BUCKET/PREFIX",
            dir.display()
        ),
    };
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    let mut files = 0;
    for table in Table::ALL {
        let done = runtime
            .block_on(compact_run(
                &root,
                table,
                &args.run_id,
                rankscope_collector::CollectorConfig::DEFAULT_ROW_GROUP_ROWS,
            ))
            .with_context(|| format!("cannot compact table {} under {root}", table.name()))?;
        println!(
            "{}: {} files -> {} ({} rows rewritten)",
            table.name(),
            done.files_before,
            done.files_after,
            done.rows
        );
        files += done.files_before;
    }
    if files == 0 {
        // A mistyped run id would otherwise look like a finished compaction.
        anyhow::bail!(
            "no table under {root} holds a file of run {}: check --run-id \
             (`rankscope summary --out {root}` names the latest run and lists them all \
             when given one that is not there)",
            args.run_id
        );
    }
    Ok(())
}
