//! The Parquet writer: how a commit encodes the rows of one (table, run) group
//! as one file (ZSTD, encodings chosen per column type by `writer_properties`,
//! row groups of up to `row_group_rows` rows).
//!
//! Imports only `table` (the Arrow schema of each table); nothing of the store,
//! so the `fuzzing` module runs it in memory, and the Delta output
//! ([`crate::delta`]) writes its files with the same `writer_properties`.

use std::io::Write;

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Schema};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::errors::ParquetError;
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;

use crate::table::{self, Table};

/// Properties of a Parquet file of `schema`: zstd, and per column the encoding
/// that suits its values. Values are stored as `table::columns` types them:
/// `layers`' measured values as float32 (`Kind::F32` says why), every other
/// float as float64.
/// - Float columns (measured values) use BYTE_STREAM_SPLIT, which groups the
///   bytes of each position so zstd finds the shared exponents and leading
///   mantissa bytes.
/// - Integer and timestamp columns (`rank`, `seq`, `step`, `time`, shapes,
///   counts) use DELTA_BINARY_PACKED: they are constant within a batch or grow
///   by small steps, which packs to a few bits a value without the dictionary's
///   hashing of every value.
/// - Strings (`run_id`, `layer`, labels) are dictionary encoded.
/// - Except [`PLAIN_COLUMNS`]: integers that are constant within a rank's batch
///   (`rank`, `nonfinite`) or repeat with the layers (`rows`, `cols`), and the
///   short labels `method` and `conv_layout`, are written PLAIN. zstd takes
///   their repeats down to the same bytes, and parquet's delta packing and
///   dictionary cost 2–2.5× more CPU per value.
/// - zstd level 1: level 3 made files at most 3 % smaller on these encodings
///   and cost more CPU per row.
/// - Min/max statistics are kept for integer and timestamp columns, the ones
///   queries filter on (`step`, `time`, `rank`); none for floats and strings,
///   whose per-value comparisons cost about 5 % of the collector's CPU.
///
/// BENCHMARKS.md has the measurements behind each choice.
pub(crate) fn writer_properties(schema: &Schema, row_group_rows: usize) -> WriterProperties {
    let mut props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(
            ZstdLevel::try_new(1).expect("valid level"),
        ))
        .set_dictionary_enabled(true)
        .set_statistics_enabled(EnabledStatistics::None)
        .set_max_row_group_row_count(Some(row_group_rows.max(1)))
        .set_created_by(format!("rankscope {}", env!("CARGO_PKG_VERSION")));
    for field in schema.fields() {
        let column = ColumnPath::from(field.name().as_str());
        let encoding = match field.data_type() {
            _ if PLAIN_COLUMNS.contains(&field.name().as_str()) => Encoding::PLAIN,
            DataType::Float64 | DataType::Float32 => Encoding::BYTE_STREAM_SPLIT,
            DataType::Timestamp(..) | DataType::UInt32 | DataType::UInt64 | DataType::Int64 => {
                props =
                    props.set_column_statistics_enabled(column.clone(), EnabledStatistics::Page);
                Encoding::DELTA_BINARY_PACKED
            }
            _ => continue,
        };
        props = props
            .set_column_dictionary_enabled(column.clone(), false)
            .set_column_encoding(column, encoding);
    }
    props.build()
}

/// Columns written PLAIN whatever their type (see [`writer_properties`]).
const PLAIN_COLUMNS: [&str; 6] = ["rank", "rows", "cols", "nonfinite", "method", "conv_layout"];

/// Encodes record batches of `table` (of one run) as one Parquet file into
/// `sink`, exactly as a commit does; returns the sink. Runs in memory for a
/// `Vec<u8>` sink (the `fuzzing` module does).
pub fn encode_parquet<W: Write + Send>(
    sink: W,
    table: Table,
    batches: &[RecordBatch],
    row_group_rows: usize,
) -> Result<W, ParquetError> {
    let schema = table::schema(table);
    let props = writer_properties(&schema, row_group_rows);
    let mut writer = ArrowWriter::try_new(sink, schema, Some(props))?;
    for batch in batches {
        writer.write(batch)?;
    }
    writer.into_inner()
}
