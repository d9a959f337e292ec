//! The collector's figures on `/metrics`, in the Prometheus exposition format
//! (OpenMetrics text, as `prometheus-client` writes it).
//!
//! Counters are kept where the work happens, as plain atomics: the service counts
//! streams, batches, rows and refusals ([`crate::service::StreamCounters`]), the
//! committer counts commits and times them ([`crate::committer::CommitCounters`]).
//! Gauges (buffer, open streams, free space, readiness) are read at scrape time.
//! Nothing here runs on the path of a batch except an atomic add and, once per
//! accepted batch, one short lock for the per-run count.
//!
//! Every name starts with `rankscope_collector_`; docs/operations.md lists them.
//! `run_rows_received_total` has one series per run seen since the collector
//! started, up to [`MAX_RUN_SERIES`]; rows of runs past that are counted under
//! `run_id="_other"` (a name no run can have: run ids start with a letter or digit).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::wire::DecodedBatch;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::Readiness;
use crate::committer::CommitCounters;
use crate::intake::Intake;
use crate::service::StreamCounters;
use crate::table::Table;

/// The prefix of every metric name.
pub const PREFIX: &str = "rankscope_collector";
/// Most runs with a series of their own in `run_rows_received_total`.
pub const MAX_RUN_SERIES: usize = 10_000;
/// The `run_id` label of rows of runs past [`MAX_RUN_SERIES`].
pub const OTHER_RUNS: &str = "_other";
/// The `Content-Type` of a scrape.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

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
}

impl Refusal {
    pub const ALL: [Refusal; 10] = [
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
        }
    }

    /// The reason for a status that ended the reading of a stream: tonic's
    /// `INTERNAL` for undecodable bytes, `OUT_OF_RANGE` for a message over the
    /// size limit, `INVALID_ARGUMENT` for a batch over the row limit. `None` for
    /// anything that is not a refusal (the agent went away).
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

/// What a scrape reads.
#[derive(Debug)]
pub struct Figures {
    pub streams: Arc<StreamCounters>,
    pub commits: Arc<CommitCounters>,
    pub intake: Arc<Intake>,
    pub open_streams: Arc<AtomicUsize>,
    pub readiness: Readiness,
    pub out: PathBuf,
    pub min_free_bytes: u64,
}

impl Figures {
    /// The registry a scrape encodes.
    pub fn registry(self) -> Registry {
        let mut registry = Registry::with_prefix(PREFIX);
        registry.register(
            "commit_duration_seconds",
            "Seconds a successful commit took (encode, fsync, rename)",
            self.commits.duration.clone(),
        );
        registry.register_collector(Box::new(self));
        registry
    }
}

/// Encodes the whole registry for one scrape.
pub fn encode(registry: &Registry) -> String {
    let mut text = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut text, registry);
    text
}

fn counter(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let c = ConstCounter::new(v);
    c.encode(e.encode_descriptor(name, help, None, c.metric_type())?)
}

fn gauge(e: &mut DescriptorEncoder, name: &str, help: &str, v: i64) -> std::fmt::Result {
    let g = ConstGauge::new(v);
    g.encode(e.encode_descriptor(name, help, None, g.metric_type())?)
}

fn counters<'a>(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    label: &str,
    series: impl IntoIterator<Item = (&'a str, u64)>,
) -> std::fmt::Result {
    let mut family = e.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (value, n) in series {
        ConstCounter::new(n).encode(family.encode_family(&[(label, value)])?)?;
    }
    Ok(())
}

fn signed(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Collector for Figures {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.streams;
        let c = &self.commits;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        counter(
            &mut e,
            "streams_accepted",
            "Streams whose Hello was accepted",
            load(&s.streams),
        )?;
        counter(
            &mut e,
            "batches_received",
            "Batches accepted (deduplicated, buffered)",
            load(&s.batches),
        )?;
        counter(
            &mut e,
            "batches_duplicate",
            "Batches dropped as duplicates of one already accepted (resends)",
            load(&s.duplicates),
        )?;
        counters(
            &mut e,
            "refused",
            "Streams and batches refused, by reason",
            "reason",
            Refusal::ALL.map(|r| (r.label(), s.refusals.get(r))),
        )?;
        counters(
            &mut e,
            "rows_received",
            "Rows of accepted batches, by table",
            "table",
            Table::ALL.map(|t| (t.name(), s.rows.table(t))),
        )?;
        let runs = s.rows.runs();
        counters(
            &mut e,
            "run_rows_received",
            "Rows of accepted batches, by run",
            "run_id",
            runs.iter().map(|(run, n)| (run.as_str(), *n)),
        )?;
        counter(&mut e, "commits", "Successful commits", load(&c.commits))?;
        counter(
            &mut e,
            "commit_failures",
            "Failed commit attempts (retried; see the log)",
            load(&c.failures),
        )?;
        counter(
            &mut e,
            "files_committed",
            "Parquet files committed",
            load(&c.files),
        )?;
        counter(
            &mut e,
            "rows_committed",
            "Rows committed (durable and acknowledged)",
            load(&c.rows),
        )?;
        let open = self.open_streams.load(Ordering::Relaxed);
        gauge(
            &mut e,
            "open_streams",
            "Streams open now",
            signed(open as u64),
        )?;
        let stats = self.intake.pending_stats();
        gauge(
            &mut e,
            "buffer_bytes",
            "Estimated memory of the rows waiting for a commit",
            signed(stats.bytes as u64),
        )?;
        gauge(
            &mut e,
            "buffer_limit_bytes",
            "What the rows held (buffered and being committed) may take now: the memory bound less the reserved, decoding and streams' shares; past it streams wait",
            signed(stats.limit as u64),
        )?;
        gauge(
            &mut e,
            "stream_memory_bytes",
            "Estimated memory the open streams take (HTTP/2 state, the message held, the read buffer)",
            signed(stats.streams as u64),
        )?;
        gauge(
            &mut e,
            "memory_limit_bytes",
            "The memory bound (--max-memory-bytes) that the collector's resident memory is kept within",
            signed(self.intake.max_memory_bytes() as u64),
        )?;
        if let Ok(free) = crate::space::available_bytes(&self.out) {
            gauge(
                &mut e,
                "disk_free_bytes",
                "Free bytes on the output filesystem",
                signed(free),
            )?;
        }
        gauge(
            &mut e,
            "disk_min_free_bytes",
            "--min-free-bytes: below it batches are refused",
            signed(self.min_free_bytes),
        )?;
        let ready = i64::from(self.readiness.check().is_ok());
        gauge(
            &mut e,
            "ready",
            "1 while accepting batches, 0 while draining or short of disk",
            ready,
        )?;
        Ok(())
    }
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
        let batch =
            crate::wire::decode_batch(&prost::Message::encode_to_vec(&batch), &[0; 6]).unwrap();
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
