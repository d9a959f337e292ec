//! The collector's reader of `AgentMessage` bytes: a `Batch` is decoded straight
//! into the Arrow builders of its tables ([`TableBuilder`]), with no row structs.
//!
//! Why not prost for batches: prost can only decode into its generated structs,
//! a `String` allocated per label and 200 to 300 bytes per row, which the
//! collector then copied into Arrow columns and dropped. That was a third of the
//! collector's CPU time per row. This reader walks the wire format once, appends
//! each row's fields to its table's column builders (strings are borrowed from the
//! message until they are appended) and checks the labels as it goes. The column
//! list is `table::columns`, the one place a field becomes a column. A `Hello`
//! (once per stream) is still decoded by prost.
//!
//! Contract: it accepts exactly what prost's `AgentMessage::decode` accepts and
//! reads the same values (the tests and the `fuzzing` module compare both on
//! random and mutated messages). It follows the rules prost applies:
//! - the last occurrence of a scalar or string field wins; each occurrence of a
//!   repeated row field is a row; occurrences of the `batch` field merge, and a
//!   `hello` field between them replaces the batch (oneof), so a message with a
//!   `hello` field is decoded by prost first and only the batch after the last
//!   `hello` is read here;
//! - a known field with the wrong wire type, a key over 32 bits, field 0, wire
//!   types 6 and 7, a varint over 10 bytes or past 64 bits, a length or value past
//!   the end, an unmatched end-group tag, strings that are not UTF-8, and unknown
//!   groups nested past prost's recursion limit (100 levels, counted from the
//!   `AgentMessage`) are malformed;
//! - unknown fields are skipped.
//!
//! `layers` rows that travel as columns (`Batch.layer_columns`) are read by
//! [`columns`], a column at a time; their rows follow the batch's `layers` rows.
//!
//! Nothing here panics or allocates in proportion to anything but the rows,
//! which `grpc` counted (and bounded) on the wire before this runs.

pub mod columns;

use arrow::array::RecordBatch;
use prost::Message as _;
use rankscope_proto::columns::LAYER_COLUMNS_FIELD;
use rankscope_proto::v1::agent_message::Kind as AgentKind;
use rankscope_proto::v1::{AgentMessage, Batch, Hello};

use crate::buffer::BatchRecords;
use crate::table::{self, MAX_FIELD, RowValues, Table, TableBuilder};
use crate::validate::Invalid;

/// Rows per table (in [`Table::ALL`] order), as counted on the wire: the
/// builders' starting capacity.
pub type TableRows = [usize; Table::ALL.len()];

/// prost's recursion budget at the `AgentMessage`'s own fields; one less inside
/// a `Batch`, two less inside a row.
const TOP_DEPTH: u32 = 100;
const BATCH_DEPTH: u32 = TOP_DEPTH - 1;
const ROW_DEPTH: u32 = TOP_DEPTH - 2;

/// A field number no row message has.
const UNKNOWN: u8 = u8::MAX;

/// The wire type of each field of each row message (by [`Table::index`] and
/// field number), [`UNKNOWN`] for numbers the message does not have.
const WIRE_TYPES: [[u8; MAX_FIELD]; Table::ALL.len()] = {
    let mut all = [[UNKNOWN; MAX_FIELD]; Table::ALL.len()];
    let mut t = 0;
    while t < Table::ALL.len() {
        let cols = table::columns(Table::ALL[t]);
        let mut i = 0;
        while i < cols.len() {
            all[t][cols[i].field as usize] = cols[i].kind.wire_type();
            i += 1;
        }
        t += 1;
    }
    all
};

/// Bytes that are not a rankscope.v1 message; says why, as prost words it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("failed to decode Protobuf message: {0}")]
pub struct Malformed(String);

fn malformed<T>(why: &str) -> Result<T, Malformed> {
    Err(Malformed(why.to_string()))
}

/// One decoded `AgentMessage`.
#[derive(Debug)]
pub enum Message {
    /// No `kind`: neither a Hello nor a Batch.
    Empty,
    Hello(Hello),
    Batch(DecodedBatch),
}

/// A `Batch`, its rows in Arrow builders per table.
#[derive(Debug, Default)]
pub struct DecodedBatch {
    pub seq: u64,
    pub is_final: bool,
    /// The gap the agent declares before `seq` (`Batch.dropped_from`; 0: none).
    pub dropped_from: u64,
    /// Boxed: a batch moves between tasks, most of its slots empty.
    tables: [Option<Box<TableBuilder>>; Table::ALL.len()],
    /// `layers` rows read from `layer_columns` entries, in order.
    layer_chunks: Vec<columns::Chunk>,
    /// The first `layer_columns` entry that cannot be read as rows: the batch is
    /// refused for it.
    columns_invalid: Option<Invalid>,
}

impl DecodedBatch {
    /// Rows of `table` in the batch.
    pub fn rows(&self, table: Table) -> usize {
        let chunks = match table {
            Table::Layers => self.layer_chunks.iter().map(|c| c.rows).sum(),
            _ => 0,
        };
        self.tables[table.index()].as_ref().map_or(0, |b| b.rows()) + chunks
    }

    /// Rows of all tables.
    pub fn total_rows(&self) -> usize {
        Table::ALL.iter().map(|&t| self.rows(t)).sum()
    }

    /// The first value that breaks a limit: a `layer_columns` entry that cannot
    /// be read as rows, else the first in [`table::CHECK_ORDER`] of the tables,
    /// then in row order, then in column order, the order of `validate::batch`
    /// (over the batch as rows).
    pub fn invalid(&self) -> Option<&Invalid> {
        if self.columns_invalid.is_some() {
            return self.columns_invalid.as_ref();
        }
        table::CHECK_ORDER.iter().find_map(|&t| {
            let rows = self.tables[t.index()].as_ref().and_then(|b| b.invalid());
            match t {
                Table::Layers => {
                    rows.or_else(|| self.layer_chunks.iter().find_map(|c| c.invalid.as_ref()))
                }
                _ => rows,
            }
        })
    }

    /// The rows as record batches, sent by `rank` of `run_id`; tables without
    /// rows are left out.
    pub fn finish(self, run_id: &str, rank: u32) -> BatchRecords {
        let seq = self.seq;
        let mut chunks = self.layer_chunks;
        let mut tables: Vec<(Table, RecordBatch)> = Vec::new();
        for (table, builder) in Table::ALL.into_iter().zip(self.tables) {
            let mut parts: Vec<RecordBatch> = builder
                .filter(|b| b.rows() > 0)
                .map(|b| b.finish(run_id, rank, seq))
                .into_iter()
                .collect();
            if table == Table::Layers {
                parts.extend(
                    chunks
                        .drain(..)
                        .filter(|c| c.rows > 0)
                        .map(|c| table::with_head(table, c.rows, c.arrays, run_id, rank, seq)),
                );
            }
            let records = match parts.len() {
                0 => continue,
                1 => parts.pop().expect("one part"),
                _ => arrow::compute::concat_batches(&table::schema(table), &parts)
                    .expect("parts of one schema concatenate"),
            };
            tables.push((table, records));
        }
        BatchRecords {
            seq,
            is_final: self.is_final,
            dropped_from: self.dropped_from,
            tables,
        }
    }

    /// Reads one occurrence of a `Batch` payload into this batch (occurrences
    /// merge: rows add up, the last `seq` and `final` win).
    fn merge(&mut self, mut buf: &[u8], capacity: &TableRows) -> Result<(), Malformed> {
        let mut row = RowValues::default();
        while !buf.is_empty() {
            let (field, wire) = key(&mut buf)?;
            match (field, Table::of_batch_field(field)) {
                (1, _) => {
                    expect_wire(wire, 0)?;
                    self.seq = varint(&mut buf)?;
                }
                (2, _) => {
                    expect_wire(wire, 0)?;
                    self.is_final = varint(&mut buf)? != 0;
                }
                (9, _) => {
                    expect_wire(wire, 0)?;
                    self.dropped_from = varint(&mut buf)?;
                }
                (LAYER_COLUMNS_FIELD, _) => {
                    expect_wire(wire, 2)?;
                    match columns::read(length_delimited(&mut buf)?)? {
                        Ok(chunk) => self.layer_chunks.push(chunk),
                        Err(e) => {
                            self.columns_invalid.get_or_insert(Invalid::Columns(e));
                        }
                    }
                }
                (_, Some(table)) => {
                    expect_wire(wire, 2)?;
                    let payload = length_delimited(&mut buf)?;
                    read_row(payload, &WIRE_TYPES[table.index()], &mut row)?;
                    self.tables[table.index()]
                        .get_or_insert_with(|| {
                            Box::new(TableBuilder::new(table, capacity[table.index()]))
                        })
                        .append(&row);
                }
                (_, None) => skip(&mut buf, field, wire, BATCH_DEPTH)?,
            }
        }
        Ok(())
    }
}

/// Decodes one `AgentMessage`; `capacity` is the rows per table to make room for
/// (0 is fine: the builders grow).
pub fn decode_agent_message(bytes: &[u8], capacity: &TableRows) -> Result<Message, Malformed> {
    let mut buf = bytes;
    let mut batch: Option<DecodedBatch> = None;
    while !buf.is_empty() {
        let (field, wire) = key(&mut buf)?;
        match field {
            1 => return with_hello(bytes, capacity),
            2 => {
                expect_wire(wire, 2)?;
                let payload = length_delimited(&mut buf)?;
                batch.get_or_insert_default().merge(payload, capacity)?;
            }
            _ => skip(&mut buf, field, wire, TOP_DEPTH)?,
        }
    }
    Ok(batch.map_or(Message::Empty, Message::Batch))
}

/// Decodes the payload of a `Batch` (the inner message alone, as the `batch`
/// fuzz target sends it).
pub fn decode_batch(bytes: &[u8], capacity: &TableRows) -> Result<DecodedBatch, Malformed> {
    let mut batch = DecodedBatch::default();
    batch.merge(bytes, capacity)?;
    Ok(batch)
}

/// Rows the collector writes itself (a vanished rank's `ranks` row), made with
/// the prost types, as record batches of `rank` of `run_id` with seq 0: encoded and
/// read back, so they take the same path to their columns as an agent's rows.
pub fn own_rows(batch: &Batch, run_id: &str, rank: u32) -> Vec<(Table, RecordBatch)> {
    let bytes = batch.encode_to_vec();
    let mut decoded =
        decode_batch(&bytes, &[0; Table::ALL.len()]).expect("prost's encoding of a Batch decodes");
    decoded.seq = 0;
    decoded.finish(run_id, rank).tables
}

/// A message with a `hello` field: prost decides what it is (a Hello, or a
/// Batch whose occurrences after the last Hello are read here).
fn with_hello(bytes: &[u8], capacity: &TableRows) -> Result<Message, Malformed> {
    let message = AgentMessage::decode(bytes).map_err(|e| Malformed(e.to_string()))?;
    match message.kind {
        None => Ok(Message::Empty),
        Some(AgentKind::Hello(hello)) => Ok(Message::Hello(hello)),
        Some(AgentKind::Batch(_)) => {
            let mut buf = bytes;
            let mut batch = DecodedBatch::default();
            while !buf.is_empty() {
                let (field, wire) = key(&mut buf)?;
                match field {
                    1 => {
                        length_delimited(&mut buf)?;
                        batch = DecodedBatch::default();
                    }
                    2 => batch.merge(length_delimited(&mut buf)?, capacity)?,
                    _ => skip(&mut buf, field, wire, TOP_DEPTH)?,
                }
            }
            Ok(Message::Batch(batch))
        }
    }
}

/// Reads one row message into `row` (cleared first).
fn read_row<'a>(
    mut buf: &'a [u8],
    wire_types: &[u8; MAX_FIELD],
    row: &mut RowValues<'a>,
) -> Result<(), Malformed> {
    row.clear();
    while !buf.is_empty() {
        let (field, wire) = key(&mut buf)?;
        let f = field as usize;
        let expected = wire_types.get(f).copied().unwrap_or(UNKNOWN);
        if expected == UNKNOWN {
            skip(&mut buf, field, wire, ROW_DEPTH)?;
            continue;
        }
        expect_wire(wire, expected)?;
        match wire {
            0 => row.numbers[f] = varint(&mut buf)?,
            1 => row.numbers[f] = fixed64(&mut buf)?,
            _ => {
                let bytes = length_delimited(&mut buf)?;
                row.strings[f] = std::str::from_utf8(bytes)
                    .or_else(|_| malformed("invalid string value: data is not UTF-8 encoded"))?;
            }
        }
        row.present |= 1 << f;
    }
    Ok(())
}

fn expect_wire(wire: u8, expected: u8) -> Result<(), Malformed> {
    if wire == expected {
        Ok(())
    } else {
        Err(Malformed(format!(
            "invalid wire type: {wire} (expected {expected})"
        )))
    }
}

/// Skips an unknown field, as prost's `skip_field` does (`depth`: the recursion
/// budget left).
fn skip(buf: &mut &[u8], field: u32, wire: u8, depth: u32) -> Result<(), Malformed> {
    if depth == 0 {
        return malformed("recursion limit reached");
    }
    let len = match wire {
        0 => varint(buf).map(|_| 0)?,
        1 => 8,
        2 => varint(buf)?,
        3 => loop {
            let (inner, inner_wire) = key(buf)?;
            if inner_wire == 4 {
                if inner != field {
                    return malformed("unexpected end group tag");
                }
                break 0;
            }
            skip(buf, inner, inner_wire, depth - 1)?;
        },
        4 => return malformed("unexpected end group tag"),
        _ => 4,
    };
    advance(buf, len)?;
    Ok(())
}

/// Takes `len` bytes off the front of `buf`.
fn advance<'a>(buf: &mut &'a [u8], len: u64) -> Result<&'a [u8], Malformed> {
    match usize::try_from(len).ok().filter(|&n| n <= buf.len()) {
        Some(n) => {
            let (head, rest) = buf.split_at(n);
            *buf = rest;
            Ok(head)
        }
        None => malformed("buffer underflow"),
    }
}

#[inline(always)]
fn length_delimited<'a>(buf: &mut &'a [u8]) -> Result<&'a [u8], Malformed> {
    let len = varint(buf)?;
    advance(buf, len)
}

fn fixed64(buf: &mut &[u8]) -> Result<u64, Malformed> {
    let bytes = advance(buf, 8)?;
    let mut le = [0; 8];
    le.copy_from_slice(bytes);
    Ok(u64::from_le_bytes(le))
}

/// A field's number and wire type.
#[inline(always)]
fn key(buf: &mut &[u8]) -> Result<(u32, u8), Malformed> {
    // A valid key of one byte (fields 1 to 15: nearly every key) or two
    // (fields up to 2047) is read here; longer keys and errors take the general
    // path, which words the error.
    let (key, len) = match **buf {
        [b0, ..] if b0 < 0x80 => (u32::from(b0), 1),
        [b0, b1, ..] if b1 < 0x80 => (u32::from(b0 & 0x7f) | u32::from(b1) << 7, 2),
        _ => return any_key(buf),
    };
    if key & 7 > 5 || key >> 3 == 0 {
        return any_key(buf);
    }
    *buf = &buf[len..];
    Ok((key >> 3, (key & 7) as u8))
}

/// [`key`] for any key: a varint of up to 32 bits.
fn any_key(buf: &mut &[u8]) -> Result<(u32, u8), Malformed> {
    let key = varint(buf)?;
    let Ok(key) = u32::try_from(key) else {
        return Err(Malformed(format!("invalid key value: {key}")));
    };
    let wire = (key & 7) as u8;
    if wire > 5 {
        return Err(Malformed(format!("invalid wire type value: {wire}")));
    }
    if key >> 3 == 0 {
        return malformed("invalid tag value: 0");
    }
    Ok((key >> 3, wire))
}

/// A base-128 varint: at most 10 bytes, and the 10th may only carry bit 63.
fn varint(buf: &mut &[u8]) -> Result<u64, Malformed> {
    if let Some((&byte, rest)) = buf.split_first()
        && byte < 0x80
    {
        *buf = rest;
        return Ok(u64::from(byte));
    }
    let mut value = 0u64;
    for i in 0..10 {
        let Some((&byte, rest)) = buf.split_first() else {
            break;
        };
        *buf = rest;
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte < 0x80 {
            if i == 9 && byte >= 2 {
                break;
            }
            return Ok(value);
        }
    }
    malformed("invalid varint")
}

#[cfg(test)]
mod tests;
