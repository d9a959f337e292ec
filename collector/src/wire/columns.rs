//! The reader of one `LayerColumns` entry (`Batch.layer_columns`): `layers` rows
//! that travel as columns, read a column at a time into Arrow arrays.
//!
//! A column's values (packed, or one field occurrence each, as prost accepts
//! them) are collected as their 64 bits and then converted to the column's Arrow
//! type in one pass; strings are indexes into the entry's dictionary, each
//! distinct string checked once. What the columns mean, and which entries are
//! refused, is `rankscope_proto::columns`' (`LayerColumns::into_rows`): this
//! reader finds the same rows and the same first broken rule, which the tests
//! and the `fuzzing` module check.

use std::sync::Arc;

use arrow::array::{
    ArrayRef, BooleanArray, Float32Array, Float64Array, Int64Array, StringArray, StringBuilder,
    TimestampMicrosecondArray, UInt32Array, UInt64Array, new_null_array,
};
use arrow::buffer::{BooleanBuffer, Buffer, NullBuffer, OffsetBuffer, ScalarBuffer};
use rankscope_proto::columns::{ABSENT_FIELD, ColumnsError, STRING_FIELDS, STRINGS_FIELD, rows_of};

use super::{
    Malformed, ROW_DEPTH, UNKNOWN, WIRE_TYPES, expect_wire, fixed64, key, length_delimited, skip,
    varint,
};
use crate::table::{self, Kind, MAX_FIELD, Table};
use crate::validate::Invalid;

/// A read `LayerColumns` entry: its columns in file order (head columns aside),
/// or why it was refused.
#[derive(Debug)]
pub struct Chunk {
    pub rows: usize,
    pub arrays: Vec<ArrayRef>,
    /// The first string that breaks a limit, in row order, then column order.
    pub invalid: Option<Invalid>,
}

/// The slot of `absent`'s values, after those of the columns (by field number).
const ABSENT_SLOT: usize = MAX_FIELD;

/// Where a field's values go and the wire type of one unpacked value: the
/// column's slot (its field number; [`ABSENT_SLOT`] for `absent`), and 1 for a
/// double, 0 for the rest (a string column's values are indexes). `None` for
/// numbers that are no column. From the `layers` row's wire types, the one
/// list of them.
fn column(field: u32) -> Option<(usize, u8)> {
    let f = field as usize;
    match field {
        ABSENT_FIELD => Some((ABSENT_SLOT, 0)),
        _ if f < MAX_FIELD => match WIRE_TYPES[Table::Layers.index()][f] {
            UNKNOWN => None,
            1 => Some((f, 1)),
            _ => Some((f, 0)),
        },
        _ => None,
    }
}

/// Values counted on the wire per column of one entry, for the memory bound:
/// its longest column, or its dictionary if that is longer. `Err` where the
/// structure cannot be followed.
pub fn rows_on_wire(mut buf: &[u8]) -> Result<usize, Malformed> {
    let mut counts = [0usize; ABSENT_SLOT + 1];
    let mut strings = 0;
    while !buf.is_empty() {
        let (field, wire) = key(&mut buf)?;
        match column(field) {
            Some((slot, value_wire)) if wire == 2 => {
                let packed = length_delimited(&mut buf)?;
                counts[slot] += if value_wire == 1 {
                    packed.len().div_ceil(8)
                } else {
                    varints_in(packed) + 1
                };
            }
            Some((slot, value_wire)) if wire == value_wire => {
                skip(&mut buf, field, wire, ROW_DEPTH)?;
                counts[slot] += 1;
            }
            _ if field == STRINGS_FIELD => {
                skip(&mut buf, field, wire, ROW_DEPTH)?;
                strings += 1;
            }
            _ => skip(&mut buf, field, wire, ROW_DEPTH)?,
        }
    }
    Ok(counts.into_iter().max().unwrap_or(0).max(strings))
}

/// Reads one entry. `Ok(Err(_))`: a well-formed message whose columns cannot
/// be read as rows, refused whole.
pub fn read(mut buf: &[u8]) -> Result<Result<Chunk, ColumnsError>, Malformed> {
    let mut values: Vec<Vec<u64>> = vec![Vec::new(); ABSENT_SLOT + 1];
    let mut strings: Vec<&str> = Vec::new();
    while !buf.is_empty() {
        let (field, wire) = key(&mut buf)?;
        match column(field) {
            Some((s, value_wire)) => {
                let column = &mut values[s];
                if wire == 2 {
                    let packed = length_delimited(&mut buf)?;
                    if value_wire == 1 {
                        if packed.len() % 8 != 0 {
                            return Err(Malformed("buffer underflow".into()));
                        }
                        let (doubles, _) = packed.as_chunks::<8>();
                        column.extend(doubles.iter().map(|&b| u64::from_le_bytes(b)));
                    } else {
                        extend_varints(column, packed)?;
                    }
                } else {
                    expect_wire(wire, value_wire)?;
                    column.push(if wire == 1 {
                        fixed64(&mut buf)?
                    } else {
                        varint(&mut buf)?
                    });
                }
            }
            _ if field == STRINGS_FIELD => {
                expect_wire(wire, 2)?;
                let bytes = length_delimited(&mut buf)?;
                strings.push(std::str::from_utf8(bytes).map_err(|_| {
                    Malformed("invalid string value: data is not UTF-8 encoded".into())
                })?);
            }
            _ => skip(&mut buf, field, wire, ROW_DEPTH)?,
        }
    }
    Ok(build(values, &strings))
}

/// The number of varints in `packed`: one per byte below 0x80 (each varint's
/// last). Counted in runs of at most 255 bytes into a byte-wide sum, which the
/// compiler turns into vector adds.
fn varints_in(packed: &[u8]) -> usize {
    let continued: usize = packed
        .chunks(255)
        .map(|run| usize::from(run.iter().fold(0u8, |n, &b| n.wrapping_add(b >> 7))))
        .sum();
    packed.len() - continued
}

/// Appends the packed varints of `packed` to `column`, as prost reads them: at
/// most 10 bytes a value, the tenth at most 1, and none cut off at the end. A
/// value of one byte is taken as it is; one of 2 to 8 bytes (a `time` takes 8)
/// from one 8-byte word, without a loop over its bytes; the rest (9 or 10 bytes,
/// or the last few bytes of the column) by [`varint`], which words the errors.
fn extend_varints(column: &mut Vec<u64>, mut packed: &[u8]) -> Result<(), Malformed> {
    column.reserve_exact(varints_in(packed));
    while let Some(&first) = packed.first() {
        if first < 0x80 {
            column.push(u64::from(first));
            packed = &packed[1..];
            continue;
        }
        if let Some(word) = packed.first_chunk::<8>() {
            let word = u64::from_le_bytes(*word);
            let ends = !word & 0x8080_8080_8080_8080;
            if ends != 0 {
                let len = ends.trailing_zeros() as usize / 8 + 1;
                let bytes = if len == 8 {
                    word
                } else {
                    word & ((1 << (8 * len)) - 1)
                };
                column.push(seven_bit_groups(bytes));
                packed = &packed[len..];
                continue;
            }
        }
        column.push(varint(&mut packed)?);
    }
    Ok(())
}

/// The value of a varint of at most 8 bytes, given as its bytes in a little-endian
/// word (zero past its end): each byte's low 7 bits, packed together.
fn seven_bit_groups(bytes: u64) -> u64 {
    let x = bytes & 0x7f7f_7f7f_7f7f_7f7f;
    let x = (x & 0x007f_007f_007f_007f) | ((x & 0x7f00_7f00_7f00_7f00) >> 1);
    let x = (x & 0x0000_3fff_0000_3fff) | ((x & 0x3fff_0000_3fff_0000) >> 2);
    (x & 0x0000_0000_0fff_ffff) | ((x & 0x0fff_ffff_0000_0000) >> 4)
}

/// The columns as Arrow arrays, after the checks of `LayerColumns::into_rows`.
fn build(mut values: Vec<Vec<u64>>, strings: &[&str]) -> Result<Chunk, ColumnsError> {
    let lengths: Vec<(u32, usize)> = (1..MAX_FIELD)
        .filter(|&f| column(f as u32).is_some())
        .map(|f| (f as u32, values[f].len()))
        .chain([(ABSENT_FIELD, values[ABSENT_SLOT].len())])
        .collect();
    let n = rows_of(&lengths)?;
    // Indexes into the dictionary: the first bad one in row order, then column order.
    let bad_index = STRING_FIELDS
        .iter()
        .filter_map(|&f| {
            let row = values[f as usize]
                .iter()
                .position(|&i| i as u32 as usize >= strings.len())?;
            Some((row, f))
        })
        .min();
    if let Some((row, field)) = bad_index {
        return Err(ColumnsError::Index {
            field,
            row,
            index: values[field as usize][row] as u32,
            strings: strings.len(),
        });
    }
    let invalid = first_invalid(&values, strings, n);
    let absent = std::mem::take(&mut values[ABSENT_SLOT]);
    let any_absent = absent
        .iter()
        .fold(0u64, |acc, &a| acc | u64::from(a as u32));
    let schema = table::schema(Table::Layers);
    let columns = table::columns(Table::Layers);
    let mut arrays = Vec::with_capacity(columns.len());
    for (i, c) in columns.iter().enumerate() {
        let column = std::mem::take(&mut values[c.field as usize]);
        let bit = 1u64 << c.field;
        let array: ArrayRef = if column.is_empty() && c.optional {
            // After the three head columns.
            new_null_array(schema.field(3 + i).data_type(), n)
        } else if column.is_empty() {
            defaults(c.kind, n)
        } else if c.kind == Kind::Str {
            let mut b = StringBuilder::with_capacity(n, n * 16);
            for i in column {
                b.append_value(strings[i as u32 as usize]);
            }
            Arc::new(b.finish())
        } else {
            let nulls = (c.optional && any_absent & bit != 0)
                .then(|| NullBuffer::from_iter(absent.iter().map(|a| a & bit == 0)));
            numbers(c.kind, column, nulls)
        };
        arrays.push(array);
    }
    Ok(Chunk {
        rows: n,
        arrays,
        invalid,
    })
}

/// The first string of the rows that breaks its column's limit, in row order,
/// then column order; each distinct string is checked once.
fn first_invalid(values: &[Vec<u64>], strings: &[&str], n: usize) -> Option<Invalid> {
    let columns: Vec<_> = table::columns(Table::Layers)
        .iter()
        .filter(|c| c.kind == Kind::Str && !values[c.field as usize].is_empty())
        .collect();
    let first = columns.first()?;
    let bad: Vec<bool> = strings
        .iter()
        .map(|s| table::check(first, s).is_err())
        .collect();
    if !bad.contains(&true) {
        return None;
    }
    (0..n).find_map(|row| {
        columns.iter().find_map(|c| {
            let s = strings[values[c.field as usize][row] as u32 as usize];
            table::check(c, s).err()
        })
    })
}

/// `n` rows of a non-optional column's default: 0, "" or false.
fn defaults(kind: Kind, n: usize) -> ArrayRef {
    match kind {
        Kind::Str => Arc::new(StringArray::new(
            OffsetBuffer::new_zeroed(n),
            Buffer::from(Vec::<u8>::new()),
            None,
        )),
        Kind::Bool => Arc::new(BooleanArray::new(BooleanBuffer::new_unset(n), None)),
        kind => numbers(kind, vec![0; n], None),
    }
}

/// A numeric column from its values' 64 bits, converted as prost converts them
/// (`uint32` keeps the low 32 bits, `bool` is non-zero, doubles stored as
/// float32 round to nearest).
fn numbers(kind: Kind, bits: Vec<u64>, nulls: Option<NullBuffer>) -> ArrayRef {
    match kind {
        Kind::U64 => Arc::new(UInt64Array::new(ScalarBuffer::from(bits), nulls)),
        Kind::U32 => {
            let v: Vec<u32> = bits.into_iter().map(|b| b as u32).collect();
            Arc::new(UInt32Array::new(ScalarBuffer::from(v), nulls))
        }
        Kind::I64 => {
            let v: Vec<i64> = bits.into_iter().map(|b| b as i64).collect();
            Arc::new(Int64Array::new(ScalarBuffer::from(v), nulls))
        }
        Kind::Time => {
            let v: Vec<i64> = bits.into_iter().map(|b| b as i64).collect();
            Arc::new(
                TimestampMicrosecondArray::new(ScalarBuffer::from(v), nulls).with_timezone("UTC"),
            )
        }
        Kind::F64 => {
            let v: Vec<f64> = bits.into_iter().map(f64::from_bits).collect();
            Arc::new(Float64Array::new(ScalarBuffer::from(v), nulls))
        }
        Kind::F32 => {
            let v: Vec<f32> = bits.into_iter().map(|b| f64::from_bits(b) as f32).collect();
            Arc::new(Float32Array::new(ScalarBuffer::from(v), nulls))
        }
        Kind::Bool => {
            let array = BooleanArray::from_iter(bits.iter().map(|&b| Some(b != 0)));
            match nulls {
                Some(nulls) => Arc::new(BooleanArray::new(array.values().clone(), Some(nulls))),
                None => Arc::new(array),
            }
        }
        Kind::Mode => {
            let labels = bits.iter().map(|&b| table::mode_label(b));
            Arc::new(arrow::array::StringArray::from_iter_values(labels))
        }
        // String columns are read from the dictionary; none comes here.
        Kind::Str => Arc::new(arrow::array::StringArray::from_iter_values(
            std::iter::repeat_n("", bits.len()),
        )),
    }
}
