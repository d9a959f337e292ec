//! Batches not yet acknowledged by the collector, in `seq` order.
//!
//! Every batch stays here until an acknowledgement covers its `seq`. After a
//! reconnect [`Outbox::rewind`] makes all of them unsent again, so they are
//! resent in order; the collector drops those it already holds.
//!
//! **When full** (more than `max_bytes` of encoded batches): the oldest batch is
//! dropped and its rows are counted in [`Outbox::dropped_rows`], which the
//! transport reports as a `rows_dropped` event. Newest data wins, because a
//! collector that comes back wants to see the run's present.

use std::collections::VecDeque;

use prost::Message;
use rankscope_proto::v1::Batch;

use crate::transport::batch_rows;

#[derive(Debug)]
struct Entry {
    batch: Batch,
    rows: u64,
    bytes: usize,
}

/// Unacknowledged batches.
#[derive(Debug)]
pub struct Outbox {
    entries: VecDeque<Entry>,
    next_seq: u64,
    /// How many entries, from the front, were sent on the current connection.
    sent: usize,
    bytes: usize,
    max_bytes: usize,
    acked_rows: u64,
    dropped_rows: u64,
}

impl Outbox {
    pub fn new(max_bytes: usize) -> Outbox {
        Outbox {
            entries: VecDeque::new(),
            next_seq: 1,
            sent: 0,
            bytes: 0,
            max_bytes,
            acked_rows: 0,
            dropped_rows: 0,
        }
    }

    /// Numbers `batch` with the next `seq` and keeps it.
    pub fn push(&mut self, mut batch: Batch) {
        batch.seq = self.next_seq;
        self.next_seq += 1;
        let bytes = batch.encoded_len();
        let rows = batch_rows(&batch) as u64;
        self.bytes += bytes;
        self.entries.push_back(Entry { batch, rows, bytes });
        while self.bytes > self.max_bytes && self.entries.len() > 1 {
            let oldest = self.entries.pop_front().expect("non-empty");
            self.bytes -= oldest.bytes;
            self.dropped_rows += oldest.rows;
            self.sent = self.sent.saturating_sub(1);
        }
    }

    /// Renumbers every held batch to follow `durable_seq`: the collector already
    /// holds that many batches of this (run, rank) from an earlier process.
    pub fn renumber_after(&mut self, durable_seq: u64) {
        let mut next = durable_seq + 1;
        for e in &mut self.entries {
            e.batch.seq = next;
            next += 1;
        }
        self.next_seq = next;
    }

    /// Forgets every batch up to `durable_seq`.
    pub fn acknowledge(&mut self, durable_seq: u64) {
        while self
            .entries
            .front()
            .is_some_and(|e| e.batch.seq <= durable_seq)
        {
            let e = self.entries.pop_front().expect("non-empty");
            self.bytes -= e.bytes;
            self.acked_rows += e.rows;
            self.sent = self.sent.saturating_sub(1);
        }
    }

    /// Marks everything unsent (a new connection).
    pub fn rewind(&mut self) {
        self.sent = 0;
    }

    pub fn has_unsent(&self) -> bool {
        self.sent < self.entries.len()
    }

    /// The next batch to send on this connection.
    pub fn next_unsent(&mut self) -> Option<Batch> {
        let batch = self.entries.get(self.sent)?.batch.clone();
        self.sent += 1;
        Some(batch)
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn acked_rows(&self) -> u64 {
        self.acked_rows
    }

    pub fn dropped_rows(&self) -> u64 {
        self.dropped_rows
    }

    pub fn unacked_rows(&self) -> u64 {
        self.entries.iter().map(|e| e.rows).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rankscope_proto::v1::StepRow;

    fn batch(rows: usize) -> Batch {
        Batch {
            steps: vec![StepRow::default(); rows],
            ..Default::default()
        }
    }

    #[test]
    fn numbers_resends_and_trims() {
        let mut o = Outbox::new(usize::MAX);
        o.push(batch(1));
        o.push(batch(2));
        o.push(batch(3));
        assert_eq!(o.next_unsent().unwrap().seq, 1);
        assert_eq!(o.next_unsent().unwrap().seq, 2);
        o.acknowledge(1);
        assert_eq!(o.acked_rows(), 1);
        assert_eq!(o.next_unsent().unwrap().seq, 3);
        assert!(!o.has_unsent());
        o.rewind();
        assert_eq!(o.next_unsent().unwrap().seq, 2);
        o.acknowledge(3);
        assert!(o.is_empty());
        assert_eq!(o.acked_rows(), 6);
    }

    #[test]
    fn renumbering_follows_an_earlier_incarnation() {
        let mut o = Outbox::new(usize::MAX);
        o.push(batch(1));
        o.push(batch(1));
        o.renumber_after(40);
        o.push(batch(1));
        o.acknowledge(40);
        assert_eq!(o.unacked_rows(), 3);
        let seqs: Vec<u64> = std::iter::from_fn(|| o.next_unsent().map(|b| b.seq)).collect();
        assert_eq!(seqs, [41, 42, 43]);
    }

    #[test]
    fn full_outbox_drops_oldest_and_counts() {
        let one = batch(10).encoded_len();
        let mut o = Outbox::new(one * 2 + 4);
        for _ in 0..5 {
            o.push(batch(10));
        }
        assert_eq!(o.dropped_rows(), 30);
        assert_eq!(o.unacked_rows(), 20);
        assert_eq!(o.next_unsent().unwrap().seq, 4);
    }
}
