//! `rankscope summary`: a run's summary read back from the collector's Parquet
//! files: per rank its steps, mean step time and agent overhead; per layer its
//! latest stable and effective rank and their trend since the first sample.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::Context;
use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{Float64Type, Int64Type, UInt32Type, UInt64Type};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

/// Summarise a run from the collector's output.
#[derive(clap::Args, Clone, Debug)]
#[command(after_help = "Examples:
  rankscope summary --out rankscope-out --run-id run-1763790000-123")]
pub struct Args {
    /// The collector's output directory.
    #[arg(long, default_value = "rankscope-out")]
    pub out: PathBuf,
    /// The run to summarise.
    #[arg(long)]
    pub run_id: String,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    print!("{}", summarise(&args.out, &args.run_id)?);
    Ok(())
}

fn batches(out: &Path, table: &str, run_id: &str) -> anyhow::Result<Vec<RecordBatch>> {
    let dir = out.join(table).join(format!("run_id={run_id}"));
    let mut all = Vec::new();
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Ok(all);
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "parquet") {
            continue;
        }
        let file = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
        let reader = ParquetRecordBatchReaderBuilder::try_new(file)
            .with_context(|| format!("reading {}", path.display()))?
            .build()?;
        for batch in reader {
            all.push(batch?);
        }
    }
    Ok(all)
}

fn f64s(b: &RecordBatch, name: &str) -> Vec<Option<f64>> {
    b.column_by_name(name)
        .map(|c| c.as_primitive::<Float64Type>().iter().collect())
        .unwrap_or_else(|| vec![None; b.num_rows()])
}

fn u32s(b: &RecordBatch, name: &str) -> Vec<u32> {
    b.column_by_name(name)
        .map(|c| c.as_primitive::<UInt32Type>().values().to_vec())
        .unwrap_or_default()
}

fn u64s(b: &RecordBatch, name: &str) -> Vec<u64> {
    b.column_by_name(name)
        .map(|c| c.as_primitive::<UInt64Type>().values().to_vec())
        .unwrap_or_default()
}

#[derive(Default)]
struct RankStats {
    steps: u64,
    step_ms: f64,
    overhead_ms: f64,
    /// (sum, steps that have it) of `comm_ms`.
    comm_ms: (f64, u64),
    samples_dropped: i64,
}

/// The summary text of `run_id`.
pub fn summarise(out: &Path, run_id: &str) -> anyhow::Result<String> {
    let mut ranks: BTreeMap<u32, RankStats> = BTreeMap::new();
    for b in batches(out, "steps", run_id)? {
        let (rank, step_ms, overhead, comm) = (
            u32s(&b, "rank"),
            f64s(&b, "step_ms"),
            f64s(&b, "overhead_ms"),
            f64s(&b, "comm_ms"),
        );
        for i in 0..b.num_rows() {
            let s = ranks.entry(rank[i]).or_default();
            s.steps += 1;
            s.step_ms += step_ms[i].unwrap_or(0.0);
            s.overhead_ms += overhead[i].unwrap_or(0.0);
            if let Some(c) = comm[i] {
                s.comm_ms.0 += c;
                s.comm_ms.1 += 1;
            }
        }
    }
    for b in batches(out, "events", run_id)? {
        let (rank, value) = (u32s(&b, "rank"), b.column_by_name("value"));
        let (Some(kinds), Some(value)) = (b.column_by_name("kind"), value) else {
            continue;
        };
        let (kinds, value) = (kinds.as_string::<i32>(), value.as_primitive::<Int64Type>());
        for (i, &rank) in rank.iter().enumerate() {
            if kinds.value(i) == "samples_dropped" && value.is_valid(i) {
                ranks.entry(rank).or_default().samples_dropped += value.value(i);
            }
        }
    }
    // layer -> step -> (sum stable, sum effective, n)
    let mut layers: BTreeMap<String, BTreeMap<u64, (f64, f64, u32)>> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    for b in batches(out, "layers", run_id)? {
        let names = b
            .column_by_name("layer")
            .context("layers has a layer column")?;
        let names = names.as_string::<i32>();
        let (step, stable, effective) = (
            u64s(&b, "step"),
            f64s(&b, "stable_rank"),
            f64s(&b, "effective_rank"),
        );
        for i in 0..b.num_rows() {
            let name = names.value(i).to_string();
            if !order.contains(&name) {
                order.push(name.clone());
            }
            let (Some(s), Some(e)) = (stable[i], effective[i]) else {
                continue;
            };
            let slot = layers.entry(name).or_default().entry(step[i]).or_default();
            slot.0 += s;
            slot.1 += e;
            slot.2 += 1;
        }
    }
    let mut text = format!("run {run_id}\n\n");
    text += "rank   steps   mean step ms   mean comm ms   overhead %   samples dropped\n";
    for (rank, s) in &ranks {
        let mean = s.step_ms / s.steps.max(1) as f64;
        let comm = match s.comm_ms {
            (_, 0) => "-".to_string(),
            (sum, n) => format!("{:.3}", sum / n as f64),
        };
        let pct = 100.0 * s.overhead_ms / s.step_ms.max(f64::MIN_POSITIVE);
        text += &format!(
            "{rank:>4}   {:>5}   {mean:>12.3}   {comm:>12}   {pct:>10.3}   {:>15}\n",
            s.steps, s.samples_dropped
        );
    }
    if ranks.values().any(|s| s.comm_ms.1 > 0) {
        text += "(comm ms: all-reduce launch to completion; the rank that waits least is the one the others wait for)\n";
    }
    if ranks.values().any(|s| s.samples_dropped > 0) {
        text += "(samples dropped: the metrics threads had no spare CPU time; see RANKSCOPE_WORKER_PRIORITY)\n";
    }
    text += "\nlayer            stable rank   effective rank   trend (stable rank since first sample)\n";
    for name in &order {
        let Some(steps) = layers.get(name) else {
            text += &format!(
                "{name:<16} {:>11}   {:>14}   (no finite sample)\n",
                "-", "-"
            );
            continue;
        };
        let mean = |v: &(f64, f64, u32)| (v.0 / v.2 as f64, v.1 / v.2 as f64);
        let (first, last) = (steps.values().next(), steps.values().last());
        let (Some(first), Some(last)) = (first, last) else {
            continue;
        };
        let ((s0, _), (s1, e1)) = (mean(first), mean(last));
        let change = if s0 > 0.0 {
            100.0 * (s1 - s0) / s0
        } else {
            0.0
        };
        let arrow = if change > 5.0 {
            "up"
        } else if change < -5.0 {
            "down"
        } else {
            "flat"
        };
        text += &format!(
            "{name:<16} {s1:>11.3}   {e1:>14.3}   {arrow} {change:+.1}% over {} samples\n",
            steps.len()
        );
    }
    Ok(text)
}
