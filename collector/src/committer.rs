//! The commit loop: decides when buffered rows become files, commits them off the
//! async reactor, and publishes the new durable watermarks.
//!
//! A commit is due when the oldest buffered row is `max_file_age` old, when a
//! (table, run) group reaches `max_file_rows`, when the buffer passes half the
//! memory the rows may take, or soon after an agent's final batch. A failed
//! commit (a full disk, say) keeps its rows, logs the error and is retried with
//! backoff; meanwhile the buffer's bound pushes back on the streams.
//!
//! It counts into [`crate::counters`] and sets [`crate::phase`], both below it and
//! the service.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::counters::CommitCounters;
use crate::intake::Intake;
use crate::phase::{Phase, until};
use crate::sink::Sink;

/// When commits happen.
#[derive(Debug, Clone)]
pub struct CommitPolicy {
    pub max_file_age: Duration,
    pub max_file_rows: usize,
    pub rank_grace: Duration,
}

const TICK: Duration = Duration::from_millis(100);
/// While rows keep arriving, freed memory goes back to the kernel at most this
/// often (see [`Trim`]).
const TRIM_EVERY: Duration = Duration::from_secs(10);
/// Gathers the final batches of ranks finishing together into one commit.
const SOON: Duration = Duration::from_millis(150);

/// Runs until `phase` leaves [`Phase::Serving`], then makes the final commit and
/// sets [`Phase::Drained`].
pub async fn run(
    intake: Arc<Intake>,
    sink: Arc<Sink>,
    policy: CommitPolicy,
    phase: watch::Sender<Phase>,
    counters: Arc<CommitCounters>,
) {
    let mut backoff = Duration::ZERO;
    let mut soon = false;
    let mut phase_rx = phase.subscribe();
    let mut trim = Trim::default();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(TICK.max(backoff)) => {}
            _ = intake.commit_soon.notified() => {
                soon = true;
                tokio::time::sleep(SOON).await;
            }
            _ = until(&mut phase_rx, |p| p != Phase::Serving) => break,
        }
        intake.record_vanished(policy.rank_grace);
        let stats = intake.pending_stats();
        trim.tick(stats.bytes, stats.streams);
        let due = soon
            || stats.age.is_some_and(|a| a >= policy.max_file_age)
            || stats.largest_file_rows >= policy.max_file_rows
            || stats.bytes >= stats.limit / 2;
        if !due {
            continue;
        }
        if commit_once(&intake, &sink, &counters).await {
            soon = false;
            backoff = Duration::ZERO;
            trim.committed();
        } else {
            backoff = (backoff * 2).clamp(Duration::from_millis(200), Duration::from_secs(5));
        }
    }
    // Let streams finish the batch they were admitting, then commit the rest.
    tokio::time::sleep(Duration::from_millis(50)).await;
    for attempt in 0..5 {
        if commit_once(&intake, &sink, &counters).await {
            break;
        }
        tracing::error!(attempt, "final commit failed; retrying");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    release_freed_memory();
    let _ = phase.send(Phase::Drained);
}

/// When the memory that commits freed goes back to the kernel.
///
/// Returning it after every commit (`malloc_trim`) made the next batches fault
/// fresh pages in and the kernel zero them: under a steady load that was most of
/// the collector's page-fault time, for memory it needed again within a second.
/// So it is returned once the intake is quiet (the buffer did not grow over a
/// tick after a commit), and at most every [`TRIM_EVERY`] while rows keep
/// arriving. Either way the process does not stay at its peak once the load
/// stops, and the peak is what the buffer's bound allows.
#[derive(Debug)]
struct Trim {
    /// A commit freed memory that was not returned yet.
    owed: bool,
    last: Instant,
    last_bytes: usize,
    last_streams: usize,
}

impl Default for Trim {
    fn default() -> Trim {
        Trim {
            owed: false,
            last: Instant::now(),
            last_bytes: 0,
            last_streams: 0,
        }
    }
}

impl Trim {
    fn committed(&mut self) {
        self.owed = true;
        self.last_bytes = 0;
    }

    /// Called every tick with the buffer's bytes; trims when it is time, and
    /// says whether it did.
    /// `streams` is what the open streams take ([`Intake::resize_stream`]): when
    /// it fell, streams ended and freed what they held (their read buffers, the
    /// unfinished messages of a flood), which is owed back too.
    fn tick(&mut self, bytes: usize, streams: usize) -> bool {
        let quiet = bytes <= self.last_bytes;
        self.last_bytes = bytes;
        if streams < self.last_streams {
            self.owed = true;
        }
        self.last_streams = streams;
        if self.owed && (quiet || self.last.elapsed() >= TRIM_EVERY) {
            release_freed_memory();
            self.owed = false;
            self.last = Instant::now();
            return true;
        }
        false
    }
}

/// Commits everything buffered; true on success or when there was nothing to do.
async fn commit_once(intake: &Arc<Intake>, sink: &Arc<Sink>, counters: &CommitCounters) -> bool {
    let pending = intake.take_pending();
    if pending.is_empty() {
        return true;
    }
    let started = Instant::now();
    let (pending, result) = sink.commit(pending).await;
    let ok = match result {
        Ok(summary) => {
            intake.mark_durable(pending.watermarks());
            drop(pending);
            intake.committed_pending();
            counters.commits.fetch_add(1, Ordering::Relaxed);
            counters.duration.observe(started.elapsed().as_secs_f64());
            counters
                .files
                .fetch_add(summary.files as u64, Ordering::Relaxed);
            counters
                .rows
                .fetch_add(summary.rows as u64, Ordering::Relaxed);
            tracing::debug!(files = summary.files, rows = summary.rows, "committed");
            true
        }
        Err(error) => {
            counters.failures.fetch_add(1, Ordering::Relaxed);
            tracing::error!(%error, "commit failed; rows kept for retry");
            intake.restore_pending(pending);
            false
        }
    };
    intake.committed.notify_waiters();
    ok
}

/// Hands the memory freed by a commit back to the kernel. glibc's allocator keeps
/// freed memory in its arenas; after the rows of a commit are freed that is tens
/// to hundreds of MiB, which the process's RSS would go on counting (measured
/// under `rankscope bench collector`: 327 MiB resident with an empty buffer).
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages of the allocator's arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_memory_is_returned_once_the_intake_is_quiet() {
        let mut trim = Trim::default();
        // Nothing committed: nothing owed, however quiet.
        assert!(!trim.tick(0, 0));
        assert!(!trim.tick(0, 0));
        trim.committed();
        // Rows keep arriving: no trim yet.
        assert!(!trim.tick(1_000, 0));
        assert!(!trim.tick(5_000, 0));
        // The buffer stopped growing: trimmed, once.
        assert!(trim.tick(5_000, 0));
        assert!(!trim.tick(5_000, 0));
        // Under a steady load, at most every TRIM_EVERY.
        trim.committed();
        trim.last -= TRIM_EVERY;
        assert!(trim.tick(1_000, 0));
    }

    #[test]
    fn memory_of_ended_streams_is_returned_without_a_commit() {
        let mut trim = Trim::default();
        // Streams open: nothing owed.
        assert!(!trim.tick(0, 4 << 20));
        assert!(!trim.tick(0, 8 << 20));
        // Some end (a flood timed out): their memory goes back at once, quiet.
        assert!(trim.tick(0, 1 << 20));
        assert!(!trim.tick(0, 1 << 20));
    }
}
