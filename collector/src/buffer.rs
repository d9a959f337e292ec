//! Rows accepted but not yet committed, grouped by (table, run).
//!
//! The buffer also remembers, per (run, rank), the highest batch `seq` it holds:
//! once the buffer is committed those become the durable watermarks.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use arrow::array::RecordBatch;

use crate::table::Table;

/// The key of a rank's stream of batches.
pub type RankKey = (String, u32);

/// One batch of a rank, decoded and checked: its rows as one record batch per
/// table it has rows for (`wire::DecodedBatch::finish`).
#[derive(Debug, Clone, PartialEq)]
pub struct BatchRecords {
    pub seq: u64,
    pub is_final: bool,
    /// The gap its agent declares before `seq` (0: none; see `sequence`).
    pub dropped_from: u64,
    pub tables: Vec<(Table, RecordBatch)>,
}

impl BatchRecords {
    /// Rows of all tables.
    pub fn rows(&self) -> usize {
        self.tables.iter().map(|(_, b)| b.num_rows()).sum()
    }
}

/// The rows of one (table, run), as Arrow record batches: one file at the next
/// commit.
#[derive(Debug, Default)]
pub struct Group {
    batches: Vec<RecordBatch>,
    rows: usize,
}

impl Group {
    /// The record batches, in arrival order.
    pub fn batches(&self) -> &[RecordBatch] {
        &self.batches
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// Rows waiting for the next commit.
///
/// Rows are converted to Arrow as they are admitted, a batch at a time: the
/// buffer then holds compact columns (no per-row allocations), its byte count is
/// the Arrow buffers' own size, and a commit only encodes them.
#[derive(Debug, Default)]
pub struct Pending {
    tables: BTreeMap<(Table, String), Group>,
    watermarks: HashMap<RankKey, u64>,
    rows: usize,
    bytes: usize,
    since: Option<Instant>,
    largest_file_rows: usize,
}

impl Pending {
    /// Adds every row of `batch`, sent by `rank` of `run_id`.
    pub fn push_batch(&mut self, run_id: &str, rank: u32, batch: BatchRecords) {
        self.since.get_or_insert_with(Instant::now);
        let wm = self
            .watermarks
            .entry((run_id.to_string(), rank))
            .or_default();
        *wm = (*wm).max(batch.seq);
        self.push_rows(run_id, batch.tables);
    }

    /// Appends rows without a watermark (the collector's own rows, seq 0).
    pub fn push_rows(&mut self, run_id: &str, tables: Vec<(Table, RecordBatch)>) {
        for (table, batch) in tables {
            if batch.num_rows() > 0 {
                self.push_record_batch(table, run_id, batch);
            }
        }
    }

    fn push_record_batch(&mut self, table: Table, run_id: &str, batch: RecordBatch) {
        self.since.get_or_insert_with(Instant::now);
        self.rows += batch.num_rows();
        self.bytes += batch.get_array_memory_size();
        let group = self.tables.entry((table, run_id.to_string())).or_default();
        group.rows += batch.num_rows();
        group.batches.push(batch);
        self.largest_file_rows = self.largest_file_rows.max(group.rows);
    }

    pub fn is_empty(&self) -> bool {
        self.rows == 0 && self.watermarks.is_empty()
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Memory of the rows held, in bytes (their Arrow buffers).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Rows of the largest (table, run) group: the size of the largest file the next
    /// commit would write.
    pub fn largest_file_rows(&self) -> usize {
        self.largest_file_rows
    }

    /// When the oldest row held arrived.
    pub fn since(&self) -> Option<Instant> {
        self.since
    }

    /// Takes everything out, leaving the buffer empty.
    pub fn take(&mut self) -> Pending {
        std::mem::take(self)
    }

    /// The (table, run) groups to write, one file each.
    pub fn groups(&self) -> impl Iterator<Item = (Table, &str, &Group)> {
        self.tables
            .iter()
            .map(|((table, run), group)| (*table, run.as_str(), group))
    }

    /// The per-(run, rank) watermarks that committing this buffer makes durable.
    pub fn watermarks(&self) -> &HashMap<RankKey, u64> {
        &self.watermarks
    }

    /// Puts back a taken buffer whose commit failed, ahead of what arrived since.
    pub fn restore(&mut self, mut earlier: Pending) {
        let later = self.take();
        for ((table, run), group) in later.tables {
            for batch in group.batches {
                earlier.push_record_batch(table, &run, batch);
            }
        }
        for (key, seq) in later.watermarks {
            let wm = earlier.watermarks.entry(key).or_default();
            *wm = (*wm).max(seq);
        }
        *self = earlier;
    }
}
