//! The six tables and how their rows become Arrow record batches.
//!
//! Every table starts with the same three columns, `run_id`, `rank` and `seq` (the
//! batch sequence number the row travelled in; 0 for rows the collector wrote
//! itself). The other columns carry the names of the proto fields one for one, so a
//! column means the same thing in the protocol, the Parquet files and the docs.

use std::sync::Arc;

use arrow::array::{
    ArrayRef, BooleanArray, Float64Array, Int64Array, RecordBatch, StringArray,
    TimestampMicrosecondArray, UInt32Array, UInt64Array,
};
use arrow::datatypes::{Field, Schema};
use arrow::error::ArrowError;
use rankscope_proto::v1::{EventRow, LayerRow, Mode, ModelRow, RankRow, RunRow, StepRow};

/// A table of the output directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Table {
    Runs,
    Ranks,
    Steps,
    Layers,
    Model,
    Events,
}

impl Table {
    pub const ALL: [Table; 6] = [
        Table::Runs,
        Table::Ranks,
        Table::Steps,
        Table::Layers,
        Table::Model,
        Table::Events,
    ];

    /// The folder name under the output directory.
    pub fn name(self) -> &'static str {
        match self {
            Table::Runs => "runs",
            Table::Ranks => "ranks",
            Table::Steps => "steps",
            Table::Layers => "layers",
            Table::Model => "model",
            Table::Events => "events",
        }
    }
}

/// A row with the origin the collector stamps on it.
#[derive(Debug, Clone)]
pub struct Stamped<R> {
    pub rank: u32,
    pub seq: u64,
    pub row: R,
}

/// Buffered rows of one table of one run.
#[derive(Debug, Clone)]
pub enum Rows {
    Runs(Vec<Stamped<RunRow>>),
    Ranks(Vec<Stamped<RankRow>>),
    Steps(Vec<Stamped<StepRow>>),
    Layers(Vec<Stamped<LayerRow>>),
    Model(Vec<Stamped<ModelRow>>),
    Events(Vec<Stamped<EventRow>>),
}

impl Rows {
    pub fn empty(table: Table) -> Rows {
        match table {
            Table::Runs => Rows::Runs(Vec::new()),
            Table::Ranks => Rows::Ranks(Vec::new()),
            Table::Steps => Rows::Steps(Vec::new()),
            Table::Layers => Rows::Layers(Vec::new()),
            Table::Model => Rows::Model(Vec::new()),
            Table::Events => Rows::Events(Vec::new()),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Rows::Runs(v) => v.len(),
            Rows::Ranks(v) => v.len(),
            Rows::Steps(v) => v.len(),
            Rows::Layers(v) => v.len(),
            Rows::Model(v) => v.len(),
            Rows::Events(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Converts the rows to one record batch of `run_id`'s table.
    pub fn to_record_batch(&self, run_id: &str) -> Result<RecordBatch, ArrowError> {
        let mut cols = Columns::default();
        match self {
            Rows::Runs(rows) => {
                cols.head(run_id, rows);
                cols.time("started_at", rows, |r| Some(r.started_at));
                cols.u32("world_size", rows, |r| Some(r.world_size));
                cols.str("mode", rows, |r| mode_label(r.mode));
                cols.u32("sample_every", rows, |r| Some(r.sample_every));
                cols.u32("max_rows", rows, |r| Some(r.max_rows));
                cols.bool("centered", rows, |r| r.centered);
                cols.str("layer_filter", rows, |r| &r.layer_filter);
                cols.str("agent_version", rows, |r| &r.agent_version);
                cols.str("workload", rows, |r| &r.workload);
            }
            Rows::Ranks(rows) => {
                cols.head(run_id, rows);
                cols.u32("local_rank", rows, |r| Some(r.local_rank));
                cols.u32("node_rank", rows, |r| Some(r.node_rank));
                cols.u32("world_size", rows, |r| Some(r.world_size));
                cols.str("hostname", rows, |r| &r.hostname);
                cols.u32("pid", rows, |r| Some(r.pid));
                cols.str("mode", rows, |r| mode_label(r.mode));
                cols.time("started_at", rows, |r| Some(r.started_at));
                cols.time("finished_at", rows, |r| r.finished_at);
            }
            Rows::Steps(rows) => {
                cols.head(run_id, rows);
                cols.u64("step", rows, |r| Some(r.step));
                cols.time("time", rows, |r| Some(r.time));
                cols.f64("step_ms", rows, |r| Some(r.step_ms));
                cols.f64("data_ms", rows, |r| r.data_ms);
                cols.f64("forward_ms", rows, |r| r.forward_ms);
                cols.f64("backward_ms", rows, |r| r.backward_ms);
                cols.f64("optimizer_ms", rows, |r| r.optimizer_ms);
                cols.f64("loss", rows, |r| r.loss);
                cols.f64("grad_norm", rows, |r| r.grad_norm);
                cols.f64("lr", rows, |r| r.lr);
                cols.u64("samples", rows, |r| r.samples);
                cols.f64("comm_ms", rows, |r| r.comm_ms);
                cols.f64("overhead_ms", rows, |r| Some(r.overhead_ms));
                cols.u64("rss_bytes", rows, |r| r.rss_bytes);
                cols.u64("device_allocated_bytes", rows, |r| r.device_allocated_bytes);
                cols.u64("device_reserved_bytes", rows, |r| r.device_reserved_bytes);
                cols.u64("device_peak_bytes", rows, |r| r.device_peak_bytes);
            }
            Rows::Layers(rows) => {
                cols.head(run_id, rows);
                cols.u64("step", rows, |r| Some(r.step));
                cols.time("time", rows, |r| Some(r.time));
                cols.str("layer", rows, |r| &r.layer);
                cols.u32("rows", rows, |r| Some(r.rows));
                cols.u32("cols", rows, |r| Some(r.cols));
                cols.bool("centered", rows, |r| r.centered);
                cols.str("conv_layout", rows, |r| &r.conv_layout);
                cols.f64("stable_rank", rows, |r| r.stable_rank);
                cols.f64("participation_ratio", rows, |r| r.participation_ratio);
                cols.f64("participation_ratio_sv", rows, |r| r.participation_ratio_sv);
                cols.u32("cum_energy_90", rows, |r| r.cum_energy_90);
                cols.f64("nuclear_norm_ratio", rows, |r| r.nuclear_norm_ratio);
                cols.f64("effective_rank", rows, |r| r.effective_rank);
                cols.f64("mean", rows, |r| r.mean);
                cols.f64("std", rows, |r| r.std);
                cols.f64("zero_fraction", rows, |r| r.zero_fraction);
                cols.u64("nonfinite", rows, |r| Some(r.nonfinite));
                cols.f64("compute_ms", rows, |r| Some(r.compute_ms));
            }
            Rows::Model(rows) => {
                cols.head(run_id, rows);
                cols.str("layer", rows, |r| &r.layer);
                cols.str("kind", rows, |r| &r.kind);
                cols.u64("params", rows, |r| Some(r.params));
                cols.u64("param_bytes", rows, |r| Some(r.param_bytes));
                cols.u64("grad_bytes", rows, |r| Some(r.grad_bytes));
                cols.u64("optimizer_bytes", rows, |r| Some(r.optimizer_bytes));
                cols.u64("forward_flops", rows, |r| Some(r.forward_flops));
                cols.str("output_shape", rows, |r| &r.output_shape);
            }
            Rows::Events(rows) => {
                cols.head(run_id, rows);
                cols.time("time", rows, |r| Some(r.time));
                cols.str("kind", rows, |r| &r.kind);
                cols.str("message", rows, |r| &r.message);
                cols.i64("value", rows, |r| r.value);
                cols.u64("step", rows, |r| r.step);
            }
        }
        cols.finish()
    }
}

fn mode_label(mode: i32) -> &'static str {
    Mode::try_from(mode).map_or("unknown", Mode::label)
}

/// Column builder: each call adds one named column, so a table's column list reads
/// as one list of names.
#[derive(Default)]
struct Columns {
    fields: Vec<Field>,
    arrays: Vec<ArrayRef>,
}

impl Columns {
    fn push(&mut self, name: &str, array: ArrayRef, nullable: bool) {
        self.fields
            .push(Field::new(name, array.data_type().clone(), nullable));
        self.arrays.push(array);
    }

    fn head<R>(&mut self, run_id: &str, rows: &[Stamped<R>]) {
        let run: StringArray = rows.iter().map(|_| Some(run_id)).collect();
        self.push("run_id", Arc::new(run), false);
        let rank: UInt32Array = rows.iter().map(|r| Some(r.rank)).collect();
        self.push("rank", Arc::new(rank), false);
        let seq: UInt64Array = rows.iter().map(|r| Some(r.seq)).collect();
        self.push("seq", Arc::new(seq), false);
    }

    fn f64<R>(&mut self, name: &str, rows: &[Stamped<R>], f: impl Fn(&R) -> Option<f64>) {
        let a: Float64Array = rows.iter().map(|r| f(&r.row)).collect();
        self.push(name, Arc::new(a), true);
    }

    fn u64<R>(&mut self, name: &str, rows: &[Stamped<R>], f: impl Fn(&R) -> Option<u64>) {
        let a: UInt64Array = rows.iter().map(|r| f(&r.row)).collect();
        self.push(name, Arc::new(a), true);
    }

    fn i64<R>(&mut self, name: &str, rows: &[Stamped<R>], f: impl Fn(&R) -> Option<i64>) {
        let a: Int64Array = rows.iter().map(|r| f(&r.row)).collect();
        self.push(name, Arc::new(a), true);
    }

    fn u32<R>(&mut self, name: &str, rows: &[Stamped<R>], f: impl Fn(&R) -> Option<u32>) {
        let a: UInt32Array = rows.iter().map(|r| f(&r.row)).collect();
        self.push(name, Arc::new(a), true);
    }

    fn bool<R>(&mut self, name: &str, rows: &[Stamped<R>], f: impl Fn(&R) -> bool) {
        let a: BooleanArray = rows.iter().map(|r| Some(f(&r.row))).collect();
        self.push(name, Arc::new(a), false);
    }

    fn str<R>(&mut self, name: &str, rows: &[Stamped<R>], f: impl Fn(&R) -> &str) {
        let a: StringArray = rows.iter().map(|r| Some(f(&r.row))).collect();
        self.push(name, Arc::new(a), false);
    }

    /// Microseconds since the Unix epoch, as a UTC timestamp column.
    fn time<R>(&mut self, name: &str, rows: &[Stamped<R>], f: impl Fn(&R) -> Option<i64>) {
        let a: TimestampMicrosecondArray = rows.iter().map(|r| f(&r.row)).collect();
        self.push(name, Arc::new(a.with_timezone("UTC")), true);
    }

    fn finish(self) -> Result<RecordBatch, ArrowError> {
        RecordBatch::try_new(Arc::new(Schema::new(self.fields)), self.arrays)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_table_converts_with_its_head_columns() {
        let step = Stamped {
            rank: 3,
            seq: 7,
            row: StepRow {
                step: 1,
                step_ms: 2.5,
                loss: Some(0.5),
                ..Default::default()
            },
        };
        let batch = Rows::Steps(vec![step.clone(), step])
            .to_record_batch("run-a")
            .unwrap();
        assert_eq!(batch.num_rows(), 2);
        let names: Vec<_> = batch
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        assert_eq!(&names[..4], ["run_id", "rank", "seq", "step"]);
        assert!(names.contains(&"device_peak_bytes".to_string()));
        for table in Table::ALL {
            let b = Rows::empty(table).to_record_batch("r").unwrap();
            assert_eq!(b.schema().field(0).name(), "run_id");
        }
    }
}
