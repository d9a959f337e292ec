//! What the collector has accepted: the rows waiting for the next commit and, per
//! (run, rank), the sequence numbers accepted and made durable.
//!
//! Accepting a batch (the dedup check plus buffering its rows) happens under one
//! lock, so a commit always holds every batch up to the watermark it records.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arrow::array::RecordBatch;
use rankscope_proto::Table;
use rankscope_proto::v1::{Batch, EventRow, Hello, RankRow};
use tokio::sync::{Notify, watch};

use crate::buffer::{BatchRecords, Pending, RankKey};
use crate::room::{Room, RoomPermit};
use crate::sequence::{self, Claim, Claimed, SeqError, Verdict};
use crate::wire;

/// Memory the collector takes whatever it holds: code and runtime, the Parquet
/// writer's pages of the row group being encoded, and the allocator's slack (freed
/// memory kept for reuse). Outside the rows' share of the bound. Measured: 21 MiB
/// beside a 32 MiB bound with the streams' share taken out, and resident memory up
/// to 65 MiB above the allocator's in-use peak over 12.6 M rows (BENCHMARKS.md,
/// "the memory bound bounds RSS"). 96 MiB let 1,024 streams reach 514 MiB once
/// in 12 runs; 112 MiB kept them at 455–498 MiB.
pub const RESERVED_BYTES: usize = 112 << 20;

/// Memory an open stream takes beside its messages: HTTP/2 connection state and
/// buffers, and the 8 KiB read buffer it starts with (36 KiB measured per idle
/// stream after its Hello, 4,096 of them).
pub const STREAM_BASE_BYTES: usize = 32 << 10;

/// What a stream the collector does not read can hold beyond its base: one HTTP/2
/// flow-control window (64 KiB) of data, in h2's receive buffers, which take up
/// to twice the data they hold when it comes in frames of a few KiB (122 KiB
/// measured per stream with the window filled in 4 KiB frames, 4,096 streams).
/// A stream is not read while its message waits for decoding room (`room`) or
/// while the one before is decoded and admitted.
pub const UNREAD_BYTES: usize = 128 << 10;

/// What an open stream that has sent messages of up to `largest` bytes takes:
/// [`STREAM_BASE_BYTES`], and the larger of [`UNREAD_BYTES`] and what its
/// messages take: the message held until its rows are admitted, and the read
/// buffer the next one arrives in, which keeps the capacity the largest message
/// grew it to (a power of two). 288 KiB for messages of 128 KiB, where 256 KiB
/// per stream was measured (1,024 against 256 streams, both waiting on a full
/// buffer, their windows full); 160 KiB for a stream that sent only small ones.
pub fn stream_bytes(largest: usize) -> usize {
    STREAM_BASE_BYTES + (largest + largest.next_power_of_two()).max(UNREAD_BYTES)
}

/// The answer to a batch.
#[derive(Debug, PartialEq)]
pub enum Admission {
    /// Buffered for the next commit.
    Accepted,
    /// Already held (resent after a reconnect): dropped.
    Duplicate,
    /// The buffer is over its bound: try again after the next commit.
    Full(BatchRecords),
}

/// The stream a batch came on, as [`Intake::admit`] judges it: the generation
/// [`Intake::attach`] gave it, and the seq it sent last (0: none yet).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OnStream {
    pub generation: u64,
    pub last_seq: u64,
}

#[derive(Debug)]
struct RankState {
    accepted: u64,
    durable: watch::Sender<u64>,
    /// Which stream may send for the rank.
    claim: Claim,
    live_streams: u32,
    finished: bool,
    hello: Option<Hello>,
    gone_since: Option<Instant>,
}

impl RankState {
    fn new(seq: u64) -> RankState {
        RankState {
            accepted: seq,
            durable: watch::channel(seq).0,
            claim: Claim::default(),
            live_streams: 0,
            finished: false,
            hello: None,
            gone_since: None,
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    ranks: HashMap<RankKey, RankState>,
    pending: Pending,
    /// Bytes of the rows taken by the commit in progress: they stay in memory
    /// until it ends, so they count against the bound too.
    committing: usize,
    /// What the open streams take ([`stream_bytes`] of each).
    streams: usize,
}

/// The buffer's state, for the commit policy and `/metrics`.
#[derive(Debug, Clone, Copy)]
pub struct PendingStats {
    /// Memory of the rows buffered (not those of a commit in progress).
    pub bytes: usize,
    /// Rows of the largest (table, run) group.
    pub largest_file_rows: usize,
    /// Age of the oldest row buffered.
    pub age: Option<Duration>,
    /// What the rows (buffered and being committed) may take now (`Intake::rows_limit`).
    pub limit: usize,
    /// What the open streams take.
    pub streams: usize,
}

/// Shared between every stream and the committer.
///
/// The memory bound (`max_memory_bytes`) covers the collector's resident memory:
/// [`RESERVED_BYTES`] for what it takes whatever it holds, an eighth for messages
/// still arriving and batches being decoded and admitted ([`Room`],
/// [`Intake::decode_room`]), what the open streams
/// take ([`stream_bytes`] each), and the rest for the rows held, buffered or being
/// committed (`Intake::rows_limit`). The rows always get at least a sixteenth of
/// the bound: streams past what the bound can hold (about 1,080 of the agents'
/// 128 KiB batches at the default)
/// take RSS past it, with a warning that names the bound to set.
#[derive(Debug)]
pub struct Intake {
    inner: Mutex<Inner>,
    max_memory_bytes: usize,
    decode_bytes: usize,
    /// What the streams took at the last warning that the rows were left their
    /// floor; 0 once they are above it again.
    warned_streams: AtomicUsize,
    /// Room for unfinished messages and decoded batches not yet admitted.
    room: Arc<Room>,
    /// Woken after every commit attempt.
    pub committed: Notify,
    /// Woken when a stream asks for an early commit (its final batch).
    pub commit_soon: Notify,
}

impl Intake {
    /// Starts from the watermarks recovered from the output directory.
    pub fn new(recovered: HashMap<RankKey, u64>, max_memory_bytes: usize) -> Intake {
        let ranks = recovered
            .into_iter()
            .map(|(k, seq)| (k, RankState::new(seq)))
            .collect();
        let decode_bytes = max_memory_bytes / 8;
        Intake {
            room: Room::new(decode_bytes),
            inner: Mutex::new(Inner {
                ranks,
                pending: Pending::default(),
                committing: 0,
                streams: 0,
            }),
            max_memory_bytes,
            decode_bytes,
            warned_streams: AtomicUsize::new(0),
            committed: Notify::new(),
            commit_soon: Notify::new(),
        }
    }

    /// Waits for room to decode a batch of about `bytes` (a batch larger than all
    /// the room waits for all of it); the room is given back when the permit is
    /// dropped, once the batch is admitted (its rows then count in the buffer).
    pub async fn decode_room(&self, bytes: usize) -> RoomPermit {
        self.room.decode(bytes).await
    }

    /// The room for decoding, which unfinished messages share ([`Room`]).
    pub fn room(&self) -> Arc<Room> {
        self.room.clone()
    }

    /// The memory bound (`--max-memory-bytes`).
    pub fn max_memory_bytes(&self) -> usize {
        self.max_memory_bytes
    }

    /// What the rows held may take while the open streams take `streams` bytes:
    /// the bound less the reserved, decoding and streams' shares, at least a
    /// sixteenth of the bound (and 1 byte).
    fn rows_limit(&self, streams: usize) -> usize {
        let floor = (self.max_memory_bytes / 16).max(1);
        let room = self
            .max_memory_bytes
            .saturating_sub(RESERVED_BYTES + self.decode_bytes + streams);
        if room >= floor {
            self.warned_streams.store(0, Ordering::Relaxed);
            return room;
        }
        // Warn on the first pass under the floor, and again each time the
        // streams have grown by a quarter since.
        let warned = self.warned_streams.load(Ordering::Relaxed);
        if streams > warned + warned / 4 {
            self.warned_streams.store(streams, Ordering::Relaxed);
            let mib = |b: usize| b.div_ceil(1 << 20);
            // The bound at which the rows' share reaches the floor: it less the
            // reserved and streams' shares, less an eighth and a sixteenth of it.
            let needed = (RESERVED_BYTES + streams).saturating_mul(16).div_ceil(13);
            tracing::warn!(
                streams_mib = mib(streams),
                max_memory_mib = mib(self.max_memory_bytes),
                "the open streams take {} MiB of the {} MiB memory bound, which leaves the rows \
                 only their floor of {} MiB: resident memory may pass the bound; raise \
                 --max-memory-bytes to at least {} MiB ({}) or spread the ranks over more collectors",
                mib(streams),
                mib(self.max_memory_bytes),
                mib(floor),
                mib(needed),
                mib(needed) << 20,
            );
        }
        floor
    }

    /// Counts what an open stream takes: `now` bytes (a [`stream_bytes`]) in place
    /// of the `before` it was counted at (0 when it opens; call with `now` 0 when it
    /// closes).
    pub fn resize_stream(&self, before: usize, now: usize) {
        let mut inner = self.lock();
        inner.streams = (inner.streams + now).saturating_sub(before);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the collector holds a watermark for `key` (recovered, learned or
    /// from a stream).
    pub fn knows(&self, key: &RankKey) -> bool {
        self.lock().ranks.contains_key(key)
    }

    /// Starts `key` from the durable watermark `seq` looked up in the output
    /// (a Delta table's log), unless a stream got there first.
    pub fn learn(&self, key: &RankKey, seq: u64) {
        self.lock()
            .ranks
            .entry(key.clone())
            .or_insert_with(|| RankState::new(seq));
    }

    /// Registers a stream for `hello`'s rank; returns its generation and its durable
    /// watermark, or the refusal when another process's stream holds the rank
    /// ([`Claim`]).
    pub fn attach(&self, hello: &Hello) -> Result<(u64, watch::Receiver<u64>), Claimed> {
        let mut inner = self.lock();
        let state = inner
            .ranks
            .entry((hello.run_id.clone(), hello.rank))
            .or_insert_with(|| RankState::new(0));
        let generation = state.claim.attach(hello, state.live_streams)?;
        state.live_streams += 1;
        state.gone_since = None;
        state.hello = Some(hello.clone());
        Ok((generation, state.durable.subscribe()))
    }

    /// Unregisters a stream; `finished` if it delivered its final batch.
    pub fn detach(&self, key: &RankKey, finished: bool) {
        let mut inner = self.lock();
        if let Some(state) = inner.ranks.get_mut(key) {
            state.live_streams = state.live_streams.saturating_sub(1);
            state.finished |= finished;
            if state.live_streams == 0 {
                state.gone_since = Some(Instant::now());
            }
        }
    }

    /// Judges one batch of `key`'s rank, sent on `stream` ([`sequence::judge`]),
    /// and buffers it: a duplicate is dropped, a declared gap is written to
    /// `events` with the batch.
    pub fn admit(
        &self,
        key: &RankKey,
        stream: OnStream,
        mut batch: BatchRecords,
    ) -> Result<Admission, SeqError> {
        let mut inner = self.lock();
        let state = inner.ranks.get(key);
        if state.is_some_and(|s| !s.claim.current(stream.generation)) {
            return Err(SeqError::Superseded { rank: key.1 });
        }
        let accepted = state.map_or(0, |s| s.accepted);
        let verdict = sequence::judge(batch.seq, batch.dropped_from, accepted, stream.last_seq)?;
        if verdict == Verdict::Duplicate {
            return Ok(Admission::Duplicate);
        }
        if inner.pending.bytes() + inner.committing >= self.rows_limit(inner.streams) {
            return Ok(Admission::Full(batch));
        }
        if let Verdict::Gap { from, to } = verdict {
            tracing::warn!(run_id = %key.0, rank = key.1, from, to, "batches declared dropped by the agent");
            batch.tables.extend(gap_rows(key, from, to));
        }
        let seq = batch.seq;
        inner.pending.push_batch(&key.0, key.1, batch);
        inner
            .ranks
            .entry(key.clone())
            .or_insert_with(|| RankState::new(0))
            .accepted = seq;
        Ok(Admission::Accepted)
    }

    /// Takes the buffered rows for a commit; their bytes count against the bound
    /// until [`Intake::committed_pending`] or [`Intake::restore_pending`].
    pub fn take_pending(&self) -> Pending {
        let mut inner = self.lock();
        let taken = inner.pending.take();
        inner.committing = taken.bytes();
        taken
    }

    /// The taken rows are written (and about to be freed).
    pub fn committed_pending(&self) {
        self.lock().committing = 0;
    }

    /// Puts back rows whose commit failed.
    pub fn restore_pending(&self, pending: Pending) {
        let mut inner = self.lock();
        inner.committing = 0;
        inner.pending.restore(pending);
    }

    /// The buffer's state now.
    pub fn pending_stats(&self) -> PendingStats {
        let inner = self.lock();
        let p = &inner.pending;
        PendingStats {
            bytes: p.bytes(),
            largest_file_rows: p.largest_file_rows(),
            age: p.since().map(|t| t.elapsed()),
            limit: self.rows_limit(inner.streams),
            streams: inner.streams,
        }
    }

    /// Publishes newly durable watermarks to the streams waiting for them.
    pub fn mark_durable(&self, watermarks: &HashMap<RankKey, u64>) {
        let inner = self.lock();
        for (key, seq) in watermarks {
            if let Some(state) = inner.ranks.get(key) {
                state.durable.send_if_modified(|d| {
                    let newer = *seq > *d;
                    *d = (*d).max(*seq);
                    newer
                });
            }
        }
    }

    /// Buffers a `ranks` row with no `finished_at` for every rank whose streams all
    /// ended without a final batch more than `grace` ago; returns how many.
    pub fn record_vanished(&self, grace: Duration) -> usize {
        let mut inner = self.lock();
        let mut rows: Vec<(String, u32, RankRow)> = Vec::new();
        for ((run_id, rank), state) in inner.ranks.iter_mut() {
            let gone = state.gone_since.is_some_and(|t| t.elapsed() >= grace);
            if !gone || state.finished || state.live_streams > 0 {
                continue;
            }
            state.gone_since = None;
            if let Some(h) = state.hello.take() {
                tracing::warn!(run_id, rank, "rank vanished without finishing");
                let row = RankRow::from_hello(&h, None);
                rows.push((run_id.clone(), *rank, row));
            }
        }
        let n = rows.len();
        for (run_id, rank, row) in rows {
            let batch = Batch {
                ranks: vec![row],
                ..Default::default()
            };
            let records = wire::own_rows(&batch, &run_id, rank);
            inner.pending.push_rows(&run_id, records);
        }
        n
    }
}

/// The `events` row of a declared gap: batches `from` to `to` of `key`'s rank that
/// its agent dropped without an acknowledgement.
fn gap_rows(key: &RankKey, from: u64, to: u64) -> Vec<(Table, RecordBatch)> {
    let time = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64);
    let count = to - from + 1;
    let event = EventRow {
        time,
        kind: SEQ_GAP.into(),
        message: format!(
            "batches {from} to {to} of this rank were dropped by its agent before they were acknowledged (declared in the batch after them); their rows are counted in the agent's rows_dropped events"
        ),
        value: Some(i64::try_from(count).unwrap_or(i64::MAX)),
        step: None,
    };
    let batch = Batch {
        events: vec![event],
        ..Default::default()
    };
    wire::own_rows(&batch, &key.0, key.1)
}

/// The `events.kind` of a declared seq gap.
pub const SEQ_GAP: &str = "seq_gap";

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(seq: u64) -> BatchRecords {
        BatchRecords {
            seq,
            is_final: false,
            dropped_from: 0,
            tables: Vec::new(),
        }
    }

    /// A stream whose last batch was `last_seq`.
    fn after(last_seq: u64) -> OnStream {
        OnStream {
            generation: 0,
            last_seq,
        }
    }

    #[test]
    fn duplicates_are_dropped_by_seq() {
        let intake = Intake::new(HashMap::new(), usize::MAX);
        let key = ("run".to_string(), 0);
        assert_eq!(
            intake.admit(&key, after(0), batch(1)),
            Ok(Admission::Accepted)
        );
        assert_eq!(
            intake.admit(&key, after(1), batch(2)),
            Ok(Admission::Accepted)
        );
        // Resent on a new stream: held already.
        assert_eq!(
            intake.admit(&key, after(0), batch(2)),
            Ok(Admission::Duplicate)
        );
        assert_eq!(
            intake.admit(&key, after(0), batch(1)),
            Ok(Admission::Duplicate)
        );
        // Resent on the same stream: refused.
        assert_eq!(
            intake.admit(&key, after(2), batch(2)),
            Err(SeqError::NotIncreasing { seq: 2, last: 2 })
        );
        assert_eq!(intake.admit(&key, after(0), batch(0)), Err(SeqError::Zero));
        assert!(matches!(
            intake.admit(&key, after(0), batch(u64::MAX)),
            Err(SeqError::Absurd { .. })
        ));
        let other = ("run".to_string(), 1);
        assert_eq!(
            intake.admit(&other, after(0), batch(1)),
            Ok(Admission::Accepted)
        );
    }

    #[test]
    fn recovered_watermarks_drop_resent_batches() {
        let key = ("run".to_string(), 3);
        let intake = Intake::new(HashMap::from([(key.clone(), 5)]), usize::MAX);
        assert_eq!(
            intake.admit(&key, after(0), batch(5)),
            Ok(Admission::Duplicate)
        );
        assert_eq!(
            intake.admit(&key, after(5), batch(6)),
            Ok(Admission::Accepted)
        );
    }

    #[test]
    fn full_buffer_pushes_back() {
        let intake = Intake::new(HashMap::new(), 1);
        let key = ("run".to_string(), 0);
        let mut b = batch(1);
        let steps = Batch {
            steps: vec![Default::default()],
            ..Default::default()
        };
        b.tables = wire::own_rows(&steps, "run", 0);
        assert_eq!(intake.admit(&key, after(0), b), Ok(Admission::Accepted));
        assert_eq!(
            intake.admit(&key, after(1), batch(2)),
            Ok(Admission::Full(batch(2)))
        );
        // The rows of a commit in progress still count against the bound.
        intake.take_pending();
        assert_eq!(
            intake.admit(&key, after(1), batch(2)),
            Ok(Admission::Full(batch(2)))
        );
        intake.committed_pending();
        assert_eq!(
            intake.admit(&key, after(1), batch(2)),
            Ok(Admission::Accepted)
        );
    }

    #[test]
    fn open_streams_take_their_share_from_the_rows() {
        let bound = 512 << 20;
        let intake = Intake::new(HashMap::new(), bound);
        let rows = intake.pending_stats().limit;
        assert_eq!(rows, bound - RESERVED_BYTES - bound / 8);
        let one = stream_bytes(120_000);
        assert_eq!(one, STREAM_BASE_BYTES + 120_000 + 131_072);
        // A stream that sent small messages may still hold a window unread.
        assert_eq!(stream_bytes(0), STREAM_BASE_BYTES + UNREAD_BYTES);
        assert_eq!(stream_bytes(300), STREAM_BASE_BYTES + UNREAD_BYTES);
        assert!(UNREAD_BYTES >= 2 * crate::HTTP2_WINDOW_BYTES as usize);
        intake.resize_stream(0, stream_bytes(0));
        intake.resize_stream(stream_bytes(0), one);
        assert_eq!(intake.pending_stats().limit, rows - one);
        // Streams past what the bound holds leave the rows their floor.
        intake.resize_stream(0, bound);
        assert_eq!(intake.pending_stats().limit, bound / 16);
        intake.resize_stream(bound + one, 0);
        assert_eq!(intake.pending_stats().streams, 0);
        assert_eq!(intake.pending_stats().limit, rows);
    }

    #[tokio::test]
    async fn durable_watermarks_reach_subscribers() {
        let intake = Intake::new(HashMap::new(), usize::MAX);
        let hello = Hello {
            run_id: "run".into(),
            rank: 1,
            ..Default::default()
        };
        let (_, mut rx) = intake.attach(&hello).unwrap();
        intake.mark_durable(&HashMap::from([(("run".to_string(), 1), 4)]));
        rx.changed().await.unwrap();
        assert_eq!(*rx.borrow(), 4);
    }

    #[test]
    fn vanished_rank_gets_an_unfinished_row_once() {
        let intake = Intake::new(HashMap::new(), usize::MAX);
        let hello = Hello {
            run_id: "run".into(),
            rank: 1,
            ..Default::default()
        };
        let _rx = intake.attach(&hello).unwrap();
        intake.detach(&("run".into(), 1), false);
        assert_eq!(intake.record_vanished(Duration::ZERO), 1);
        assert_eq!(intake.record_vanished(Duration::ZERO), 0);
        let _rx = intake.attach(&hello).unwrap();
        intake.detach(&("run".into(), 1), true);
        assert_eq!(intake.record_vanished(Duration::ZERO), 0);
    }
}
