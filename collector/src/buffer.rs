//! Rows accepted but not yet committed, grouped by (table, run).
//!
//! The buffer also remembers, per (run, rank), the highest batch `seq` it holds:
//! once the buffer is committed those become the durable watermarks.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use prost::Message;
use rankscope_proto::v1::Batch;

use crate::table::{Rows, Table};

/// The key of a rank's stream of batches.
pub type RankKey = (String, u32);

/// Rows waiting for the next commit.
#[derive(Debug, Default)]
pub struct Pending {
    tables: BTreeMap<(Table, String), Rows>,
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
        self.bytes += batch.encoded_len();
        self.since.get_or_insert_with(Instant::now);
        let wm = self
            .watermarks
            .entry((run_id.to_string(), rank))
            .or_default();
        *wm = (*wm).max(seq);
        for rows in Rows::split(batch, rank, seq) {
            self.bytes += rows.fixed_bytes();
            self.extend_rows(run_id, rows);
        }
    }

    /// Appends rows the collector writes itself (seq 0, no watermark).
    pub fn extend_rows(&mut self, run_id: &str, rows: Rows) {
        if rows.is_empty() {
            return;
        }
        self.since.get_or_insert_with(Instant::now);
        self.rows += rows.len();
        let table = rows.table();
        let slot = self
            .tables
            .entry((table, run_id.to_string()))
            .or_insert_with(|| Rows::empty(table));
        let same_table = slot.extend(rows);
        debug_assert!(same_table.is_ok(), "the slot is keyed by the rows' table");
        self.largest_file_rows = self.largest_file_rows.max(slot.len());
    }

    pub fn is_empty(&self) -> bool {
        self.rows == 0 && self.watermarks.is_empty()
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Estimated memory of the rows held, in bytes: each row's fixed size plus
    /// the batch's encoded size (which bounds its strings). The encoded size alone
    /// would not do: an empty row is 2 bytes on the wire and about 240 in memory.
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
    pub fn groups(&self) -> impl Iterator<Item = (Table, &str, &Rows)> {
        self.tables
            .iter()
            .map(|((table, run), rows)| (*table, run.as_str(), rows))
    }

    /// The per-(run, rank) watermarks that committing this buffer makes durable.
    pub fn watermarks(&self) -> &HashMap<RankKey, u64> {
        &self.watermarks
    }

    /// Puts back a taken buffer whose commit failed, ahead of what arrived since.
    pub fn restore(&mut self, mut earlier: Pending) {
        let later = self.take();
        earlier.bytes += later.bytes;
        for ((_, run), rows) in later.tables {
            earlier.extend_rows(&run, rows);
        }
        for (key, seq) in later.watermarks {
            let wm = earlier.watermarks.entry(key).or_default();
            *wm = (*wm).max(seq);
        }
        *self = earlier;
    }
}
