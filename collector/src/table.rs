//! The columns of the seven tables, and the Arrow builders the wire decoder
//! ([`crate::wire`]) fills. The table names and the `Batch` fields that carry their
//! rows are `rankscope-proto`'s ([`Table`]); every column of every table is listed
//! here, once ([`columns`]).
//!
//! Every table starts with the same three columns, `run_id`, `rank` and `seq` (the
//! batch sequence number the row travelled in; 0 for rows the collector wrote
//! itself). The other columns carry the names of the proto fields one for one, so a
//! column means the same thing in the protocol, the Parquet files and the docs; a
//! test checks the lists against the `.proto` file, and another checks the decoded
//! values against prost's decoding of the same bytes.

use std::sync::{Arc, OnceLock};

use arrow::array::{
    ArrayRef, BooleanBuilder, Float32Builder, Float64Builder, Int64Builder, RecordBatch,
    StringArray, StringBuilder, TimestampMicrosecondBuilder, UInt32Array, UInt32Builder,
    UInt64Array, UInt64Builder,
};
use arrow::buffer::{Buffer, OffsetBuffer};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use rankscope_proto::v1::RecordingMode;
use rankscope_proto::{MAX_EVENT_MESSAGE_BYTES, MAX_LABEL_BYTES, MAX_RUN_ID_LEN};

use crate::validate::{self, Invalid};

pub use rankscope_proto::Table;

/// How a proto field's value becomes a column value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `uint64`, as `UInt64`.
    U64,
    /// `uint32`, as `UInt32`.
    U32,
    /// `int64`, as `Int64`.
    I64,
    /// `int64` microseconds since the Unix epoch, as a UTC timestamp.
    Time,
    /// `double`, as `Float64`.
    F64,
    /// `double`, as `Float32`, rounded to nearest: a relative error of at most
    /// 2⁻²⁴ (6e-8), for values measured from float32 (or narrower) data, which
    /// is itself rounded at this precision or coarser. A finite value past
    /// float32's range (±3.4e38) becomes ±inf; one below 1.2e-38 loses digits
    /// or becomes 0.
    F32,
    /// `bool`, as `Boolean`.
    Bool,
    /// `string`, as `Utf8`.
    Str,
    /// The `RecordingMode` enum, as its label (`full`, `rank0`, ...; `unknown`
    /// for a number the collector does not know).
    Mode,
}

impl Kind {
    /// The protobuf wire type the field is sent with (0 varint, 1 fixed64, 2
    /// length-delimited).
    pub const fn wire_type(self) -> u8 {
        match self {
            Kind::F64 | Kind::F32 => 1,
            Kind::Str => 2,
            _ => 0,
        }
    }

    fn data_type(self) -> DataType {
        match self {
            Kind::U64 => DataType::UInt64,
            Kind::U32 => DataType::UInt32,
            Kind::I64 => DataType::Int64,
            Kind::Time => DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            Kind::F64 => DataType::Float64,
            Kind::F32 => DataType::Float32,
            Kind::Bool => DataType::Boolean,
            Kind::Str | Kind::Mode => DataType::Utf8,
        }
    }

    /// Bytes per row of the column's Arrow buffers (values, offsets, validity),
    /// string contents aside.
    const fn row_bytes(self) -> usize {
        match self {
            Kind::U64 | Kind::I64 | Kind::Time | Kind::F64 => 9,
            Kind::U32 | Kind::F32 | Kind::Str | Kind::Mode => 5,
            Kind::Bool => 1,
        }
    }
}

/// What the collector checks in a string column before it accepts a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    None,
    /// At most [`MAX_LABEL_BYTES`], no control characters.
    Label,
    /// At most [`MAX_EVENT_MESSAGE_BYTES`].
    EventMessage,
}

/// One column of a table: the proto field it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Column {
    /// The column's name, which is the proto field's.
    pub name: &'static str,
    /// The proto field number.
    pub field: u32,
    pub kind: Kind,
    /// A proto3 `optional` field: null when absent (other fields read as their
    /// default, 0, "" or false).
    pub optional: bool,
    pub check: Check,
}

const fn col(name: &'static str, field: u32, kind: Kind) -> Column {
    let check = match kind {
        Kind::Str => Check::Label,
        _ => Check::None,
    };
    Column {
        name,
        field,
        kind,
        optional: false,
        check,
    }
}

const fn opt(name: &'static str, field: u32, kind: Kind) -> Column {
    Column {
        optional: true,
        ..col(name, field, kind)
    }
}

use Kind::{Bool, F32, F64, I64, Mode, Str, Time, U32, U64};

const RUNS: &[Column] = &[
    col("started_at", 1, Time),
    col("world_size", 2, U32),
    col("mode", 3, Mode),
    col("sample_every", 4, U32),
    col("max_rows", 5, U32),
    col("centered", 6, Bool),
    col("layer_filter", 7, Str),
    col("agent_version", 8, Str),
    col("workload", 9, Str),
    opt("overhead_budget", 10, F64),
];

const RANKS: &[Column] = &[
    col("local_rank", 1, U32),
    col("node_rank", 2, U32),
    col("world_size", 3, U32),
    col("hostname", 4, Str),
    col("pid", 5, U32),
    col("mode", 6, Mode),
    col("started_at", 7, Time),
    opt("finished_at", 8, Time),
];

const STEPS: &[Column] = &[
    col("step", 1, U64),
    col("time", 2, Time),
    col("step_ms", 3, F64),
    opt("data_ms", 4, F64),
    opt("forward_ms", 5, F64),
    opt("backward_ms", 6, F64),
    opt("optimizer_ms", 7, F64),
    opt("loss", 8, F64),
    opt("grad_norm", 9, F64),
    opt("lr", 10, F64),
    opt("samples", 11, U64),
    opt("comm_ms", 17, F64),
    col("overhead_ms", 12, F64),
    opt("overhead_device_ms", 18, F64),
    opt("overhead_observed_ms", 19, F64),
    opt("rss_bytes", 13, U64),
    opt("device_allocated_bytes", 14, U64),
    opt("device_reserved_bytes", 15, U64),
    opt("device_peak_bytes", 16, U64),
];

const LAYERS: &[Column] = &[
    col("step", 1, U64),
    col("time", 2, Time),
    col("layer", 3, Str),
    col("rows", 4, U32),
    col("cols", 5, U32),
    col("centered", 6, Bool),
    col("conv_layout", 18, Str),
    col("method", 19, Str),
    opt("stable_rank", 7, F32),
    opt("participation_ratio", 8, F32),
    opt("participation_ratio_sv", 9, F32),
    opt("cum_energy_90", 10, U32),
    opt("nuclear_norm_ratio", 11, F32),
    opt("effective_rank", 12, F32),
    opt("stable_rank_err", 20, F32),
    opt("participation_ratio_err", 21, F32),
    opt("participation_ratio_sv_err", 22, F32),
    opt("cum_energy_90_err", 23, F32),
    opt("nuclear_norm_ratio_err", 24, F32),
    opt("effective_rank_err", 25, F32),
    opt("mean", 13, F32),
    opt("std", 14, F32),
    opt("zero_fraction", 15, F32),
    col("nonfinite", 16, U64),
    col("compute_ms", 17, F32),
];

const MODEL: &[Column] = &[
    col("layer", 1, Str),
    col("kind", 2, Str),
    col("params", 3, U64),
    col("param_bytes", 4, U64),
    col("grad_bytes", 5, U64),
    col("optimizer_bytes", 6, U64),
    col("forward_flops", 7, U64),
    col("output_shape", 8, Str),
];

const EVENTS: &[Column] = &[
    col("time", 1, Time),
    col("kind", 2, Str),
    Column {
        check: Check::EventMessage,
        ..col("message", 3, Str)
    },
    opt("value", 4, I64),
    opt("step", 5, U64),
];

const COMM: &[Column] = &[
    opt("step", 1, U64),
    col("time", 2, Time),
    col("kind", 3, Str),
    col("count", 4, U64),
    col("bytes", 5, U64),
    col("comm_ms", 6, F64),
];

/// The columns of `table` after the three head columns, in file order. The
/// checks of a row run in this order, as do the tables' in [`CHECK_ORDER`].
pub const fn columns(table: Table) -> &'static [Column] {
    match table {
        Table::Runs => RUNS,
        Table::Ranks => RANKS,
        Table::Steps => STEPS,
        Table::Layers => LAYERS,
        Table::Model => MODEL,
        Table::Events => EVENTS,
        Table::Comm => COMM,
    }
}

/// The order in which a batch's tables are checked: a batch with bad values in
/// several tables is refused for the first of them in this order.
pub const CHECK_ORDER: [Table; 7] = [
    Table::Layers,
    Table::Model,
    Table::Events,
    Table::Comm,
    Table::Runs,
    Table::Ranks,
    Table::Steps,
];

/// One past the highest field number of any row message.
pub const MAX_FIELD: usize = 26;

/// An upper bound of the Arrow memory one decoded row takes, string contents
/// aside (the message's size bounds those): the largest table's columns, and
/// the head columns with the longest run id.
pub const MAX_ROW_BYTES: usize = {
    let mut largest = 0;
    let mut t = 0;
    while t < Table::ALL.len() {
        let cols = columns(Table::ALL[t]);
        let mut bytes = 0;
        let mut i = 0;
        while i < cols.len() {
            bytes += cols[i].kind.row_bytes();
            i += 1;
        }
        if bytes > largest {
            largest = bytes;
        }
        t += 1;
    }
    // run_id (offset and contents), rank, seq.
    largest + 4 + MAX_RUN_ID_LEN + 4 + 8
};

/// The Arrow schema of `table`'s files.
pub fn schema(table: Table) -> SchemaRef {
    static SCHEMAS: OnceLock<Vec<SchemaRef>> = OnceLock::new();
    SCHEMAS.get_or_init(|| Table::ALL.map(build_schema).to_vec())[table.index()].clone()
}

fn build_schema(table: Table) -> SchemaRef {
    let mut fields = vec![
        Field::new("run_id", DataType::Utf8, false),
        Field::new("rank", DataType::UInt32, false),
        Field::new("seq", DataType::UInt64, false),
    ];
    for c in columns(table) {
        let nullable = !matches!(c.kind, Kind::Bool | Kind::Str | Kind::Mode);
        fields.push(Field::new(c.name, c.kind.data_type(), nullable));
    }
    Arc::new(Schema::new(fields))
}

/// The fields of one row as read from the wire, indexed by field number: the
/// last occurrence of a field wins, as in any protobuf decoder. A slot holds a
/// value only while its field's bit is set in `present` (slots of absent fields
/// may hold an earlier row's value); read through [`RowValues::number`] and
/// [`RowValues::string`].
#[derive(Debug, Clone, Copy)]
pub struct RowValues<'a> {
    /// Varint and fixed64 values, as their 64 bits.
    pub numbers: [u64; MAX_FIELD],
    pub strings: [&'a str; MAX_FIELD],
    /// Bit `f` set: field `f` was present.
    pub present: u32,
}

impl Default for RowValues<'_> {
    fn default() -> Self {
        RowValues {
            numbers: [0; MAX_FIELD],
            strings: [""; MAX_FIELD],
            present: 0,
        }
    }
}

impl<'a> RowValues<'a> {
    /// Back to no fields present.
    pub fn clear(&mut self) {
        self.present = 0;
    }

    /// Whether field `f` was present.
    pub fn has(&self, f: usize) -> bool {
        self.present & (1 << f) != 0
    }

    /// Field `f`'s 64 bits; 0 (proto3's default) when absent.
    pub fn number(&self, f: usize) -> u64 {
        if self.has(f) { self.numbers[f] } else { 0 }
    }

    /// Field `f`'s string; "" (proto3's default) when absent.
    pub fn string(&self, f: usize) -> &'a str {
        if self.has(f) { self.strings[f] } else { "" }
    }
}

/// The Arrow builder of one column.
#[derive(Debug)]
enum Builder {
    U64(UInt64Builder),
    U32(UInt32Builder),
    I64(Int64Builder),
    Time(TimestampMicrosecondBuilder),
    F64(Float64Builder),
    F32(Float32Builder),
    Bool(BooleanBuilder),
    Str(StringBuilder),
    /// A `RecordingMode`, written as its label.
    Mode(StringBuilder),
}

impl Builder {
    fn new(kind: Kind, rows: usize) -> Builder {
        match kind {
            Kind::U64 => Builder::U64(UInt64Builder::with_capacity(rows)),
            Kind::U32 => Builder::U32(UInt32Builder::with_capacity(rows)),
            Kind::I64 => Builder::I64(Int64Builder::with_capacity(rows)),
            Kind::Time => {
                Builder::Time(TimestampMicrosecondBuilder::with_capacity(rows).with_timezone("UTC"))
            }
            Kind::F64 => Builder::F64(Float64Builder::with_capacity(rows)),
            Kind::F32 => Builder::F32(Float32Builder::with_capacity(rows)),
            Kind::Bool => Builder::Bool(BooleanBuilder::with_capacity(rows)),
            // Label-sized strings: 16 bytes a row to start with.
            Kind::Str => Builder::Str(StringBuilder::with_capacity(rows, rows * 16)),
            Kind::Mode => Builder::Mode(StringBuilder::with_capacity(rows, rows * 8)),
        }
    }

    fn finish(&mut self) -> ArrayRef {
        match self {
            Builder::U64(b) => Arc::new(b.finish()),
            Builder::U32(b) => Arc::new(b.finish()),
            Builder::I64(b) => Arc::new(b.finish()),
            Builder::Time(b) => Arc::new(b.finish()),
            Builder::F64(b) => Arc::new(b.finish()),
            Builder::F32(b) => Arc::new(b.finish()),
            Builder::Bool(b) => Arc::new(b.finish()),
            Builder::Str(b) | Builder::Mode(b) => Arc::new(b.finish()),
        }
    }
}

/// The rows of one table of one batch, as they are decoded: Arrow builders, and
/// the first value that breaks a limit.
#[derive(Debug)]
pub struct TableBuilder {
    table: Table,
    /// Each column with its builder, in file order.
    builders: Vec<(&'static Column, Builder)>,
    rows: usize,
    invalid: Option<Invalid>,
}

impl TableBuilder {
    /// Builders for `rows` rows of `table` (more may be appended).
    pub fn new(table: Table, rows: usize) -> TableBuilder {
        TableBuilder {
            table,
            builders: columns(table)
                .iter()
                .map(|c| (c, Builder::new(c.kind, rows)))
                .collect(),
            rows: 0,
            invalid: None,
        }
    }

    pub fn table(&self) -> Table {
        self.table
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The first value of these rows that breaks a limit, in row order, then
    /// column order.
    pub fn invalid(&self) -> Option<&Invalid> {
        self.invalid.as_ref()
    }

    /// Appends one row and checks its strings.
    pub fn append(&mut self, row: &RowValues<'_>) {
        for (c, builder) in &mut self.builders {
            let f = c.field as usize;
            let v = row.number(f);
            // Scalars of proto3 `optional` fields are null when absent; the
            // others read 0 then.
            let null = c.optional && !row.has(f);
            match builder {
                Builder::U64(b) => b.append_option((!null).then_some(v)),
                Builder::U32(b) => b.append_option((!null).then_some(v as u32)),
                Builder::I64(b) => b.append_option((!null).then_some(v as i64)),
                Builder::Time(b) => b.append_option((!null).then_some(v as i64)),
                Builder::F64(b) => b.append_option((!null).then_some(f64::from_bits(v))),
                Builder::F32(b) => b.append_option((!null).then_some(f64::from_bits(v) as f32)),
                Builder::Bool(b) => b.append_value(v != 0),
                Builder::Mode(b) => b.append_value(mode_label(v)),
                Builder::Str(b) => {
                    let s = row.string(f);
                    if self.invalid.is_none() {
                        self.invalid = check(c, s).err();
                    }
                    b.append_value(s);
                }
            }
        }
        self.rows += 1;
    }

    /// The rows as one record batch, sent by `rank` of `run_id` in batch `seq`
    /// (0: written by the collector itself).
    pub fn finish(mut self, run_id: &str, rank: u32, seq: u64) -> RecordBatch {
        let columns = self.builders.iter_mut().map(|(_, b)| b.finish()).collect();
        with_head(self.table, self.rows, columns, run_id, rank, seq)
    }
}

/// `rows` rows of `table` as a record batch: its `columns` (in file order, one
/// value per row each) after the head columns of `rank` of `run_id` in batch `seq`.
pub fn with_head(
    table: Table,
    rows: usize,
    columns: Vec<ArrayRef>,
    run_id: &str,
    rank: u32,
    seq: u64,
) -> RecordBatch {
    // The one value `rows` times, built whole rather than appended a row at a time.
    let run = StringArray::new(
        OffsetBuffer::from_lengths(std::iter::repeat_n(run_id.len(), rows)),
        Buffer::from(run_id.repeat(rows).into_bytes()),
        None,
    );
    let mut arrays: Vec<ArrayRef> = Vec::with_capacity(3 + columns.len());
    arrays.push(Arc::new(run));
    arrays.push(Arc::new(UInt32Array::from(vec![rank; rows])));
    arrays.push(Arc::new(UInt64Array::from(vec![seq; rows])));
    arrays.extend(columns);
    RecordBatch::try_new(schema(table), arrays)
        .expect("the columns follow the schema's, one value per row each")
}

pub(crate) fn check(c: &Column, value: &str) -> Result<(), Invalid> {
    match c.check {
        Check::None => Ok(()),
        Check::Label => validate::label(c.name, value, MAX_LABEL_BYTES),
        Check::EventMessage => validate::at_most(c.name, value, MAX_EVENT_MESSAGE_BYTES),
    }
}

/// The label of a `RecordingMode` as sent (an `int32`: its low 32 bits).
pub(crate) fn mode_label(value: u64) -> &'static str {
    RecordingMode::try_from(value as i32).map_or("unknown", RecordingMode::label)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The protocol, read as text so the test needs no descriptor machinery.
    const PROTO: &str = include_str!("../../proto/proto/rankscope/v1/telemetry.proto");

    /// (type, name, number, optional) of every field of `message`, in order.
    fn proto_fields(message: &str) -> Vec<(String, String, u32, bool)> {
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
                let (decl, number) = line.trim_end_matches(';').split_once('=')?;
                let words: Vec<&str> = decl.split_whitespace().collect();
                let name = words.last()?.to_string();
                let ty = words.get(words.len().checked_sub(2)?)?.to_string();
                let optional = words.first() == Some(&"optional");
                Some((ty, name, number.trim().parse().ok()?, optional))
            })
            .collect()
    }

    fn proto_type(kind: Kind) -> &'static str {
        match kind {
            U64 => "uint64",
            U32 => "uint32",
            I64 | Time => "int64",
            F64 | F32 => "double",
            Bool => "bool",
            Str => "string",
            Mode => "RecordingMode",
        }
    }

    #[test]
    fn parquet_columns_are_the_proto_fields() {
        for table in Table::ALL {
            let schema = schema(table);
            let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
            assert_eq!(&names[..3], ["run_id", "rank", "seq"], "{}", table.name());
            let mut ours: Vec<(String, String, u32, bool)> = columns(table)
                .iter()
                .map(|c| {
                    let ty = proto_type(c.kind).to_string();
                    (ty, c.name.to_string(), c.field, c.optional)
                })
                .collect();
            let mut fields = proto_fields(table.row_message());
            assert!(!fields.is_empty(), "{}", table.row_message());
            ours.sort();
            fields.sort();
            assert_eq!(
                ours,
                fields,
                "table {} against message {}",
                table.name(),
                table.row_message()
            );
            assert!(
                columns(table)
                    .iter()
                    .all(|c| (c.field as usize) < MAX_FIELD)
            );
        }
        // Every table travels in the Batch field of its name and number.
        let batch_fields = proto_fields("Batch");
        for table in Table::ALL {
            assert!(
                batch_fields
                    .iter()
                    .any(|(_, name, n, _)| name == table.name() && *n == table.batch_field()),
                "{}",
                table.name()
            );
        }
        let mut order = CHECK_ORDER.to_vec();
        order.sort();
        assert_eq!(order, Table::ALL);
    }

    #[test]
    fn layer_columns_are_the_layer_row_fields() {
        use rankscope_proto::columns::{
            ABSENT_FIELD, OPTIONAL_FIELDS, STRING_FIELDS, STRINGS_FIELD,
        };
        let fields = proto_fields("LayerColumns");
        for c in columns(Table::Layers) {
            // String columns travel as indexes into the dictionary.
            let ty = if c.kind == Str {
                "uint32"
            } else {
                proto_type(c.kind)
            };
            assert!(
                fields.contains(&(ty.to_string(), c.name.to_string(), c.field, false)),
                "LayerColumns.{} = {}",
                c.name,
                c.field
            );
            assert_eq!(OPTIONAL_FIELDS.contains(&c.field), c.optional, "{}", c.name);
            assert_eq!(
                STRING_FIELDS.contains(&c.field),
                c.kind == Str,
                "{}",
                c.name
            );
            assert_eq!(rankscope_proto::columns::layer_field_name(c.field), c.name);
        }
        assert!(fields.contains(&("string".into(), "strings".into(), STRINGS_FIELD, false)));
        assert!(fields.contains(&("uint32".into(), "absent".into(), ABSENT_FIELD, false)));
        assert_eq!(fields.len(), columns(Table::Layers).len() + 2);
    }

    #[test]
    fn every_table_finishes_with_its_head_columns() {
        let mut b = TableBuilder::new(Table::Steps, 2);
        let mut row = RowValues::default();
        row.numbers[1] = 1;
        row.numbers[3] = 2.5f64.to_bits();
        row.numbers[8] = 0.5f64.to_bits();
        row.present = 1 << 1 | 1 << 3 | 1 << 8;
        b.append(&row);
        b.append(&row);
        let batch = b.finish("run-a", 3, 7);
        assert_eq!(batch.num_rows(), 2);
        let names: Vec<_> = batch
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        assert_eq!(&names[..4], ["run_id", "rank", "seq", "step"]);
        assert!(names.contains(&"device_peak_bytes".to_string()));
        assert_eq!(batch.column_by_name("loss").unwrap().null_count(), 0);
        assert_eq!(batch.column_by_name("lr").unwrap().null_count(), 2);
        for table in Table::ALL {
            let b = TableBuilder::new(table, 0).finish("r", 0, 0);
            assert_eq!(b.schema().field(0).name(), "run_id");
            assert_eq!(b.schema(), schema(table));
        }
    }
}
