//! Rows accepted but not yet committed, grouped by (table, run).
//!
//! The buffer also remembers, per (run, rank), the highest batch `seq` it holds:
//! once the buffer is committed those become the durable watermarks.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use arrow::array::RecordBatch;
use rankscope_proto::v1::Batch;

use crate::table::{Rows, Table};

/// The key of a rank's stream of batches.
pub type RankKey = (String, u32);

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
    pub fn push_batch(&mut self, run_id: &str, rank: u32, batch: Batch) {
        let seq = batch.seq;
        self.since.get_or_insert_with(Instant::now);
        let wm = self
            .watermarks
            .entry((run_id.to_string(), rank))
            .or_default();
        *wm = (*wm).max(seq);
        for rows in Rows::split(batch) {
            self.push_rows(run_id, rank, seq, rows);
        }
    }

    /// Appends rows of `rank` from batch `seq`; the collector's own rows have
    /// seq 0 (and no watermark).
    pub fn push_rows(&mut self, run_id: &str, rank: u32, seq: u64, rows: Rows) {
        if rows.is_empty() {
            return;
        }
        let batch = rows
            .to_record_batch(run_id, rank, seq)
            .expect("a table's columns are built together, of one length");
        self.push_record_batch(rows.table(), run_id, batch);
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
