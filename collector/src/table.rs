//! The six tables as the collector buffers them ([`Rows`]) and how their rows become
//! Arrow record batches. The table names and the rows of a `Batch` are
//! `rankscope-proto`'s ([`Table`]); every match over the six kinds of buffered rows
//! is in this module.
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
use arrow::datatypes::{Field, Schema, SchemaRef};
use arrow::error::ArrowError;
use rankscope_proto::v1::{
    Batch, EventRow, LayerRow, ModelRow, RankRow, RecordingMode, RunRow, StepRow,
};

pub use rankscope_proto::Table;

/// Buffered rows of one table of one run, all from one batch (so of one rank
/// and one `seq`).
#[derive(Debug, Clone)]
pub enum Rows {
    Runs(Vec<RunRow>),
    Ranks(Vec<RankRow>),
    Steps(Vec<StepRow>),
    Layers(Vec<LayerRow>),
    Model(Vec<ModelRow>),
    Events(Vec<EventRow>),
}

/// Runs `$body` on the vector of rows whatever its table: the one place that
/// lists the six variants for code that does not depend on the row type.
macro_rules! each_table {
    ($rows:expr, $v:ident => $body:expr) => {
        match $rows {
            Rows::Runs($v) => $body,
            Rows::Ranks($v) => $body,
            Rows::Steps($v) => $body,
            Rows::Layers($v) => $body,
            Rows::Model($v) => $body,
            Rows::Events($v) => $body,
        }
    };
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

    /// The rows of every table of `batch`; tables the batch has no rows for are
    /// left out.
    pub fn split(batch: Batch) -> impl Iterator<Item = Rows> {
        let Batch {
            runs,
            ranks,
            steps,
            layers,
            model,
            events,
            ..
        } = batch;
        [
            Rows::Runs(runs),
            Rows::Ranks(ranks),
            Rows::Steps(steps),
            Rows::Layers(layers),
            Rows::Model(model),
            Rows::Events(events),
        ]
        .into_iter()
        .filter(|rows| !rows.is_empty())
    }

    /// The table the rows belong to.
    pub fn table(&self) -> Table {
        match self {
            Rows::Runs(_) => Table::Runs,
            Rows::Ranks(_) => Table::Ranks,
            Rows::Steps(_) => Table::Steps,
            Rows::Layers(_) => Table::Layers,
            Rows::Model(_) => Table::Model,
            Rows::Events(_) => Table::Events,
        }
    }

    pub fn len(&self) -> usize {
        each_table!(self, v => v.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The Arrow schema of `table`'s files.
    pub fn schema(table: Table) -> SchemaRef {
        Rows::empty(table)
            .to_record_batch("", 0, 0)
            .expect("no rows convert")
            .schema()
    }

    /// Converts the rows, sent by `rank` in batch `seq` (0: written by the
    /// collector itself), to one record batch of `run_id`'s table.
    pub fn to_record_batch(
        &self,
        run_id: &str,
        rank: u32,
        seq: u64,
    ) -> Result<RecordBatch, ArrowError> {
        let mut cols = Columns::default();
        match self {
            Rows::Runs(rows) => {
                cols.head(run_id, rank, seq, rows.len());
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
                cols.head(run_id, rank, seq, rows.len());
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
                cols.head(run_id, rank, seq, rows.len());
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
                cols.head(run_id, rank, seq, rows.len());
                cols.u64("step", rows, |r| Some(r.step));
                cols.time("time", rows, |r| Some(r.time));
                cols.str("layer", rows, |r| &r.layer);
                cols.u32("rows", rows, |r| Some(r.rows));
                cols.u32("cols", rows, |r| Some(r.cols));
                cols.bool("centered", rows, |r| r.centered);
                cols.str("conv_layout", rows, |r| &r.conv_layout);
                cols.str("method", rows, |r| &r.method);
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
                cols.head(run_id, rank, seq, rows.len());
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
                cols.head(run_id, rank, seq, rows.len());
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
    RecordingMode::try_from(mode).map_or("unknown", RecordingMode::label)
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

    fn head(&mut self, run_id: &str, rank: u32, seq: u64, n: usize) {
        let run: StringArray = std::iter::repeat_n(Some(run_id), n).collect();
        self.push("run_id", Arc::new(run), false);
        self.push("rank", Arc::new(UInt32Array::from(vec![rank; n])), false);
        self.push("seq", Arc::new(UInt64Array::from(vec![seq; n])), false);
    }

    fn f64<R>(&mut self, name: &str, rows: &[R], f: impl Fn(&R) -> Option<f64>) {
        let a: Float64Array = rows.iter().map(&f).collect();
        self.push(name, Arc::new(a), true);
    }

    fn u64<R>(&mut self, name: &str, rows: &[R], f: impl Fn(&R) -> Option<u64>) {
        let a: UInt64Array = rows.iter().map(&f).collect();
        self.push(name, Arc::new(a), true);
    }

    fn i64<R>(&mut self, name: &str, rows: &[R], f: impl Fn(&R) -> Option<i64>) {
        let a: Int64Array = rows.iter().map(&f).collect();
        self.push(name, Arc::new(a), true);
    }

    fn u32<R>(&mut self, name: &str, rows: &[R], f: impl Fn(&R) -> Option<u32>) {
        let a: UInt32Array = rows.iter().map(&f).collect();
        self.push(name, Arc::new(a), true);
    }

    fn bool<R>(&mut self, name: &str, rows: &[R], f: impl Fn(&R) -> bool) {
        let a: BooleanArray = rows.iter().map(|r| Some(f(r))).collect();
        self.push(name, Arc::new(a), false);
    }

    fn str<R>(&mut self, name: &str, rows: &[R], f: impl Fn(&R) -> &str) {
        let a: StringArray = rows.iter().map(|r| Some(f(r))).collect();
        self.push(name, Arc::new(a), false);
    }

    /// Microseconds since the Unix epoch, as a UTC timestamp column.
    fn time<R>(&mut self, name: &str, rows: &[R], f: impl Fn(&R) -> Option<i64>) {
        let a: TimestampMicrosecondArray = rows.iter().map(&f).collect();
        self.push(name, Arc::new(a.with_timezone("UTC")), true);
    }

    fn finish(self) -> Result<RecordBatch, ArrowError> {
        RecordBatch::try_new(Arc::new(Schema::new(self.fields)), self.arrays)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The protocol, read as text so the test needs no descriptor machinery.
    const PROTO: &str = include_str!("../../proto/proto/rankscope/v1/telemetry.proto");

    /// The field names of `message`, in order.
    fn proto_fields(message: &str) -> Vec<String> {
        let opening = format!("message {message} {{");
        let body = PROTO
            .split_once(&opening)
            .unwrap_or_else(|| panic!("no message {message} in the proto"))
            .1;
        let body = &body[..body.find('}').expect("message closes")];
        body.lines()
            .map(|line| line.split("//").next().unwrap_or("").trim())
            .filter(|line| line.ends_with(';'))
            .filter_map(|line| {
                let before_eq = line.split('=').next()?.trim();
                before_eq.split_whitespace().last().map(str::to_string)
            })
            .collect()
    }

    #[test]
    fn parquet_columns_are_the_proto_fields() {
        for table in Table::ALL {
            let batch = Rows::empty(table).to_record_batch("r", 0, 0).unwrap();
            let schema = batch.schema();
            let mut columns: Vec<String> =
                schema.fields().iter().map(|f| f.name().clone()).collect();
            assert_eq!(&columns[..3], ["run_id", "rank", "seq"], "{}", table.name());
            columns.drain(..3);
            let mut fields = proto_fields(table.row_message());
            assert!(!fields.is_empty(), "{}", table.row_message());
            columns.sort();
            fields.sort();
            assert_eq!(
                columns,
                fields,
                "table {} against message {}",
                table.name(),
                table.row_message()
            );
        }
        // Every table travels in the Batch field of its name.
        let batch_fields = proto_fields("Batch");
        for table in Table::ALL {
            assert!(
                batch_fields.iter().any(|f| f == table.name()),
                "{}",
                table.name()
            );
        }
    }

    #[test]
    fn every_table_converts_with_its_head_columns() {
        let step = StepRow {
            step: 1,
            step_ms: 2.5,
            loss: Some(0.5),
            ..Default::default()
        };
        let batch = Rows::Steps(vec![step, step])
            .to_record_batch("run-a", 3, 7)
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
            let b = Rows::empty(table).to_record_batch("r", 0, 0).unwrap();
            assert_eq!(b.schema().field(0).name(), "run_id");
        }
    }
}
