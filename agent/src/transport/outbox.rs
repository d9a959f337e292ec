//! Batches not yet acknowledged by the collector, in `seq` order, in memory and
//! (when a spill directory is set) on disk.
//!
//! Every batch stays until an acknowledgement covers its `seq`. After a reconnect
//! [`Outbox::rewind`] makes all of them unsent again, so they are resent in order;
//! the collector drops those it already holds.
//!
//! **Numbering.** A batch gets its `seq` only once the collector has said, in the
//! first `Welcome` of this process, how many batches of this (run, rank) it already
//! holds ([`Outbox::welcome`]): a rank restarted under the same run id continues the
//! sequence of its earlier incarnation instead of colliding with it, even when the
//! collector was down for the whole run. The numbering is written to the spill, so
//! a later incarnation reads every batch back with the `seq` it was sent with.
//!
//! **With a spill directory** ([`super::spill`]) every batch is written to disk
//! when it is cut; memory keeps copies of the newest batches up to `memory_bytes`
//! and older ones are read back from disk when resent. A process started for the
//! same run and rank takes over what an earlier one left ([`Outbox::open`]).
//!
//! **When full**, the oldest data goes first, because a collector that comes back
//! wants to see the run's present: past `spill_max_bytes` on disk the oldest segment
//! is deleted; without a spill (or once writing to it failed) past `memory_bytes`
//! the oldest batch is dropped. Either way the rows are counted in
//! [`Outbox::dropped_rows`], which the transport reports as a `rows_dropped` event
//! in the next batch, so the loss lands in the data once the collector is back.

use std::collections::VecDeque;
use std::path::PathBuf;

use prost::Message;
use rankscope_proto::v1::Batch;

use super::spill::{Location, SpillLog};

/// The highest `durable_seq` a `Welcome` may carry: half the `seq` space, more
/// batches than any run sends (one a millisecond for 10⁸ years), so numbering
/// after it can never overflow.
pub const MAX_WELCOME_SEQ: u64 = u64::MAX / 2;

/// A `Welcome` whose `durable_seq` no run can reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the collector says {0} batches of this rank are durable, more than any run sends: is the address a rankscope collector of this release?"
)]
pub struct ImpossibleSeq(pub u64);

/// Bounds and the spill directory of one rank.
#[derive(Debug, Clone)]
pub struct OutboxConfig {
    /// The rank's spill directory (`<spill_dir>/<run id>/rank-<rank>`); `None`
    /// keeps batches in memory only.
    pub rank_spill_dir: Option<PathBuf>,
    /// Bound on the spill, in bytes.
    pub spill_max_bytes: u64,
    /// Size a spill segment grows to before the next one starts.
    pub segment_bytes: u64,
    /// Bound on the batches held in memory, in encoded bytes.
    pub memory_bytes: usize,
}

#[derive(Debug)]
struct Entry {
    /// `None` until numbered.
    seq: Option<u64>,
    rows: u64,
    bytes: usize,
    /// The batch, while memory holds it.
    batch: Option<Batch>,
    /// Where the spill holds it.
    at: Option<Location>,
    /// The dropped rows its `rows_dropped` events report (this process's batches).
    reports_dropped: u64,
}

/// The dropped rows a batch's `rows_dropped` events report.
fn reported_drops(batch: &Batch) -> u64 {
    batch
        .events
        .iter()
        .filter(|e| e.kind == crate::rows::event_kind::ROWS_DROPPED)
        .filter_map(|e| u64::try_from(e.value?).ok())
        .sum()
}

/// Unacknowledged batches.
#[derive(Debug)]
pub struct Outbox {
    entries: VecDeque<Entry>,
    /// The next `seq`, once the collector's Welcome anchored the numbering.
    next_seq: Option<u64>,
    /// How many entries, from the front, were sent on the current connection.
    sent: usize,
    /// The highest `seq` the current collector said is durable (its `Welcome`,
    /// then its acks): where this connection's sequence starts.
    durable: u64,
    memory_bytes: usize,
    config: OutboxConfig,
    spill: Option<SpillLog>,
    /// Why the spill is not in use, when one was asked for.
    spill_error: Option<String>,
    acked_rows: u64,
    dropped_rows: u64,
    /// What the `rows_dropped` events of dropped batches reported, since the
    /// transport last took it ([`Outbox::take_drop_reports_lost`]).
    drop_reports_lost: u64,
    damaged_bytes: u64,
}

impl Outbox {
    /// An outbox; with a spill directory, takes over the batches an earlier process
    /// of the same run and rank left there. A spill that cannot be opened leaves
    /// the outbox in memory, with the reason in [`Outbox::spill_error`].
    pub fn open(config: OutboxConfig) -> Outbox {
        let mut outbox = Outbox {
            entries: VecDeque::new(),
            next_seq: None,
            durable: 0,
            sent: 0,
            memory_bytes: 0,
            spill: None,
            spill_error: None,
            acked_rows: 0,
            dropped_rows: 0,
            drop_reports_lost: 0,
            damaged_bytes: 0,
            config,
        };
        if let Some(dir) = outbox.config.rank_spill_dir.clone() {
            match SpillLog::open(&dir, outbox.config.segment_bytes) {
                Ok((log, replayed)) => {
                    outbox.damaged_bytes = log.damaged_bytes();
                    for r in replayed {
                        outbox.entries.push_back(Entry {
                            seq: (r.batch.seq > 0).then_some(r.batch.seq),
                            rows: r.batch.rows() as u64,
                            bytes: r.batch.encoded_len(),
                            batch: None,
                            at: Some(r.at),
                            // An earlier process's: its reports are its own.
                            reports_dropped: 0,
                        });
                    }
                    outbox.spill = Some(log);
                }
                Err(e) => {
                    outbox.spill_error = Some(format!("spill directory {}: {e}", dir.display()))
                }
            }
        }
        outbox
    }

    /// In memory only, bounded at `memory_bytes`.
    pub fn in_memory(memory_bytes: usize) -> Outbox {
        Outbox::open(OutboxConfig {
            rank_spill_dir: None,
            spill_max_bytes: 0,
            segment_bytes: 0,
            memory_bytes,
        })
    }

    /// The spill in use, if any.
    pub fn spill(&self) -> Option<&SpillLog> {
        self.spill.as_ref()
    }

    /// Why no spill is in use although one was configured.
    pub fn spill_error(&self) -> Option<&str> {
        self.spill_error.as_deref()
    }

    /// Bytes of damaged spill records skipped when the spill was opened.
    pub fn damaged_bytes(&self) -> u64 {
        self.damaged_bytes
    }

    /// Keeps `batch`, numbered if the numbering is anchored.
    pub fn push(&mut self, mut batch: Batch) {
        let seq = self.next_seq;
        if let Some(next) = &mut self.next_seq {
            *next = next.saturating_add(1);
        }
        batch.seq = seq.unwrap_or(0);
        let at = self.write(|log| log.append_batch(&batch));
        let bytes = batch.encoded_len();
        self.memory_bytes += bytes;
        self.entries.push_back(Entry {
            seq,
            rows: batch.rows() as u64,
            bytes,
            reports_dropped: reported_drops(&batch),
            batch: Some(batch),
            at,
        });
        self.make_room(0);
    }

    /// Runs a spill write. On failure (a full disk) the batch stays in memory only,
    /// the reason is kept and logged once, and later writes try again.
    fn write<T>(&mut self, f: impl FnOnce(&mut SpillLog) -> std::io::Result<T>) -> Option<T> {
        let log = self.spill.as_mut()?;
        match f(log) {
            Ok(value) => {
                if self.spill_error.take().is_some() {
                    tracing::info!(dir = %log.dir().display(), "spill directory writable again");
                }
                Some(value)
            }
            Err(e) => {
                if self.spill_error.is_none() {
                    let why = format!("cannot write spill directory {}: {e}", log.dir().display());
                    tracing::error!(%why, "new batches stay in memory until it is writable again");
                    self.spill_error = Some(why);
                }
                None
            }
        }
    }

    /// Drops what the bounds leave no room for beside a batch of `coming` bytes still
    /// to come (0: after a push): so that batch's `rows_dropped` report can count them
    /// (and the reports they held, [`Outbox::take_drop_reports_lost`]) before it is
    /// pushed.
    pub fn make_room(&mut self, coming: usize) {
        // Disk: delete the oldest segment while over the bound.
        while let Some(log) = &mut self.spill {
            if log.bytes().saturating_add(coming as u64) <= self.config.spill_max_bytes {
                break;
            }
            // Making room for a batch: the segment it would close is closed now.
            let Some(oldest) = log
                .oldest_closed()
                .or_else(|| (coming > 0 && log.close_if_full()).then(|| log.oldest_closed())?)
            else {
                break;
            };
            if let Err(e) = log.remove(oldest) {
                tracing::warn!(error = %e, "cannot delete a spill segment");
            }
            while self
                .entries
                .front()
                .and_then(|e| e.at)
                .is_some_and(|at| at.segment == oldest)
            {
                self.drop_front();
            }
        }
        // Memory: release copies that are on disk, or drop batches that are not.
        // The newest batch stays, unless room is made for one newer.
        let keep = usize::from(coming == 0);
        let mut i = 0;
        while self.memory_bytes.saturating_add(coming) > self.config.memory_bytes
            && i + keep < self.entries.len()
        {
            let e = &mut self.entries[i];
            if e.batch.is_some() {
                if e.at.is_some() && self.spill.is_some() {
                    e.batch = None;
                    self.memory_bytes -= e.bytes;
                    i += 1;
                } else {
                    self.drop_front_at(i);
                }
            } else {
                i += 1;
            }
        }
    }

    fn drop_front(&mut self) {
        self.drop_front_at(0);
    }

    /// Drops entry `i`, counting its rows.
    fn drop_front_at(&mut self, i: usize) {
        let Some(e) = self.entries.remove(i) else {
            return;
        };
        if e.batch.is_some() {
            self.memory_bytes -= e.bytes;
        }
        self.dropped_rows += e.rows;
        // One sent on this connection may be durable already, its report with it.
        if i >= self.sent {
            self.drop_reports_lost += e.reports_dropped;
        }
        if i < self.sent {
            self.sent -= 1;
        }
    }

    /// The first `Welcome` of a connection: `durable_seq` batches of this (run,
    /// rank) are durable. The first one of this process anchors the numbering.
    /// A `durable_seq` above [`MAX_WELCOME_SEQ`] comes from a broken or hostile
    /// peer (no run sends that many batches): it is refused and changes nothing.
    pub fn welcome(&mut self, durable_seq: u64) -> Result<(), ImpossibleSeq> {
        if durable_seq > MAX_WELCOME_SEQ {
            return Err(ImpossibleSeq(durable_seq));
        }
        if self.next_seq.is_none() {
            let known = self.entries.iter().filter_map(|e| e.seq).max().unwrap_or(0);
            let first = durable_seq.max(known) + 1;
            let mut next = first;
            for e in self.entries.iter_mut().filter(|e| e.seq.is_none()) {
                e.seq = Some(next);
                if let Some(batch) = &mut e.batch {
                    batch.seq = next;
                }
                next += 1;
            }
            let count = next - first;
            if count > 0 {
                self.write(|log| log.append_numbered(next - 1, count));
            }
            self.next_seq = Some(next);
        }
        // This collector's watermark, even below an earlier one's (a collector
        // started afresh): the batches between are declared, not assumed, held.
        self.durable = durable_seq;
        self.acknowledge(durable_seq);
        self.rewind();
        Ok(())
    }

    /// Forgets every batch up to `durable_seq`, and the spill segments that held
    /// only those.
    pub fn acknowledge(&mut self, durable_seq: u64) {
        self.durable = self.durable.max(durable_seq);
        while self
            .entries
            .front()
            .is_some_and(|e| e.seq.is_some_and(|s| s <= durable_seq))
        {
            let e = self.entries.pop_front().expect("non-empty");
            if e.batch.is_some() {
                self.memory_bytes -= e.bytes;
            }
            self.acked_rows += e.rows;
            self.sent = self.sent.saturating_sub(1);
        }
        let keep_from = self.entries.front().and_then(|e| e.at).map(|at| at.segment);
        if let Some(log) = &mut self.spill {
            let result = match keep_from {
                Some(segment) => log.remove_before(segment),
                None if self.entries.is_empty() => log.remove_before(u64::MAX),
                None => Ok(()),
            };
            if let Err(e) = result {
                tracing::warn!(error = %e, "cannot delete an acknowledged spill segment");
            }
        }
    }

    /// Marks everything unsent (a new connection).
    pub fn rewind(&mut self) {
        self.sent = 0;
    }

    pub fn has_unsent(&self) -> bool {
        self.entries.get(self.sent).is_some_and(|e| e.seq.is_some())
    }

    /// The next batch to send on this connection. A batch the spill can no longer
    /// give back is dropped and counted. When batches numbered before it are gone
    /// without an acknowledgement (dropped at a bound, unreadable, or durable only
    /// at an earlier collector), the batch declares them (`Batch.dropped_from`), so
    /// the collector never has to guess a gap.
    pub fn next_unsent(&mut self) -> Option<Batch> {
        loop {
            let e = self.entries.get(self.sent)?;
            let seq = e.seq?;
            let batch = match (&e.batch, e.at, &self.spill) {
                (Some(batch), _, _) => Ok(batch.clone()),
                (None, Some(at), Some(log)) => log.read(at),
                _ => Err(std::io::Error::other("batch no longer held")),
            };
            match batch {
                Ok(mut batch) => {
                    let previous = match self.sent.checked_sub(1) {
                        Some(i) => self.entries[i].seq.unwrap_or(self.durable),
                        None => self.durable,
                    };
                    batch.seq = seq;
                    batch.dropped_from = if previous + 1 < seq { previous + 1 } else { 0 };
                    self.sent += 1;
                    return Some(batch);
                }
                Err(error) => {
                    tracing::warn!(%error, seq, "cannot read a spilled batch back; dropped");
                    self.drop_front_at(self.sent);
                }
            }
        }
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

    /// The dropped rows that `rows_dropped` events in batches dropped since the last
    /// call reported: reported again, they are not lost with those batches.
    pub fn take_drop_reports_lost(&mut self) -> u64 {
        std::mem::take(&mut self.drop_reports_lost)
    }

    pub fn unacked_rows(&self) -> u64 {
        self.entries.iter().map(|e| e.rows).sum()
    }

    /// Rows that will outlive this process in the spill directory.
    pub fn spilled_rows(&self) -> u64 {
        if self.spill.is_none() {
            return 0;
        }
        self.entries
            .iter()
            .filter(|e| e.at.is_some())
            .map(|e| e.rows)
            .sum()
    }

    /// Ends the outbox: with nothing left to send, the spill directory goes.
    pub fn close(mut self) {
        if let Some(log) = self.spill.take()
            && self.entries.is_empty()
            && let Err(e) = log.remove_dir()
        {
            tracing::warn!(error = %e, "cannot remove the empty spill directory");
        }
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

    fn spilled(dir: &std::path::Path, spill_max_bytes: u64, memory_bytes: usize) -> Outbox {
        Outbox::open(OutboxConfig {
            rank_spill_dir: Some(dir.to_path_buf()),
            spill_max_bytes,
            segment_bytes: 64,
            memory_bytes,
        })
    }

    fn drain(o: &mut Outbox) -> Vec<(u64, usize)> {
        std::iter::from_fn(|| o.next_unsent().map(|b| (b.seq, b.steps.len()))).collect()
    }

    #[test]
    fn numbers_after_the_welcome_resends_and_trims() {
        let mut o = Outbox::in_memory(usize::MAX);
        o.push(batch(1));
        o.push(batch(2));
        assert!(
            !o.has_unsent(),
            "nothing is sent before the Welcome numbers it"
        );
        o.welcome(0).unwrap();
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
    fn numbering_follows_an_earlier_incarnation() {
        let mut o = Outbox::in_memory(usize::MAX);
        o.push(batch(1));
        o.push(batch(1));
        o.welcome(40).unwrap();
        o.push(batch(1));
        assert_eq!(o.unacked_rows(), 3);
        let seqs: Vec<u64> = drain(&mut o).into_iter().map(|(s, _)| s).collect();
        assert_eq!(seqs, [41, 42, 43]);
        // A later Welcome (a reconnect) changes no numbers.
        o.welcome(41).unwrap();
        let seqs: Vec<u64> = drain(&mut o).into_iter().map(|(s, _)| s).collect();
        assert_eq!(seqs, [42, 43]);
    }

    #[test]
    fn full_memory_outbox_drops_oldest_and_counts() {
        let one = batch(10).encoded_len();
        let mut o = Outbox::in_memory(one * 2 + 4);
        o.welcome(0).unwrap();
        for _ in 0..5 {
            o.push(batch(10));
        }
        assert_eq!(o.dropped_rows(), 30);
        assert_eq!(o.unacked_rows(), 20);
        assert_eq!(o.next_unsent().unwrap().seq, 4);
    }

    #[test]
    fn a_drop_report_dropped_with_its_batch_is_given_back_to_report_again() {
        let one = batch(10).encoded_len();
        let mut o = Outbox::in_memory(one * 2 + 64);
        o.welcome(0).unwrap();
        let mut reporting = batch(10);
        reporting.events.push(rankscope_proto::v1::EventRow {
            kind: crate::rows::event_kind::ROWS_DROPPED.into(),
            value: Some(7),
            ..Default::default()
        });
        o.push(reporting);
        assert_eq!(o.take_drop_reports_lost(), 0);
        for _ in 0..3 {
            o.push(batch(10));
        }
        // The reporting batch went with the memory bound: its 7 are to report again.
        assert_eq!(o.dropped_rows(), 11, "its 10 steps and the event");
        assert_eq!(o.take_drop_reports_lost(), 7);
        assert_eq!(o.take_drop_reports_lost(), 0, "taken once");
    }

    #[test]
    fn batches_dropped_unacknowledged_are_declared_by_the_next_one_sent() {
        let one = batch(10).encoded_len();
        let mut o = Outbox::in_memory(one * 2 + 4);
        o.welcome(0).unwrap();
        o.push(batch(10));
        let first = o.next_unsent().unwrap();
        assert_eq!((first.seq, first.dropped_from), (1, 0));
        // The memory bound drops 1 (sent, not acknowledged), 2 and 3 (never sent).
        for _ in 0..4 {
            o.push(batch(10));
        }
        let next = o.next_unsent().unwrap();
        assert_eq!((next.seq, next.dropped_from), (4, 1));
        let after = o.next_unsent().unwrap();
        assert_eq!((after.seq, after.dropped_from), (5, 0));
        // A new connection whose collector holds 1: 4 declares 2 and 3.
        o.welcome(1).unwrap();
        let resent = o.next_unsent().unwrap();
        assert_eq!((resent.seq, resent.dropped_from), (4, 2));
        // A collector started afresh (nothing durable): 1 to 3 are declared.
        o.welcome(0).unwrap();
        let fresh = o.next_unsent().unwrap();
        assert_eq!((fresh.seq, fresh.dropped_from), (4, 1));
    }

    #[test]
    fn a_restarted_process_takes_over_the_spill_with_the_same_numbers() {
        let dir = tempfile::tempdir().unwrap();
        {
            // First process: collector down all along, then up briefly.
            let mut o = spilled(dir.path(), u64::MAX, 0);
            o.push(batch(1));
            o.push(batch(2));
            o.welcome(7).unwrap();
            o.push(batch(3));
            assert_eq!(o.next_unsent().unwrap().seq, 8);
            // Killed before any acknowledgement: nothing is closed or cleaned.
            drop(o);
        }
        let mut o = spilled(dir.path(), u64::MAX, 0);
        assert_eq!(o.unacked_rows(), 6);
        o.push(batch(4));
        o.welcome(8).unwrap();
        assert_eq!(drain(&mut o), [(9, 2), (10, 3), (11, 4)]);
        o.acknowledge(11);
        assert!(o.is_empty());
        o.close();
        assert!(!dir.path().exists(), "an empty spill directory is removed");
    }

    #[test]
    fn unnumbered_batches_of_a_process_that_never_connected_are_numbered_later() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut o = spilled(dir.path(), u64::MAX, usize::MAX);
            o.push(batch(1));
            o.push(batch(2));
            drop(o);
        }
        let mut o = spilled(dir.path(), u64::MAX, usize::MAX);
        o.push(batch(3));
        o.welcome(0).unwrap();
        assert_eq!(drain(&mut o), [(1, 1), (2, 2), (3, 3)]);
    }

    #[test]
    fn a_full_spill_drops_the_oldest_segment_and_counts_its_rows() {
        let dir = tempfile::tempdir().unwrap();
        let one = batch(10).encoded_len() as u64 + 9;
        let mut o = spilled(dir.path(), 3 * (one + 8), 0);
        o.welcome(0).unwrap();
        for _ in 0..6 {
            o.push(batch(10));
        }
        assert!(o.dropped_rows() > 0);
        assert_eq!(o.dropped_rows() + o.unacked_rows(), 60);
        assert!(o.spill().unwrap().bytes() <= 3 * (one + 8));
        let sent = drain(&mut o);
        assert_eq!(sent.last().unwrap().0, 6, "the newest batch is kept");
    }

    #[test]
    fn an_impossible_welcome_is_refused_and_changes_nothing() {
        let mut o = Outbox::in_memory(usize::MAX);
        o.push(batch(3));
        for seq in [u64::MAX, MAX_WELCOME_SEQ + 1] {
            let err = o.welcome(seq).unwrap_err();
            assert_eq!(err, ImpossibleSeq(seq));
            assert!(err.to_string().contains(&seq.to_string()));
        }
        assert_eq!(drain(&mut o), vec![], "still unnumbered, so unsent");
        // The largest welcome allowed numbers after it without overflowing.
        o.welcome(MAX_WELCOME_SEQ).unwrap();
        o.push(batch(2));
        assert_eq!(
            drain(&mut o),
            vec![(MAX_WELCOME_SEQ + 1, 3), (MAX_WELCOME_SEQ + 2, 2)]
        );
    }
}
