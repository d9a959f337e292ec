//! The collector's figures on `/metrics`, in the Prometheus exposition format
//! (OpenMetrics text, as `prometheus-client` writes it).
//!
//! The counters are kept where the work happens ([`crate::counters`]: the
//! service's [`StreamCounters`], the committer's [`CommitCounters`]) and read
//! here at scrape time, as are the gauges (buffer, open streams, free space,
//! readiness).
//!
//! Every name starts with `rankscope_collector_`; docs/operations.md lists them.
//! `run_rows_received_total` has one series per run seen since the collector
//! started, up to [`MAX_RUN_SERIES`](crate::counters::MAX_RUN_SERIES); rows of
//! runs past that are counted under `run_id="_other"`.
//!
//! Imports [`crate::counters`], the intake, `table`, `space` and its parent's
//! [`Readiness`]; none of them imports it, only `serve` and the HTTP server do.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use super::Readiness;
use crate::counters::{CommitCounters, Refusal, StreamCounters};
use crate::intake::Intake;
use crate::table::Table;

/// The prefix of every metric name.
pub const PREFIX: &str = "rankscope_collector";
/// The `Content-Type` of a scrape.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What a scrape reads.
#[derive(Debug)]
pub struct Figures {
    pub streams: Arc<StreamCounters>,
    pub commits: Arc<CommitCounters>,
    pub intake: Arc<Intake>,
    pub open_streams: Arc<AtomicUsize>,
    pub readiness: Readiness,
    /// The local folder written to (none for object storage).
    pub out: Option<PathBuf>,
    pub min_free_bytes: u64,
    /// `--message-timeout`.
    pub message_timeout: Duration,
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
        let room = self.intake.room();
        gauge(
            &mut e,
            "decode_room_bytes",
            "The room for decoding, an eighth of the memory bound: unfinished messages (their declared lengths) and batches being decoded share it; without room a stream is not read",
            signed(room.bytes() as u64),
        )?;
        gauge(
            &mut e,
            "decode_room_used_bytes",
            "Room for decoding held now, by unfinished messages and batches being decoded",
            signed(room.used_bytes() as u64),
        )?;
        gauge(
            &mut e,
            "unfinished_message_bytes",
            "Room held by messages still arriving (their declared lengths)",
            signed(room.unfinished_bytes() as u64),
        )?;
        let timeout = ConstGauge::new(self.message_timeout.as_secs_f64());
        timeout.encode(e.encode_descriptor(
            "message_timeout_seconds",
            "--message-timeout: a message not arrived whole this long after its first byte ends its stream",
            None,
            timeout.metric_type(),
        )?)?;
        gauge(
            &mut e,
            "memory_limit_bytes",
            "The memory bound (--max-memory-bytes) that the collector's resident memory is kept within",
            signed(self.intake.max_memory_bytes() as u64),
        )?;
        if let Some(Ok(free)) = self.out.as_deref().map(crate::space::available_bytes) {
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
