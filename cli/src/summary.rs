//! `rankscope summary`: a run's summary read back from the collector's Parquet
//! files: per rank its steps, mean step time and agent overhead; per layer its
//! latest stable and effective rank and their trend since the first sample.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::Context;
use arrow::array::{ArrayRef, AsArray, RecordBatch};
use arrow::datatypes::{Float64Type, Int64Type, UInt32Type, UInt64Type};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

/// Summarise a run from the collector's output.
#[derive(clap::Args, Clone, Debug)]
#[command(after_help = "Examples:
  rankscope summary --out rankscope-out --run-id run-1763790000-123")]
pub struct Args {
    /// The collector's output directory.
    #[arg(long, default_value = rankscope_collector::CollectorConfig::DEFAULT_OUT)]
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

// A missing required column or a column of another type is an error that names it,
// never a panic: the files may come from another release, or from anywhere.
fn wrong_type(table: &str, name: &str, array: &ArrayRef, expected: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "column {table}.{name} is {}, not {expected}: is --out the output of a rankscope collector of this release?",
        array.data_type()
    )
}

fn missing(table: &str, name: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "table {table} has no column {name}: is --out the output of a rankscope collector of this release?"
    )
}

/// A nullable numeric column; absent means all null.
fn f64s(b: &RecordBatch, table: &str, name: &str) -> anyhow::Result<Vec<Option<f64>>> {
    match b.column_by_name(name) {
        None => Ok(vec![None; b.num_rows()]),
        Some(c) => Ok(c
            .as_primitive_opt::<Float64Type>()
            .ok_or_else(|| wrong_type(table, name, c, "Float64"))?
            .iter()
            .collect()),
    }
}

/// A required column of primitive type `T`.
fn required<T: arrow::datatypes::ArrowPrimitiveType>(
    b: &RecordBatch,
    table: &str,
    name: &str,
) -> anyhow::Result<Vec<Option<T::Native>>> {
    let c = b.column_by_name(name).ok_or_else(|| missing(table, name))?;
    Ok(c.as_primitive_opt::<T>()
        .ok_or_else(|| wrong_type(table, name, c, &T::DATA_TYPE.to_string()))?
        .iter()
        .collect())
}

/// A required string column.
fn strings<'a>(
    b: &'a RecordBatch,
    table: &str,
    name: &str,
) -> anyhow::Result<Vec<Option<&'a str>>> {
    let c = b.column_by_name(name).ok_or_else(|| missing(table, name))?;
    Ok(c.as_string_opt::<i32>()
        .ok_or_else(|| wrong_type(table, name, c, "Utf8"))?
        .iter()
        .collect())
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
        let rank = required::<UInt32Type>(&b, "steps", "rank")?;
        let step_ms = f64s(&b, "steps", "step_ms")?;
        let overhead = f64s(&b, "steps", "overhead_ms")?;
        let comm = f64s(&b, "steps", "comm_ms")?;
        let rows = rank.into_iter().zip(step_ms).zip(overhead).zip(comm);
        for (((rank, step_ms), overhead), comm) in rows {
            let Some(rank) = rank else { continue };
            let s = ranks.entry(rank).or_default();
            s.steps += 1;
            s.step_ms += step_ms.unwrap_or(0.0);
            s.overhead_ms += overhead.unwrap_or(0.0);
            if let Some(c) = comm {
                s.comm_ms.0 += c;
                s.comm_ms.1 += 1;
            }
        }
    }
    for b in batches(out, "events", run_id)? {
        let rank = required::<UInt32Type>(&b, "events", "rank")?;
        let kind = strings(&b, "events", "kind")?;
        let value = required::<Int64Type>(&b, "events", "value")?;
        for ((rank, kind), value) in rank.into_iter().zip(kind).zip(value) {
            if let (Some(rank), Some("samples_dropped"), Some(value)) = (rank, kind, value) {
                let s = ranks.entry(rank).or_default();
                s.samples_dropped = s.samples_dropped.saturating_add(value);
            }
        }
    }
    // layer -> step -> (sum stable, sum effective, n)
    let mut layers: BTreeMap<String, BTreeMap<u64, (f64, f64, u32)>> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    for b in batches(out, "layers", run_id)? {
        let names = strings(&b, "layers", "layer")?;
        let step = required::<UInt64Type>(&b, "layers", "step")?;
        let stable = f64s(&b, "layers", "stable_rank")?;
        let effective = f64s(&b, "layers", "effective_rank")?;
        for (((name, step), stable), effective) in
            names.into_iter().zip(step).zip(stable).zip(effective)
        {
            let (Some(name), Some(step)) = (name, step) else {
                continue;
            };
            if !order.iter().any(|n| n == name) {
                order.push(name.to_string());
            }
            let (Some(s), Some(e)) = (stable, effective) else {
                continue;
            };
            let slot = layers
                .entry(name.to_string())
                .or_default()
                .entry(step)
                .or_default();
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use arrow::array::{Float64Array, Int32Array, StringArray, UInt32Array};
    use arrow::datatypes::{Field, Schema};
    use parquet::arrow::ArrowWriter;

    /// Writes one Parquet file of `columns` as `table` of run `r` under `out`.
    fn write(out: &Path, table: &str, columns: Vec<(&str, ArrayRef)>) {
        let dir = out.join(table).join("run_id=r");
        std::fs::create_dir_all(&dir).unwrap();
        let fields: Vec<Field> = columns
            .iter()
            .map(|(name, a)| Field::new(*name, a.data_type().clone(), true))
            .collect();
        let batch = RecordBatch::try_new(
            Arc::new(Schema::new(fields)),
            columns.into_iter().map(|(_, a)| a).collect(),
        )
        .unwrap();
        let file = File::create(dir.join("part-0.parquet")).unwrap();
        let mut writer = ArrowWriter::try_new(file, batch.schema(), None).unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
    }

    #[test]
    fn well_formed_tables_are_summarised() {
        let out = tempfile::tempdir().unwrap();
        write(
            out.path(),
            "steps",
            vec![
                ("rank", Arc::new(UInt32Array::from(vec![0, 0, 1]))),
                (
                    "step_ms",
                    Arc::new(Float64Array::from(vec![10.0, 20.0, 30.0])),
                ),
            ],
        );
        let text = summarise(out.path(), "r").unwrap();
        assert!(text.contains("   0       2"), "{text}");
        assert!(text.contains("   1       1"), "{text}");
    }

    #[test]
    fn unexpected_or_missing_columns_are_errors_not_panics() {
        // A column of another type.
        let out = tempfile::tempdir().unwrap();
        write(
            out.path(),
            "steps",
            vec![
                ("rank", Arc::new(UInt32Array::from(vec![0]))),
                ("step_ms", Arc::new(Int32Array::from(vec![10]))),
            ],
        );
        let err = summarise(out.path(), "r").unwrap_err().to_string();
        assert!(err.contains("steps.step_ms is Int32, not Float64"), "{err}");

        // A required column missing, with rows in the others.
        let out = tempfile::tempdir().unwrap();
        write(
            out.path(),
            "events",
            vec![
                ("kind", Arc::new(StringArray::from(vec!["samples_dropped"]))),
                ("value", Arc::new(arrow::array::Int64Array::from(vec![3]))),
            ],
        );
        let err = summarise(out.path(), "r").unwrap_err().to_string();
        assert!(err.contains("table events has no column rank"), "{err}");

        // A layer name that is not a string.
        let out = tempfile::tempdir().unwrap();
        write(
            out.path(),
            "layers",
            vec![
                ("layer", Arc::new(UInt32Array::from(vec![1]))),
                ("step", Arc::new(arrow::array::UInt64Array::from(vec![1]))),
            ],
        );
        let err = summarise(out.path(), "r").unwrap_err().to_string();
        assert!(err.contains("layers.layer is UInt32, not Utf8"), "{err}");
    }
}
