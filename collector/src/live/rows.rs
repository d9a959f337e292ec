//! Reading the live view's values out of a batch's Arrow record batches, by
//! column name (the names of `table::columns`, docs/columns.md).
//!
//! A column missing or of another type reads as null: the view then shows less,
//! and never panics on what a batch holds.

use arrow::array::{Array, AsArray, PrimitiveArray, RecordBatch, StringArray};
use arrow::datatypes::{
    ArrowPrimitiveType, Float32Type, Float64Type, Int64Type, TimestampMicrosecondType, UInt32Type,
    UInt64Type,
};

use super::snapshot::{LayerPoint, StepPoint};

/// A primitive column of `batch` by name.
fn column<'a, T: ArrowPrimitiveType>(
    batch: &'a RecordBatch,
    name: &str,
) -> Option<&'a PrimitiveArray<T>> {
    batch.column_by_name(name)?.as_primitive_opt::<T>()
}

fn strings<'a>(batch: &'a RecordBatch, name: &str) -> Option<&'a StringArray> {
    batch.column_by_name(name)?.as_string_opt::<i32>()
}

/// Row `i` of an optional primitive column, null as `None`.
fn at<T: ArrowPrimitiveType>(col: Option<&PrimitiveArray<T>>, i: usize) -> Option<T::Native> {
    let col = col?;
    (i < col.len() && col.is_valid(i)).then(|| col.value(i))
}

fn text(col: Option<&StringArray>, i: usize) -> Option<&str> {
    let col = col?;
    (i < col.len() && col.is_valid(i)).then(|| col.value(i))
}

/// The rows of a `steps` record batch.
pub fn steps(batch: &RecordBatch) -> Vec<StepPoint> {
    let step = column::<UInt64Type>(batch, "step");
    let time = column::<TimestampMicrosecondType>(batch, "time");
    let f = |name| column::<Float64Type>(batch, name);
    let (step_ms, data_ms, forward_ms, backward_ms, optimizer_ms) = (
        f("step_ms"),
        f("data_ms"),
        f("forward_ms"),
        f("backward_ms"),
        f("optimizer_ms"),
    );
    let (comm_ms, overhead_ms, loss, grad_norm) =
        (f("comm_ms"), f("overhead_ms"), f("loss"), f("grad_norm"));
    let (overhead_device_ms, overhead_observed_ms) =
        (f("overhead_device_ms"), f("overhead_observed_ms"));
    let u = |name| column::<UInt64Type>(batch, name);
    let (samples, rss_bytes, device_allocated_bytes) =
        (u("samples"), u("rss_bytes"), u("device_allocated_bytes"));
    (0..batch.num_rows())
        .filter_map(|i| {
            Some(StepPoint {
                step: at(step, i)?,
                time_us: at(time, i).unwrap_or_default(),
                step_ms: at(step_ms, i).unwrap_or(f64::NAN),
                data_ms: at(data_ms, i),
                forward_ms: at(forward_ms, i),
                backward_ms: at(backward_ms, i),
                optimizer_ms: at(optimizer_ms, i),
                comm_ms: at(comm_ms, i),
                comm_from_table: at(comm_ms, i).is_none(),
                overhead_ms: at(overhead_ms, i).unwrap_or_default(),
                overhead_device_ms: at(overhead_device_ms, i),
                overhead_observed_ms: at(overhead_observed_ms, i),
                loss: at(loss, i),
                grad_norm: at(grad_norm, i),
                samples: at(samples, i),
                rss_bytes: at(rss_bytes, i),
                device_allocated_bytes: at(device_allocated_bytes, i),
            })
        })
        .collect()
}

/// The (step, `comm_ms`) of the rows of a `comm` record batch; rows between steps
/// (a null `step`) are left out.
pub fn comm(batch: &RecordBatch) -> Vec<(u64, f64)> {
    let step = column::<UInt64Type>(batch, "step");
    let comm_ms = column::<Float64Type>(batch, "comm_ms");
    (0..batch.num_rows())
        .filter_map(|i| Some((at(step, i)?, at(comm_ms, i)?)))
        .collect()
}

/// The rows of a `layers` record batch whose layer `keep` wants, with their
/// layer names (the others cost a look at their name, no allocation).
pub fn layers(
    batch: &RecordBatch,
    mut keep: impl FnMut(&str) -> bool,
) -> Vec<(String, LayerPoint)> {
    let step = column::<UInt64Type>(batch, "step");
    let layer = strings(batch, "layer");
    let f = |name| column::<Float32Type>(batch, name);
    let (stable_rank, participation_ratio, effective_rank, zero_fraction, std) = (
        f("stable_rank"),
        f("participation_ratio"),
        f("effective_rank"),
        f("zero_fraction"),
        f("std"),
    );
    let nonfinite = column::<UInt64Type>(batch, "nonfinite");
    let wide = |v: Option<f32>| v.map(f64::from);
    (0..batch.num_rows())
        .filter_map(|i| {
            let name = text(layer, i).filter(|n| keep(n))?.to_string();
            let point = LayerPoint {
                step: at(step, i)?,
                stable_rank: wide(at(stable_rank, i)),
                participation_ratio: wide(at(participation_ratio, i)),
                effective_rank: wide(at(effective_rank, i)),
                zero_fraction: wide(at(zero_fraction, i)),
                std: wide(at(std, i)),
                nonfinite: at(nonfinite, i).unwrap_or_default(),
            };
            Some((name, point))
        })
        .collect()
}

/// One `events` row, the columns the view counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventPoint {
    pub kind: String,
    pub value: Option<i64>,
}

/// The rows of an `events` record batch.
pub fn events(batch: &RecordBatch) -> Vec<EventPoint> {
    let kind = strings(batch, "kind");
    let value = column::<Int64Type>(batch, "value");
    (0..batch.num_rows())
        .filter_map(|i| {
            Some(EventPoint {
                kind: text(kind, i)?.to_string(),
                value: at(value, i),
            })
        })
        .collect()
}

/// One `ranks` row: who the rank is, and whether it finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPoint {
    pub hostname: String,
    pub node_rank: u32,
    pub finished: bool,
}

/// The rows of a `ranks` record batch.
pub fn ranks(batch: &RecordBatch) -> Vec<RankPoint> {
    let hostname = strings(batch, "hostname");
    let node_rank = column::<UInt32Type>(batch, "node_rank");
    let finished_at = column::<TimestampMicrosecondType>(batch, "finished_at");
    (0..batch.num_rows())
        .map(|i| RankPoint {
            hostname: text(hostname, i).unwrap_or_default().to_string(),
            node_rank: at(node_rank, i).unwrap_or_default(),
            finished: at(finished_at, i).is_some(),
        })
        .collect()
}

/// The `sample_every` of a `runs` record batch (its last row's).
pub fn sample_every(batch: &RecordBatch) -> Option<u64> {
    let every = column::<UInt32Type>(batch, "sample_every");
    (0..batch.num_rows())
        .rev()
        .find_map(|i| at(every, i))
        .map(u64::from)
}
