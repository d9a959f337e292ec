//! `layers` rows as columns ([`LayerColumns`], `Batch.layer_columns`): the agent
//! turns its rows into columns before it sends them ([`LayerColumns::from_rows`]),
//! and [`LayerColumns::into_rows`] reads them back as rows, which is the meaning
//! of the message: the collector's column reader is checked against it.
//!
//! The rules (the `.proto` file words them for other implementations):
//! - every column has the number and name of its `LayerRow` field;
//! - the rows are as many as the longest column, and a column holds one value per
//!   row or none; none reads as every row's default, or null for an optional field;
//! - a row's optional value is null where its bit in `absent` is set;
//! - string columns hold indexes into `strings`.
//!
//! A message that breaks them is refused whole ([`ColumnsError`], the first broken
//! rule: lengths in field order, then indexes in row and column order).

use std::collections::HashMap;

use crate::v1::{Batch, LayerColumns, LayerRow};

/// The `LayerRow` field numbers of the optional fields (one bit each in `absent`).
pub const OPTIONAL_FIELDS: [u32; 15] = [7, 8, 9, 10, 11, 12, 13, 14, 15, 20, 21, 22, 23, 24, 25];
/// Calls macro `$m` with every optional field as `name = number`: the one list
/// the conversions both ways are written from.
macro_rules! optional_fields {
    ($m:ident) => {
        $m!(
            stable_rank = 7,
            participation_ratio = 8,
            participation_ratio_sv = 9,
            cum_energy_90 = 10,
            nuclear_norm_ratio = 11,
            effective_rank = 12,
            mean = 13,
            std = 14,
            zero_fraction = 15,
            stable_rank_err = 20,
            participation_ratio_err = 21,
            participation_ratio_sv_err = 22,
            cum_energy_90_err = 23,
            nuclear_norm_ratio_err = 24,
            effective_rank_err = 25
        )
    };
}

/// The `LayerRow` field numbers of the string fields, in column order.
pub const STRING_FIELDS: [u32; 3] = [3, 18, 19];
/// The `Batch` field that carries `layers` rows as columns.
pub const LAYER_COLUMNS_FIELD: u32 = 11;
/// The `LayerColumns` field numbers of the dictionary and of the null bits.
pub const STRINGS_FIELD: u32 = 30;
pub const ABSENT_FIELD: u32 = 31;

/// The name of `LayerRow` field (and `LayerColumns` column) `field`.
pub fn layer_field_name(field: u32) -> &'static str {
    match field {
        1 => "step",
        2 => "time",
        3 => "layer",
        4 => "rows",
        5 => "cols",
        6 => "centered",
        7 => "stable_rank",
        8 => "participation_ratio",
        9 => "participation_ratio_sv",
        10 => "cum_energy_90",
        11 => "nuclear_norm_ratio",
        12 => "effective_rank",
        13 => "mean",
        14 => "std",
        15 => "zero_fraction",
        16 => "nonfinite",
        17 => "compute_ms",
        18 => "conv_layout",
        19 => "method",
        20 => "stable_rank_err",
        21 => "participation_ratio_err",
        22 => "participation_ratio_sv_err",
        23 => "cum_energy_90_err",
        24 => "nuclear_norm_ratio_err",
        25 => "effective_rank_err",
        ABSENT_FIELD => "absent",
        _ => "unknown",
    }
}

/// Why a `LayerColumns` message cannot be read as rows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ColumnsError {
    #[error(
        "layer_columns: column {} has {values} values for {rows} rows (one per row, or none)",
        layer_field_name(*field)
    )]
    Length {
        field: u32,
        values: usize,
        rows: usize,
    },
    #[error(
        "layer_columns: row {row}'s {} is string {index}, but the batch has {strings} strings",
        layer_field_name(*field)
    )]
    Index {
        field: u32,
        row: usize,
        index: u32,
        strings: usize,
    },
}

/// Lengths of the columns that must hold one value per row or none, with their
/// field numbers, in field order.
fn lengths(c: &LayerColumns) -> [(u32, usize); 26] {
    [
        (1, c.step.len()),
        (2, c.time.len()),
        (3, c.layer.len()),
        (4, c.rows.len()),
        (5, c.cols.len()),
        (6, c.centered.len()),
        (7, c.stable_rank.len()),
        (8, c.participation_ratio.len()),
        (9, c.participation_ratio_sv.len()),
        (10, c.cum_energy_90.len()),
        (11, c.nuclear_norm_ratio.len()),
        (12, c.effective_rank.len()),
        (13, c.mean.len()),
        (14, c.std.len()),
        (15, c.zero_fraction.len()),
        (16, c.nonfinite.len()),
        (17, c.compute_ms.len()),
        (18, c.conv_layout.len()),
        (19, c.method.len()),
        (20, c.stable_rank_err.len()),
        (21, c.participation_ratio_err.len()),
        (22, c.participation_ratio_sv_err.len()),
        (23, c.cum_energy_90_err.len()),
        (24, c.nuclear_norm_ratio_err.len()),
        (25, c.effective_rank_err.len()),
        (ABSENT_FIELD, c.absent.len()),
    ]
}

/// The rows of a message whose columns have `lengths` (field, values): the
/// longest, or the first column (in field order) that has neither that many
/// values nor none.
pub fn rows_of(lengths: &[(u32, usize)]) -> Result<usize, ColumnsError> {
    let rows = lengths.iter().map(|&(_, n)| n).max().unwrap_or(0);
    match lengths.iter().find(|&&(_, n)| n != 0 && n != rows) {
        Some(&(field, values)) => Err(ColumnsError::Length {
            field,
            values,
            rows,
        }),
        None => Ok(rows),
    }
}

impl LayerColumns {
    /// The rows the message holds: its longest column.
    pub fn row_count(&self) -> usize {
        lengths(self).iter().map(|&(_, n)| n).max().unwrap_or(0)
    }

    /// The rows as columns, in order. Columns whose every value is the default
    /// (or null) are left empty, and so are the null bits of such columns; `step`
    /// always holds one value per row.
    pub fn from_rows(rows: Vec<LayerRow>) -> LayerColumns {
        let n = rows.len();
        let mut c = LayerColumns::default();
        let mut index: HashMap<String, u32> = HashMap::new();
        let mut intern = |strings: &mut Vec<String>, s: String| -> u32 {
            if let Some(&i) = index.get(&s) {
                return i;
            }
            let i = strings.len() as u32;
            strings.push(s.clone());
            index.insert(s, i);
            i
        };
        macro_rules! reserve {
            ($($f:ident),*) => { $(c.$f.reserve(n);)* };
        }
        reserve!(
            step,
            time,
            layer,
            rows,
            cols,
            centered,
            nonfinite,
            compute_ms,
            conv_layout
        );
        reserve!(method, absent);
        for r in rows {
            let mut absent = 0u32;
            macro_rules! push_optional {
                ($($f:ident = $field:literal),*) => {$(
                    match r.$f {
                        Some(v) => c.$f.push(v),
                        None => {
                            c.$f.push(Default::default());
                            absent |= 1 << $field;
                        }
                    }
                )*};
            }
            optional_fields!(push_optional);
            c.step.push(r.step);
            c.time.push(r.time);
            c.layer.push(intern(&mut c.strings, r.layer));
            c.rows.push(r.rows);
            c.cols.push(r.cols);
            c.centered.push(r.centered);
            c.nonfinite.push(r.nonfinite);
            c.compute_ms.push(r.compute_ms);
            c.conv_layout.push(intern(&mut c.strings, r.conv_layout));
            c.method.push(intern(&mut c.strings, r.method));
            c.absent.push(absent);
        }
        // Empty where nothing is said: a default column, or an optional one that
        // is null in every row (its bits go too).
        let all_null = |bit: u32| c.absent.iter().all(|a| a & (1 << bit) != 0);
        let mut cleared = 0u32;
        macro_rules! clear_if_null {
            ($($f:ident = $field:literal),*) => {$(
                if all_null($field) {
                    cleared |= 1 << $field;
                }
            )*
            $(
                if cleared & (1 << $field) != 0 {
                    c.$f = Vec::new();
                }
            )*};
        }
        optional_fields!(clear_if_null);
        for a in &mut c.absent {
            *a &= !cleared;
        }
        macro_rules! clear_if_default {
            ($($f:ident),*) => {$(
                if c.$f.iter().all(|v| *v == Default::default()) {
                    c.$f = Vec::new();
                }
            )*};
        }
        // `step` stays whole: it carries the row count when every other column is empty.
        clear_if_default!(time, rows, cols, centered, nonfinite, compute_ms, absent);
        // A string column is default where every row is "".
        for field in STRING_FIELDS {
            let column = match field {
                3 => &mut c.layer,
                18 => &mut c.conv_layout,
                _ => &mut c.method,
            };
            if column.iter().all(|&i| c.strings[i as usize].is_empty()) {
                *column = Vec::new();
            }
        }
        if c.layer.is_empty() && c.conv_layout.is_empty() && c.method.is_empty() {
            c.strings = Vec::new();
        }
        c
    }

    /// The rows, in order; the first broken rule when the columns cannot be read.
    pub fn into_rows(self) -> Result<Vec<LayerRow>, ColumnsError> {
        let n = rows_of(&lengths(&self))?;
        let c = self;
        for row in 0..n {
            for (field, column) in [(3, &c.layer), (18, &c.conv_layout), (19, &c.method)] {
                if let Some(&index) = column.get(row)
                    && index as usize >= c.strings.len()
                {
                    return Err(ColumnsError::Index {
                        field,
                        row,
                        index,
                        strings: c.strings.len(),
                    });
                }
            }
        }
        let string = |column: &[u32], row: usize| {
            column
                .get(row)
                .map_or_else(String::new, |&i| c.strings[i as usize].clone())
        };
        fn value<T: Copy + Default>(column: &[T], row: usize) -> T {
            column.get(row).copied().unwrap_or_default()
        }
        let absent = |row: usize, field: u32| {
            c.absent
                .get(row)
                .is_some_and(|bits| bits & (1 << field) != 0)
        };
        fn opt<T: Copy>(column: &[T], row: usize, absent: bool) -> Option<T> {
            if absent {
                None
            } else {
                column.get(row).copied()
            }
        }
        Ok((0..n)
            .map(|i| {
                let mut row = LayerRow {
                    step: value(&c.step, i),
                    time: value(&c.time, i),
                    layer: string(&c.layer, i),
                    rows: value(&c.rows, i),
                    cols: value(&c.cols, i),
                    centered: c.centered.get(i).copied().unwrap_or(false),
                    nonfinite: value(&c.nonfinite, i),
                    compute_ms: c.compute_ms.get(i).copied().unwrap_or(0.0),
                    conv_layout: string(&c.conv_layout, i),
                    method: string(&c.method, i),
                    ..LayerRow::default()
                };
                macro_rules! read_optional {
                    ($($f:ident = $field:literal),*) => {$(
                        row.$f = opt(&c.$f, i, absent(i, $field));
                    )*};
                }
                optional_fields!(read_optional);
                row
            })
            .collect())
    }
}

impl Batch {
    /// Moves the batch's `layers` rows into one `layer_columns` entry (for a
    /// collector of [`crate::LAYER_COLUMNS_MINOR`] or later).
    pub fn layers_as_columns(&mut self) {
        if !self.layers.is_empty() {
            let rows = std::mem::take(&mut self.layers);
            self.layer_columns.push(LayerColumns::from_rows(rows));
        }
    }

    /// Moves the rows of every `layer_columns` entry to the end of `layers`, in
    /// order: the batch as rows alone.
    pub fn layers_as_rows(&mut self) -> Result<(), ColumnsError> {
        for columns in std::mem::take(&mut self.layer_columns) {
            self.layers.extend(columns.into_rows()?);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(i: u64) -> LayerRow {
        LayerRow {
            step: i,
            time: 1_700_000_000_000_000 + i as i64,
            layer: format!("block.{}", i % 3),
            rows: 64,
            cols: 128,
            centered: i.is_multiple_of(2),
            stable_rank: Some(1.5 + i as f64),
            participation_ratio: (i % 3 != 1).then_some(2.5),
            cum_energy_90: Some(7),
            mean: Some(-0.25),
            nonfinite: i % 4,
            compute_ms: 0.125,
            method: if i.is_multiple_of(5) {
                "sketch"
            } else {
                "exact"
            }
            .into(),
            effective_rank_err: i.is_multiple_of(5).then_some(0.01),
            ..LayerRow::default()
        }
    }

    #[test]
    fn rows_round_trip_through_columns() {
        for n in [0, 1, 2, 7, 100] {
            let rows: Vec<LayerRow> = (0..n).map(row).collect();
            let columns = LayerColumns::from_rows(rows.clone());
            assert_eq!(columns.row_count(), n as usize);
            assert_eq!(columns.into_rows(), Ok(rows));
        }
        // All-default rows travel as their steps alone.
        let rows = vec![LayerRow::default(); 5];
        let columns = LayerColumns::from_rows(rows.clone());
        assert_eq!(
            columns,
            LayerColumns {
                step: vec![0; 5],
                ..LayerColumns::default()
            }
        );
        assert_eq!(columns.into_rows(), Ok(rows));
        assert_eq!(LayerColumns::default().into_rows(), Ok(vec![]));
    }

    #[test]
    fn a_batch_travels_as_columns_and_reads_back_as_rows() {
        let mut batch = Batch {
            layers: (0..10).map(row).collect(),
            ..Batch::default()
        };
        let before = batch.clone();
        batch.layers_as_columns();
        assert!(batch.layers.is_empty() && batch.layer_columns.len() == 1);
        assert_eq!(batch.rows(), 10);
        let bytes = prost::Message::encode_to_vec(&batch);
        assert!(
            bytes.len() < prost::Message::encoded_len(&before),
            "columns take fewer bytes: {} against {}",
            bytes.len(),
            prost::Message::encoded_len(&before)
        );
        let mut back: Batch = prost::Message::decode(&bytes[..]).unwrap();
        back.layers_as_rows().unwrap();
        assert_eq!(back, before);
    }

    #[test]
    fn the_optional_fields_are_listed_once() {
        let mut listed = Vec::new();
        macro_rules! numbers {
            ($($f:ident = $field:literal),*) => { $(listed.push(($field, layer_field_name($field), stringify!($f)));)* };
        }
        optional_fields!(numbers);
        assert_eq!(
            listed.iter().map(|l| l.0).collect::<Vec<u32>>(),
            OPTIONAL_FIELDS
        );
        assert!(listed.iter().all(|l| l.1 == l.2), "{listed:?}");
    }

    #[test]
    fn null_only_columns_and_their_bits_are_left_out() {
        let rows: Vec<LayerRow> = (0..4).map(row).map(|r| LayerRow { step: 1, ..r }).collect();
        let columns = LayerColumns::from_rows(rows);
        assert!(columns.std.is_empty() && columns.conv_layout.is_empty());
        // Only participation_ratio (bit 8) and effective_rank_err (bit 25) are
        // null in some rows and not in others.
        assert!(columns.absent.iter().all(|a| a & !(1 << 8 | 1 << 25) == 0));
        assert_eq!(
            columns.strings.len(),
            6,
            "3 layers, \"\", 2 methods, once each"
        );
    }

    #[test]
    fn broken_columns_are_refused_with_the_first_broken_rule() {
        let mut c = LayerColumns::from_rows((0..3).map(row).collect());
        c.time.pop();
        c.layer.push(0);
        assert_eq!(
            c.clone().into_rows(),
            Err(ColumnsError::Length {
                field: 1,
                values: 3,
                rows: 4
            })
        );
        let mut c = LayerColumns::from_rows((0..3).map(row).collect());
        c.method[1] = 99;
        c.layer[2] = 98;
        let err = c.into_rows().unwrap_err();
        assert_eq!(
            err,
            ColumnsError::Index {
                field: 19,
                row: 1,
                index: 99,
                strings: 6
            }
        );
        assert_eq!(
            err.to_string(),
            "layer_columns: row 1's method is string 99, but the batch has 6 strings"
        );
    }
}
