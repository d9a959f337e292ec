//! The counters the collector keeps as it works, as plain atomics: the service
//! counts streams, batches, rows and refusals ([`StreamCounters`]), the committer
//! counts commits and times them ([`CommitCounters`]). `ops::metrics` reads them
//! for `/metrics`, and `serve` reports them when it stops
//! ([`ServeSummary`](crate::ServeSummary)). Nothing here runs on the path of a
//! batch except an atomic add and, once per accepted batch, one short lock for
//! the per-run count.
//!
//! Rows are counted per run for up to [`MAX_RUN_SERIES`] runs seen since the
//! collector started (one `run_rows_received_total` series each); rows of runs
//! past that are counted under [`OTHER_RUNS`], `_other` (a name no run can have:
//! run ids start with a letter or digit).
//!
//! Below the service, the committer and `ops`, which all import it: it imports
//! only `table` and `wire` (to count a decoded batch's rows by table).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

use crate::table::Table;
use crate::wire::DecodedBatch;

/// Most runs with a series of their own in `run_rows_received_total`.
pub const MAX_RUN_SERIES: usize = 10_000;
/// The `run_id` label of rows of runs past [`MAX_RUN_SERIES`].
pub const OTHER_RUNS: &str = "_other";

/// Counters of what the service saw, reported at shutdown.
#[derive(Debug, Default)]
pub struct StreamCounters {
    pub streams: AtomicU64,
    pub batches: AtomicU64,
    pub duplicates: AtomicU64,
    pub refused: AtomicU64,
    /// `refused`, by reason.
    pub refusals: RefusalCounts,
    /// Rows of accepted batches, per table and per run.
    pub rows: RowCounts,
}

impl StreamCounters {
    /// Counts one refused stream or batch.
    pub fn refuse(&self, reason: Refusal) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        self.refusals.add(reason);
    }
}

/// Counters of what was committed, reported at shutdown and on `/metrics`.
#[derive(Debug)]
pub struct CommitCounters {
    pub commits: AtomicU64,
    pub files: AtomicU64,
    pub rows: AtomicU64,
    pub failures: AtomicU64,
    /// Seconds each successful commit took.
    pub duration: Histogram,
}

impl Default for CommitCounters {
    fn default() -> CommitCounters {
        CommitCounters {
            commits: AtomicU64::new(0),
            files: AtomicU64::new(0),
            rows: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            duration: commit_duration_histogram(),
        }
    }
}

/// Why a stream or a batch was refused: the `reason` label of `refused_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No bearer token, or a wrong one (`UNAUTHENTICATED`).
    Unauthenticated,
    /// An unknown schema major version (`FAILED_PRECONDITION`).
    Schema,
    /// A field breaks a rule: run id, rank, seq, labels, rows per batch (`INVALID_ARGUMENT`).
    Invalid,
    /// Bytes that are not rankscope.v1 messages, or messages out of order (`INVALID_ARGUMENT`).
    Malformed,
    /// A message over `--max-message-bytes` (`OUT_OF_RANGE`).
    TooLarge,
    /// More than `--max-streams` open (`RESOURCE_EXHAUSTED`).
    TooManyStreams,
    /// No Hello within 10 s (`DEADLINE_EXCEEDED`).
    NoHello,
    /// The output filesystem is below `--min-free-bytes` (`RESOURCE_EXHAUSTED`).
    LowDisk,
    /// The buffer stayed full for 10 s (`UNAVAILABLE`).
    BufferFull,
    /// A stream opened while the collector drains (`UNAVAILABLE`).
    ShuttingDown,
    /// A message did not arrive whole within `--message-timeout` of its first
    /// byte (`DEADLINE_EXCEEDED`).
    MessageTimeout,
    /// Another process's stream holds the rank (`FAILED_PRECONDITION`): two
    /// processes claim one rank.
    Claimed,
    /// A newer stream of the same process took the rank over (`ABORTED`).
    Superseded,
    /// The agent went away mid-stream: it reset or cancelled the stream, its
    /// connection closed, or it stopped answering keepalive pings. Not counted
    /// once the stream delivered its final batch.
    Disconnected,
}

impl Refusal {
    pub const ALL: [Refusal; 14] = [
        Refusal::Unauthenticated,
        Refusal::Schema,
        Refusal::Invalid,
        Refusal::Malformed,
        Refusal::TooLarge,
        Refusal::TooManyStreams,
        Refusal::NoHello,
        Refusal::LowDisk,
        Refusal::BufferFull,
        Refusal::ShuttingDown,
        Refusal::MessageTimeout,
        Refusal::Claimed,
        Refusal::Superseded,
        Refusal::Disconnected,
    ];

    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Unauthenticated => "unauthenticated",
            Refusal::Schema => "schema",
            Refusal::Invalid => "invalid",
            Refusal::Malformed => "malformed",
            Refusal::TooLarge => "too_large",
            Refusal::TooManyStreams => "too_many_streams",
            Refusal::NoHello => "no_hello",
            Refusal::LowDisk => "low_disk",
            Refusal::BufferFull => "buffer_full",
            Refusal::ShuttingDown => "shutting_down",
            Refusal::MessageTimeout => "message_timeout",
            Refusal::Claimed => "claimed",
            Refusal::Superseded => "superseded",
            Refusal::Disconnected => "disconnected",
        }
    }

    /// The reason for a status that ended the reading of a stream, by its code:
    /// tonic's `INTERNAL` for undecodable bytes, `OUT_OF_RANGE` for a message over
    /// the size limit, `INVALID_ARGUMENT` for a batch over the row limit. `None`
    /// for any other code. (The service tells a disconnect and a message timeout
    /// by the status's source first, `grpc::ReadEnd`: a reset stream can carry
    /// `INTERNAL` too.)
    pub fn of_read_error(code: tonic::Code) -> Option<Refusal> {
        match code {
            tonic::Code::Internal => Some(Refusal::Malformed),
            tonic::Code::OutOfRange => Some(Refusal::TooLarge),
            tonic::Code::InvalidArgument => Some(Refusal::Invalid),
            _ => None,
        }
    }
}

/// Refusals counted by reason.
#[derive(Debug, Default)]
pub struct RefusalCounts([AtomicU64; Refusal::ALL.len()]);

impl RefusalCounts {
    pub fn add(&self, reason: Refusal) {
        self.0[reason as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self, reason: Refusal) -> u64 {
        self.0[reason as usize].load(Ordering::Relaxed)
    }
}

/// Rows of one batch, per table in [`Table::ALL`] order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchRows([u64; Table::ALL.len()]);

impl BatchRows {
    pub fn of(batch: &DecodedBatch) -> BatchRows {
        BatchRows(Table::ALL.map(|t| batch.rows(t) as u64))
    }

    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
}

/// Rows of accepted batches, per table and per run.
#[derive(Debug, Default)]
pub struct RowCounts {
    tables: [AtomicU64; Table::ALL.len()],
    runs: Mutex<HashMap<String, u64>>,
}

impl RowCounts {
    /// Counts the rows of a batch of `run_id` that was accepted.
    pub fn add(&self, run_id: &str, rows: BatchRows) {
        for (counter, n) in self.tables.iter().zip(rows.0) {
            counter.fetch_add(n, Ordering::Relaxed);
        }
        let mut runs = self.runs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = runs.get_mut(run_id) {
            *count += rows.total();
        } else {
            let key = if runs.len() < MAX_RUN_SERIES {
                run_id
            } else {
                OTHER_RUNS
            };
            *runs.entry(key.to_string()).or_default() += rows.total();
        }
    }

    /// Rows received for `table`.
    pub fn table(&self, table: Table) -> u64 {
        let i = Table::ALL.iter().position(|t| *t == table).unwrap_or(0);
        self.tables[i].load(Ordering::Relaxed)
    }

    /// Rows received per run (sorted by run id).
    pub fn runs(&self) -> Vec<(String, u64)> {
        let runs = self.runs.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<_> = runs.iter().map(|(k, v)| (k.clone(), *v)).collect();
        v.sort();
        v
    }
}

/// The commit-duration histogram's buckets, in seconds: 1 ms to about 16 s.
pub fn commit_duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rankscope_proto::v1::{Batch, StepRow};
    use std::collections::HashMap;

    #[test]
    fn rows_are_counted_per_table_and_per_run_with_a_cap() {
        let rows = RowCounts::default();
        let batch = Batch {
            steps: vec![StepRow::default(); 3],
            ..Default::default()
        };
        let batch = crate::wire::decode_batch(
            &prost::Message::encode_to_vec(&batch),
            &[0; Table::ALL.len()],
        )
        .unwrap();
        rows.add("a", BatchRows::of(&batch));
        rows.add("a", BatchRows::of(&batch));
        assert_eq!(rows.table(Table::Steps), 6);
        assert_eq!(rows.table(Table::Layers), 0);
        assert_eq!(rows.runs(), vec![("a".to_string(), 6)]);
        {
            let mut runs = rows.runs.lock().unwrap();
            for i in 0..MAX_RUN_SERIES - 1 {
                runs.insert(format!("r{i}"), 0);
            }
        }
        rows.add("late", BatchRows::of(&batch));
        rows.add("a", BatchRows::of(&batch));
        let runs: HashMap<_, _> = rows.runs().into_iter().collect();
        assert_eq!(runs.len(), MAX_RUN_SERIES + 1);
        assert_eq!(runs[OTHER_RUNS], 3);
        assert_eq!(runs["a"], 9);
        assert!(!runs.contains_key("late"));
    }

    #[test]
    fn refusal_labels_are_distinct_and_indexed_in_order() {
        for (i, r) in Refusal::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i);
        }
        let labels: std::collections::HashSet<_> = Refusal::ALL.map(Refusal::label).into();
        assert_eq!(labels.len(), Refusal::ALL.len());
    }
}
