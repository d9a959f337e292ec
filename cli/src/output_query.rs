//! The query layer: SQL over the collector's output directory through DataFusion.
//!
//! Each of the seven tables is registered as a listing table over its folder
//! (`OUT/<table>/run_id=<run>/part-*.parquet`), with the schema the collector of
//! this release writes. Older files that lack a newer column read it as null, and
//! a column of another type is an error naming it. Only committed `*.parquet`
//! files are read (files being written end in `.tmp`), so a report works while the
//! run is still going. `run_id` is a column of every file, so it is not declared
//! as a partition column.
//!
//! A Delta output (`delta:PATH`, `s3://BUCKET/PREFIX`) is read through the
//! collector's Delta reader into memory tables of the same schema.
//!
//! [`Dataset::run_data`] reads a run into the plain rows the diagnoses take
//! ([`RunData`]); `summary`, `report` and `compare` run their aggregates as SQL.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, anyhow};
use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Float32Type, Float64Type, Int64Type, UInt64Type};
use datafusion::datasource::MemTable;
use datafusion::prelude::{ParquetReadOptions, SessionConfig, SessionContext};
use rankscope_collector::output::{DeltaRoot, Output};
use rankscope_collector::table::{self, Table};

use crate::analysis::agent_cost::{self, AgentCost};
use crate::analysis::diagnoses::{self, EventRecord, LayerRecord, RankInfo, RunData, StepRecord};

/// Where `summary` and `report` read: the collector's output, given as `OUT` or as
/// `--out OUT` (the collector's own flag), and the run in it.
#[derive(clap::Args, Clone, Debug)]
pub struct RunArgs {
    /// The collector's output directory, or its Delta tables (`delta:PATH`,
    /// `s3://BUCKET/PREFIX`) [default: rankscope-out].
    #[arg(value_name = "OUT")]
    out_given: Option<PathBuf>,
    /// The same as OUT.
    #[arg(long = "out", value_name = "OUT", conflicts_with = "out_given")]
    out_flag: Option<PathBuf>,
    /// The run (default: the latest run).
    #[arg(long, visible_alias = "run")]
    pub run_id: Option<String>,
}

impl RunArgs {
    /// The output given, or the collector's default.
    pub fn out(&self) -> PathBuf {
        self.out_given
            .clone()
            .or_else(|| self.out_flag.clone())
            .unwrap_or_else(|| rankscope_collector::CollectorConfig::DEFAULT_OUT.into())
    }
}

/// The collector's output directory, open for SQL.
pub struct Dataset {
    ctx: SessionContext,
    runtime: tokio::runtime::Runtime,
    out: PathBuf,
}

/// What a rank's agents reported in `events` ([`Dataset::rank_events`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RankEvents {
    /// Activation samples taken but not measured (`samples_dropped`).
    pub samples_dropped: i64,
    /// Planned samples not taken (`samples_skipped`).
    pub samples_skipped: i64,
    /// Rows lost from full queues (`rows_dropped`).
    pub rows_dropped: i64,
    /// The agent's share of the process's CPU time, a fraction (`overhead_share`).
    pub cpu_share: Option<f64>,
}

impl RankEvents {
    /// [`RankEvents::cpu_share`] in percent, as `summary` and `report` show it.
    pub fn cpu_pct(&self) -> Option<f64> {
        self.cpu_share.map(|c| 100.0 * c)
    }
}

/// A run of the output directory, from its `runs` row or, while rank 0 has not
/// been seen, from its other tables.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunInfo {
    pub run_id: String,
    pub world_size: Option<u64>,
    pub mode: Option<String>,
    pub sample_every: Option<u64>,
    pub workload: Option<String>,
    pub started_at: Option<String>,
}

/// A SQL string literal.
pub fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

impl Dataset {
    /// Opens `out`, the output directory of one or more collectors, or their
    /// Delta tables (`delta:PATH`, `s3://BUCKET/PREFIX`).
    pub fn open(out: &Path) -> anyhow::Result<Dataset> {
        if let Some(Output::Delta(root)) = out.to_str().and_then(|t| Output::parse(t).ok()) {
            return Dataset::open_delta(out, &root);
        }
        if !out.is_dir() {
            anyhow::bail!(
                "{} is not a directory: pass the collector's --out directory",
                out.display()
            );
        }
        let out = out
            .canonicalize()
            .with_context(|| format!("cannot resolve {}", out.display()))?;
        if out.to_str().is_none() {
            anyhow::bail!(
                "{} is not valid UTF-8, and the query engine reads a folder by its name as text: \
                 rename the folder, or link to it from a name that is",
                out.display()
            );
        }
        let (ctx, runtime) = Dataset::session()?;
        for table in Table::ALL {
            let schema = table::schema(table);
            let dir = out.join(table.name());
            let files = parquet_files(&dir);
            for file in &files {
                check_parquet(file)?;
            }
            let has_files = !files.is_empty();
            let name = table.name();
            runtime
                .block_on(async {
                    if has_files {
                        let url = format!("{}/", dir.display());
                        let options = ParquetReadOptions {
                            schema: Some(&schema),
                            ..Default::default()
                        };
                        ctx.register_parquet(name, &url, options).await
                    } else {
                        // No rows yet: the same columns, empty, so queries still plan.
                        let empty = MemTable::try_new(schema.clone(), vec![vec![]])?;
                        ctx.register_table(name, Arc::new(empty)).map(|_| ())
                    }
                })
                .with_context(|| format!("cannot open table {name} under {}", out.display()))?;
        }
        Ok(Dataset { ctx, runtime, out })
    }

    /// Opens the Delta tables under `root`: each read whole into memory (through
    /// [`rankscope_collector::delta::read::read_table`], the files of the table's
    /// current version), as the reports read a run whole anyway.
    #[cfg(feature = "delta")]
    fn open_delta(out: &Path, root: &DeltaRoot) -> anyhow::Result<Dataset> {
        let (ctx, runtime) = Dataset::session()?;
        for table in Table::ALL {
            let name = table.name();
            let batches = runtime
                .block_on(rankscope_collector::delta::read::read_table(root, table))
                .with_context(|| format!("cannot read the Delta table {name} under {root}"))?;
            let memory = MemTable::try_new(table::schema(table), vec![batches])?;
            ctx.register_table(name, Arc::new(memory))?;
        }
        Ok(Dataset {
            ctx,
            runtime,
            out: out.to_path_buf(),
        })
    }

    #[cfg(not(feature = "delta"))]
    fn open_delta(_out: &Path, root: &DeltaRoot) -> anyhow::Result<Dataset> {
        anyhow::bail!(
            "--out {root} is a Delta table root, but this rankscope was built without Delta \
             support: build it with `--features delta`"
        )
    }

    /// The query session and the runtime that drives it.
    fn session() -> anyhow::Result<(SessionContext, tokio::runtime::Runtime)> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the query runtime")?;
        let config = SessionConfig::new()
            .with_target_partitions(std::thread::available_parallelism().map_or(1, |n| n.get()));
        Ok((SessionContext::new_with_config(config), runtime))
    }

    /// Runs one SQL query and collects its result.
    pub fn sql(&self, query: &str) -> anyhow::Result<Vec<RecordBatch>> {
        self.runtime
            .block_on(async {
                let frame = self.ctx.sql(query).await?;
                frame.collect().await
            })
            .map_err(|e| {
                anyhow!(
                    "query failed under {}: {e} (are these the files of a rankscope collector of this release?)",
                    self.out.display()
                )
            })
    }

    /// Every run in the directory, oldest first.
    pub fn runs(&self) -> anyhow::Result<Vec<RunInfo>> {
        let batches = self.sql(
            "WITH seen AS (
                 SELECT run_id FROM steps UNION SELECT run_id FROM layers
                 UNION SELECT run_id FROM runs UNION SELECT run_id FROM events)
             SELECT seen.run_id,
                    CAST(max(r.world_size) AS BIGINT) AS world_size,
                    max(r.mode) AS mode,
                    CAST(max(r.sample_every) AS BIGINT) AS sample_every,
                    max(r.workload) AS workload,
                    CAST(min(r.started_at) AS VARCHAR) AS started_at,
                    min(r.started_at) AS t
             FROM seen LEFT JOIN runs r ON r.run_id = seen.run_id
             GROUP BY seen.run_id
             ORDER BY t NULLS LAST, seen.run_id",
        )?;
        let mut runs = Vec::new();
        for b in &batches {
            let ids = strings(b, "run_id")?;
            let world = ints(b, "world_size")?;
            let mode = strings(b, "mode")?;
            let every = ints(b, "sample_every")?;
            let workload = strings(b, "workload")?;
            let started = strings(b, "started_at")?;
            for i in 0..b.num_rows() {
                let Some(run_id) = ids[i].clone() else {
                    continue;
                };
                runs.push(RunInfo {
                    run_id,
                    world_size: world[i].map(|v| v as u64),
                    mode: mode[i].clone(),
                    sample_every: every[i].map(|v| v as u64),
                    workload: workload[i].clone().filter(|w| !w.is_empty()),
                    started_at: started[i].clone(),
                });
            }
        }
        Ok(runs)
    }

    /// The run `run_id`, or the latest run when `None`; an error lists the runs
    /// there are when it is not found.
    pub fn run(&self, run_id: Option<&str>) -> anyhow::Result<RunInfo> {
        let runs = self.runs()?;
        match run_id {
            None => runs.last().cloned().ok_or_else(|| {
                anyhow!(
                    "{} holds no run yet: give the directory a collector writes (its --out)",
                    self.out.display()
                )
            }),
            Some(id) => runs
                .iter()
                .find(|r| r.run_id == id)
                .cloned()
                .ok_or_else(|| {
                    let known: Vec<&str> = runs.iter().map(|r| r.run_id.as_str()).collect();
                    anyhow!(
                        "run {id:?} is not in {}; runs there: {}",
                        self.out.display(),
                        if known.is_empty() {
                            "none".to_string()
                        } else {
                            known.join(", ")
                        }
                    )
                }),
        }
    }

    /// The agents' overhead budget of `run_id` as a fraction
    /// (`runs.overhead_budget`), when the run recorded it.
    pub fn overhead_budget(&self, run_id: &str) -> anyhow::Result<Option<f64>> {
        let mut budget = None;
        for b in &self.sql(&format!(
            "SELECT max(overhead_budget) AS overhead_budget FROM runs WHERE run_id = {}",
            literal(run_id)
        ))? {
            budget = budget.or(floats(b, "overhead_budget")?.into_iter().flatten().next());
        }
        Ok(budget)
    }

    /// Per rank of `run_id`, what its agents reported in `events`: the counts of
    /// samples dropped and skipped and of rows dropped, and the agent's share of
    /// the process's CPU time (the largest `overhead_share`, as
    /// [`crate::analysis::diagnoses::cpu_shares`] reads it).
    pub fn rank_events(&self, run_id: &str) -> anyhow::Result<BTreeMap<i64, RankEvents>> {
        use rankscope_agent::event_kind::{
            OVERHEAD_SHARE, ROWS_DROPPED, SAMPLES_DROPPED, SAMPLES_SKIPPED,
        };
        let mut out = BTreeMap::new();
        for b in &self.sql(&format!(
            "SELECT CAST(rank AS BIGINT) AS rank,
                    CAST(sum(CASE WHEN kind = '{SAMPLES_DROPPED}' THEN value ELSE 0 END) AS BIGINT) AS samples_dropped,
                    CAST(sum(CASE WHEN kind = '{SAMPLES_SKIPPED}' THEN value ELSE 0 END) AS BIGINT) AS samples_skipped,
                    CAST(sum(CASE WHEN kind = '{ROWS_DROPPED}' THEN value ELSE 0 END) AS BIGINT) AS rows_dropped,
                    CAST(max(CASE WHEN kind = '{OVERHEAD_SHARE}' THEN value END) AS BIGINT) AS cpu_millionths
             FROM events WHERE run_id = {} GROUP BY rank",
            literal(run_id)
        ))? {
            let rank = ints(b, "rank")?;
            let (dropped, skipped) = (ints(b, "samples_dropped")?, ints(b, "samples_skipped")?);
            let (rows, cpu) = (ints(b, "rows_dropped")?, ints(b, "cpu_millionths")?);
            for i in 0..b.num_rows() {
                out.insert(
                    rank[i].unwrap_or_default(),
                    RankEvents {
                        samples_dropped: dropped[i].unwrap_or_default(),
                        samples_skipped: skipped[i].unwrap_or_default(),
                        rows_dropped: rows[i].unwrap_or_default(),
                        cpu_share: cpu[i].and_then(diagnoses::share_of_millionths),
                    },
                );
            }
        }
        Ok(out)
    }

    /// Per rank of `run_id`, what the agent cost it on each share of its budget
    /// ([`crate::analysis::agent_cost`]), from its `steps` rows.
    pub fn agent_costs(&self, run_id: &str) -> anyhow::Result<BTreeMap<u32, AgentCost>> {
        let mut steps = Vec::new();
        for b in &self.sql(&format!(
            "SELECT CAST(rank AS BIGINT) AS rank, step_ms, overhead_ms,
                    overhead_device_ms, overhead_observed_ms
             FROM steps WHERE run_id = {}",
            literal(run_id)
        ))? {
            let rank = ints(b, "rank")?;
            let (step_ms, over) = (floats(b, "step_ms")?, floats(b, "overhead_ms")?);
            let device = floats(b, "overhead_device_ms")?;
            let observed = floats(b, "overhead_observed_ms")?;
            for i in 0..b.num_rows() {
                steps.push(StepRecord {
                    rank: rank[i].unwrap_or_default() as u32,
                    step_ms: step_ms[i].unwrap_or_default(),
                    overhead_ms: over[i].unwrap_or_default(),
                    overhead_device_ms: device[i],
                    overhead_observed_ms: observed[i],
                    ..StepRecord::default()
                });
            }
        }
        Ok(agent_cost::rank_costs(&steps))
    }

    /// The rows of `run_id` that the diagnoses read.
    pub fn run_data(&self, run_id: &str) -> anyhow::Result<RunData> {
        let id = literal(run_id);
        let mut run = RunData {
            overhead_budget: self.overhead_budget(run_id)?,
            ..RunData::default()
        };
        // Ranks: the `ranks` rows (sent at finish), plus every rank seen in
        // `steps` so a run still going is covered.
        for b in &self.sql(&format!(
            "SELECT CAST(s.rank AS BIGINT) AS rank_id,
                    CAST(max(r.node_rank) AS BIGINT) AS node_rank,
                    max(r.hostname) AS hostname
             FROM (SELECT DISTINCT rank FROM steps WHERE run_id = {id}
                   UNION SELECT rank FROM ranks WHERE run_id = {id}) s
             LEFT JOIN ranks r ON r.run_id = {id} AND r.rank = s.rank
             GROUP BY s.rank ORDER BY rank_id"
        ))? {
            let (rank, node, host) = (
                ints(b, "rank_id")?,
                ints(b, "node_rank")?,
                strings(b, "hostname")?,
            );
            for i in 0..b.num_rows() {
                run.ranks.push(RankInfo {
                    rank: rank[i].unwrap_or_default() as u32,
                    node_rank: node[i].unwrap_or_default() as u32,
                    hostname: host[i].clone().unwrap_or_default(),
                });
            }
        }
        for b in &self.sql(&format!(
            // A step's communication time: DDP's all-reduce (`steps.comm_ms`), else
            // every collective of the step (`comm`, FSDP's all-gathers and
            // reduce-scatters among them).
            "SELECT CAST(s.rank AS BIGINT) AS rank, CAST(s.step AS BIGINT) AS step,
                    s.step_ms, s.data_ms, s.forward_ms, s.backward_ms, s.optimizer_ms,
                    coalesce(s.comm_ms, c.comm_ms) AS comm_ms,
                    s.overhead_ms, s.overhead_device_ms, s.overhead_observed_ms,
                    s.loss, s.grad_norm,
                    CAST(s.rss_bytes AS BIGINT) AS rss_bytes,
                    CAST(s.device_allocated_bytes AS BIGINT) AS device_allocated_bytes
             FROM steps s
             LEFT JOIN (SELECT rank, step, sum(comm_ms) AS comm_ms FROM comm
                        WHERE run_id = {id} AND step IS NOT NULL GROUP BY rank, step) c
               ON c.rank = s.rank AND c.step = s.step
             WHERE s.run_id = {id} ORDER BY rank, step"
        ))? {
            let rank = ints(b, "rank")?;
            let step = ints(b, "step")?;
            let [
                step_ms,
                data,
                fwd,
                bwd,
                opt,
                comm,
                over,
                over_dev,
                over_obs,
                loss,
                gn,
            ] = [
                "step_ms",
                "data_ms",
                "forward_ms",
                "backward_ms",
                "optimizer_ms",
                "comm_ms",
                "overhead_ms",
                "overhead_device_ms",
                "overhead_observed_ms",
                "loss",
                "grad_norm",
            ]
            .map(|c| floats(b, c));
            let (rss, dev) = (ints(b, "rss_bytes")?, ints(b, "device_allocated_bytes")?);
            let (step_ms, data, fwd, bwd, opt) = (step_ms?, data?, fwd?, bwd?, opt?);
            let (comm, over, loss, gn) = (comm?, over?, loss?, gn?);
            let (over_dev, over_obs) = (over_dev?, over_obs?);
            for i in 0..b.num_rows() {
                run.steps.push(StepRecord {
                    rank: rank[i].unwrap_or_default() as u32,
                    step: step[i].unwrap_or_default() as u64,
                    step_ms: step_ms[i].unwrap_or_default(),
                    data_ms: data[i],
                    forward_ms: fwd[i],
                    backward_ms: bwd[i],
                    optimizer_ms: opt[i],
                    comm_ms: comm[i],
                    overhead_ms: over[i].unwrap_or_default(),
                    overhead_device_ms: over_dev[i],
                    overhead_observed_ms: over_obs[i],
                    loss: loss[i],
                    grad_norm: gn[i],
                    rss_bytes: rss[i].map(|v| v as u64),
                    device_allocated_bytes: dev[i].map(|v| v as u64),
                });
            }
        }
        for b in &self.sql(&format!(
            "SELECT CAST(rank AS BIGINT) AS rank, CAST(step AS BIGINT) AS step, layer,
                    stable_rank, effective_rank, zero_fraction,
                    CAST(nonfinite AS BIGINT) AS nonfinite, compute_ms
             FROM layers WHERE run_id = {id} ORDER BY layer, rank, step"
        ))? {
            let (rank, step, layer) = (ints(b, "rank")?, ints(b, "step")?, strings(b, "layer")?);
            let (stable, effective) = (floats(b, "stable_rank")?, floats(b, "effective_rank")?);
            let (zero, nonfinite) = (floats(b, "zero_fraction")?, ints(b, "nonfinite")?);
            let compute = floats(b, "compute_ms")?;
            for i in 0..b.num_rows() {
                run.layers.push(LayerRecord {
                    rank: rank[i].unwrap_or_default() as u32,
                    step: step[i].unwrap_or_default() as u64,
                    layer: layer[i].clone().unwrap_or_default(),
                    stable_rank: stable[i],
                    effective_rank: effective[i],
                    zero_fraction: zero[i],
                    nonfinite: nonfinite[i].unwrap_or_default() as u64,
                    compute_ms: compute[i],
                });
            }
        }
        for b in &self.sql(&format!(
            "SELECT CAST(rank AS BIGINT) AS rank, kind, value, CAST(step AS BIGINT) AS step,
                    message
             FROM events WHERE run_id = {id} ORDER BY rank, time"
        ))? {
            let (rank, kind) = (ints(b, "rank")?, strings(b, "kind")?);
            let (value, step) = (ints(b, "value")?, ints(b, "step")?);
            let message = strings(b, "message")?;
            for i in 0..b.num_rows() {
                run.events.push(EventRecord {
                    rank: rank[i].unwrap_or_default() as u32,
                    kind: kind[i].clone().unwrap_or_default(),
                    value: value[i],
                    step: step[i].map(|v| v as u64),
                    message: message[i].clone(),
                });
            }
        }
        Ok(run)
    }
}

/// Whether `dir` holds a committed Parquet file at any depth.
/// The `*.parquet` files under `dir`, at any depth.
fn parquet_files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files = Vec::new();
    for path in entries.flatten().map(|e| e.path()) {
        if path.is_dir() {
            files.extend(parquet_files(&path));
        } else if path.extension().is_some_and(|x| x == "parquet") {
            files.push(path);
        }
    }
    files
}

/// Checks that `path` is a whole Parquet file: the magic at both ends and a footer
/// that fits. A damaged file otherwise reads as no rows, or panics in the reader.
fn check_parquet(path: &Path) -> anyhow::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    const MAGIC: &[u8; 4] = b"PAR1";
    let damaged = |why: String| {
        anyhow!(
            "{} is not a whole Parquet file ({why}): move it out of the output directory \
             (a collector writes each file whole and then renames it, so it was damaged or \
             put there since)",
            path.display()
        )
    };
    let mut file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let len = file
        .metadata()
        .with_context(|| format!("cannot read {}", path.display()))?
        .len();
    if len < 12 {
        return Err(damaged(format!("{len} bytes")));
    }
    let mut head = [0u8; 4];
    let mut tail = [0u8; 8];
    file.read_exact(&mut head)
        .and_then(|()| file.seek(SeekFrom::End(-8)).map(|_| ()))
        .and_then(|()| file.read_exact(&mut tail))
        .with_context(|| format!("cannot read {}", path.display()))?;
    let footer = u64::from(u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]));
    if &head != MAGIC || &tail[4..] != MAGIC {
        return Err(damaged("no PAR1 magic at its start and end".into()));
    }
    if footer + 12 > len {
        return Err(damaged(format!(
            "its footer claims {footer} bytes of a {len}-byte file"
        )));
    }
    Ok(())
}

fn column<'a>(b: &'a RecordBatch, name: &str) -> anyhow::Result<&'a dyn Array> {
    b.column_by_name(name)
        .map(|c| c.as_ref())
        .ok_or_else(|| anyhow!("the query result has no column {name}"))
}

fn wrong(name: &str, found: &DataType, want: &str) -> anyhow::Error {
    anyhow!("the query result's column {name} is {found}, not {want}")
}

/// A Float64 (or Float32) column of a query result, as f64.
pub fn floats(b: &RecordBatch, name: &str) -> anyhow::Result<Vec<Option<f64>>> {
    let c = column(b, name)?;
    if let Some(a) = c.as_primitive_opt::<Float32Type>() {
        return Ok(a.iter().map(|v| v.map(f64::from)).collect());
    }
    Ok(c.as_primitive_opt::<Float64Type>()
        .ok_or_else(|| wrong(name, c.data_type(), "Float64"))?
        .iter()
        .collect())
}

/// An Int64 (or UInt64) column of a query result, as i64.
pub fn ints(b: &RecordBatch, name: &str) -> anyhow::Result<Vec<Option<i64>>> {
    let c = column(b, name)?;
    if let Some(a) = c.as_primitive_opt::<Int64Type>() {
        return Ok(a.iter().collect());
    }
    Ok(c.as_primitive_opt::<UInt64Type>()
        .ok_or_else(|| wrong(name, c.data_type(), "Int64"))?
        .iter()
        .map(|v| v.map(|v| i64::try_from(v).unwrap_or(i64::MAX)))
        .collect())
}

/// A string column of a query result (Utf8, Utf8View or a dictionary of them).
pub fn strings(b: &RecordBatch, name: &str) -> anyhow::Result<Vec<Option<String>>> {
    let c = column(b, name)?;
    let cast = arrow::compute::cast(c, &DataType::Utf8)
        .map_err(|_| wrong(name, c.data_type(), "a string"))?;
    Ok(cast
        .as_string::<i32>()
        .iter()
        .map(|v| v.map(str::to_string))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_are_quoted() {
        assert_eq!(literal("a'b"), "'a''b'");
    }

    #[test]
    fn a_missing_or_empty_directory_is_a_clear_error_or_empty() {
        let err = Dataset::open(Path::new("/nonexistent/rankscope-out"))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("is not a directory"), "{err}");
        let empty = tempfile::tempdir().unwrap();
        let data = Dataset::open(empty.path()).unwrap();
        assert!(data.runs().unwrap().is_empty());
        let err = data.run(None).unwrap_err().to_string();
        assert!(err.contains("holds no run yet"), "{err}");
    }

    #[test]
    fn a_damaged_parquet_file_is_an_error_naming_it() {
        let out = tempfile::tempdir().unwrap();
        let dir = out.path().join("steps/run_id=r");
        std::fs::create_dir_all(&dir).unwrap();
        for (bytes, why) in [
            (&b""[..], "0 bytes"),
            (b"PAR1garbagePAR1", "footer claims"),
            (b"not a parquet file at all", "no PAR1 magic"),
        ] {
            let file = dir.join("part-1.parquet");
            std::fs::write(&file, bytes).unwrap();
            let err = Dataset::open(out.path()).err().unwrap().to_string();
            assert!(
                err.contains("part-1.parquet is not a whole Parquet file") && err.contains(why),
                "{err}"
            );
        }
    }
}
