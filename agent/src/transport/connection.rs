//! The connection loop of the transport thread ([`Streamer`]): it takes the rows
//! queued by the training side, cuts them into batches, hands the batches to the
//! [`Outbox`] (which numbers them by `seq` and keeps each until the collector
//! acknowledges it as durable), and streams them. After a failed stream it
//! reconnects with exponential backoff and jitter and resends what is
//! unacknowledged; the collector drops what it already holds. Drops are reported
//! as `events` rows (`kind = "rows_dropped"`).
//!
//! The handle ([`crate::transport::Transport`]) starts it and talks to it through
//! [`Control`] and [`Counters`]; this module depends on no other part of the
//! transport but the queue, the outbox and the report.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use prost::Message;
use rand::Rng;
use rankscope_proto::v1::agent_message::Kind as AgentKind;
use rankscope_proto::v1::collector_client::CollectorClient;
use rankscope_proto::v1::collector_message::Kind as CollectorKind;
use rankscope_proto::v1::{AgentMessage, Batch, CollectorMessage, EventRow, Hello};
use tokio::sync::mpsc;
use tonic::Streaming;
use tonic::transport::{Channel, Endpoint};

use super::client_tls::ClientTls;
use super::outbox::{Outbox, OutboxConfig};
use super::queue::RowQueue;
use super::report::FinishReport;
use super::spill::SpillLog;
use crate::rows::now_us;
use rankscope_proto::{LAYER_COLUMNS_MINOR, Row};

/// How often the transport thread takes the rows queued by the training side.
///
/// Each wake-up costs the thread CPU time (about 50 us on a loaded virtual
/// machine, measured), all of it charged to the overhead budget: at 20 ms that was
/// 0.3 % of a core, a sixth of the default 2 % budget, spent whether or not there
/// were rows. 100 ms still takes the queue (65,536 rows) five times per batch
/// interval.
pub const DRAIN_EVERY: Duration = Duration::from_millis(100);

/// Rows the training thread may queue by default (`queue_rows`).
pub const DEFAULT_QUEUE_ROWS: usize = 65_536;
/// One rank's spill bound by default (`spill_max_bytes`, `RANKSCOPE_SPILL_MAX_BYTES`).
pub const DEFAULT_SPILL_MAX_BYTES: u64 = 1 << 30;

/// Transport settings.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    /// `host:port` or `http://host:port` of the collector.
    pub collector: String,
    /// Rows the training thread may queue before rows are dropped.
    pub queue_rows: usize,
    /// Rows per batch at most.
    pub batch_rows: usize,
    /// A batch is cut at least this often while rows arrive.
    pub batch_interval: Duration,
    /// Bound on unacknowledged batches held in memory, in encoded bytes.
    pub outbox_bytes: usize,
    /// Root of the spill directories (`<spill_dir>/<run id>/rank-<rank>`);
    /// `None` keeps unacknowledged batches in memory only.
    pub spill_dir: Option<PathBuf>,
    /// Bound on one rank's spill, in bytes.
    pub spill_max_bytes: u64,
    /// Largest message sent, in bytes.
    pub max_message_bytes: usize,
    /// Longest wait between reconnection attempts.
    pub max_backoff: Duration,
    /// Bearer token sent with every stream (`RANKSCOPE_TOKEN`).
    pub token: Option<String>,
    /// TLS to the collector; `None` is plaintext.
    pub tls: Option<ClientTls>,
    /// Send `layers` rows as columns to a collector that reads them (schema
    /// minor 3); `false` sends rows, as older agents do (to compare the two).
    pub layer_columns: bool,
}

impl TransportConfig {
    /// The defaults, sending to `collector`.
    pub fn new(collector: impl Into<String>) -> TransportConfig {
        TransportConfig {
            collector: collector.into(),
            queue_rows: DEFAULT_QUEUE_ROWS,
            batch_rows: 1024,
            batch_interval: Duration::from_millis(500),
            outbox_bytes: 64 * 1024 * 1024,
            spill_dir: None,
            spill_max_bytes: DEFAULT_SPILL_MAX_BYTES,
            max_message_bytes: rankscope_proto::DEFAULT_MAX_MESSAGE_BYTES,
            max_backoff: Duration::from_secs(5),
            token: None,
            tls: None,
            layer_columns: true,
        }
    }
}

/// Counted by the handle, read by the transport thread.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Rows queued (handed to the transport).
    pub(crate) queued: AtomicU64,
    /// Rows the full queue refused.
    pub(crate) dropped_queue: AtomicU64,
    /// The transport thread's CPU time up to the end of its first connection
    /// attempt (its start, the runtime, the connection and the Hello): one-time
    /// set-up at `init`, which the overhead budget leaves out. 0 until then.
    pub(crate) set_up_ns: Arc<AtomicU64>,
    /// The process's CPU time and the transport thread's, read by the transport
    /// thread on every tick for the overhead budget, so that the training thread
    /// does not read them.
    pub(crate) tick_clocks: Arc<crate::budget::cpu_clock::TickClocks>,
}

/// Requests from the handle to the transport thread.
pub(crate) enum Control {
    /// Send `final_rows` in a final batch and drain until `deadline`.
    Finish {
        final_rows: Vec<Row>,
        deadline: Instant,
        reply: std_mpsc::Sender<FinishReport>,
    },
}

/// Why a stream could not be opened or went away.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum StreamError {
    /// The settings cannot make a connection (address, TLS, token); retried all
    /// the same, since the collector end may be what changes.
    #[error("{0}")]
    Setup(String),
    /// No connection to the collector.
    #[error("collector unreachable: {0}")]
    Unreachable(String),
    /// The collector answered with a gRPC status.
    #[error("{code:?}: {message}")]
    Status { code: tonic::Code, message: String },
    /// The collector sent something no rankscope collector sends.
    #[error("{0}")]
    Invalid(String),
    /// The stream ended without a status.
    #[error("{0}")]
    Closed(&'static str),
}

impl From<tonic::Status> for StreamError {
    fn from(status: tonic::Status) -> StreamError {
        StreamError::Status {
            code: status.code(),
            message: status.message().to_string(),
        }
    }
}

impl StreamError {
    /// Whether the collector refused this rank's stream (its token, its Hello or a
    /// batch), as opposed to being unreachable, busy or shutting down: worth one
    /// error in the log, since retrying alone will not fix it.
    pub(crate) fn is_refusal(&self) -> bool {
        matches!(
            self,
            StreamError::Invalid(_)
                | StreamError::Status {
                    code: tonic::Code::Unauthenticated
                        | tonic::Code::InvalidArgument
                        | tonic::Code::FailedPrecondition
                        | tonic::Code::PermissionDenied,
                    ..
                }
        )
    }
}

/// An open stream to the collector.
struct Connection {
    out: mpsc::Sender<AgentMessage>,
    inbound: Streaming<CollectorMessage>,
    /// The collector reads `layers` as columns (its Welcome's schema minor).
    layer_columns: bool,
}

/// The transport thread's state: the batch being cut, the outbox, and the
/// connection schedule.
pub(crate) struct Streamer {
    config: TransportConfig,
    hello: Hello,
    counters: Arc<Counters>,
    outbox: Outbox,
    current: Batch,
    current_since: Option<Instant>,
    dropped_reported: u64,
    connected_once: bool,
    /// Whether `counters.set_up_ns` holds the set-up time.
    set_up_done: bool,
    warned_unfixable: bool,
    backoff: Duration,
    next_attempt: Instant,
}

impl Streamer {
    /// Runs on the transport thread: opening the spill reads back what an earlier
    /// process left, which the training thread must not wait for.
    pub(crate) fn new(config: TransportConfig, hello: Hello, counters: Arc<Counters>) -> Streamer {
        let rank_spill_dir = config
            .spill_dir
            .as_ref()
            .map(|root| SpillLog::rank_dir(root, &hello.run_id, hello.rank));
        let outbox = Outbox::open(OutboxConfig {
            rank_spill_dir,
            spill_max_bytes: config.spill_max_bytes,
            segment_bytes: (config.spill_max_bytes / 64).clamp(64 * 1024, 16 * 1024 * 1024),
            memory_bytes: config.outbox_bytes,
        });
        if let Some(why) = outbox.spill_error() {
            tracing::error!(
                rank = hello.rank,
                why,
                "no spill: unacknowledged batches stay in memory"
            );
        }
        if let Some(log) = outbox.spill() {
            if let Err(e) = log.write_hello(&hello) {
                tracing::warn!(error = %e, "cannot record this rank in its spill directory");
            }
            if !outbox.is_empty() {
                tracing::info!(
                    rank = hello.rank,
                    rows = outbox.unacked_rows(),
                    dir = %log.dir().display(),
                    "replaying what an earlier process of this rank left unacknowledged"
                );
            }
        }
        let mut current = Batch::default();
        if outbox.damaged_bytes() > 0 {
            current.events.push(EventRow {
                time: now_us(),
                kind: crate::rows::event_kind::SPILL_DAMAGED.into(),
                message: "damaged spill records skipped (bytes): the machine crashed while they were written".into(),
                value: Some(outbox.damaged_bytes() as i64),
                step: None,
            });
        }
        Streamer {
            config,
            hello,
            counters,
            current_since: (!current.events.is_empty()).then(Instant::now),
            outbox,
            current,
            dropped_reported: 0,
            connected_once: false,
            set_up_done: false,
            warned_unfixable: false,
            backoff: Duration::ZERO,
            next_attempt: Instant::now(),
        }
    }

    pub(crate) async fn run(
        mut self,
        data: Arc<RowQueue>,
        mut control: mpsc::UnboundedReceiver<Control>,
    ) {
        let mut conn: Option<Connection> = None;
        let mut tick = tokio::time::interval(DRAIN_EVERY);
        loop {
            if conn.is_none() && Instant::now() >= self.next_attempt {
                conn = self.connect().await;
                if !self.set_up_done {
                    self.set_up_done = true;
                    let ns = crate::budget::cpu_clock::this_thread_ns().unwrap_or(0);
                    self.counters.set_up_ns.store(ns.max(1), Ordering::Relaxed);
                    self.counters.tick_clocks.refresh();
                }
            }
            let out = conn
                .as_ref()
                .filter(|_| self.outbox.has_unsent())
                .map(|c| (c.out.clone(), c.layer_columns));
            tokio::select! {
                message = control.recv() => {
                    // A closed channel means the handle is gone: finish with no wait.
                    let (final_rows, deadline, reply) = match message {
                        Some(Control::Finish { final_rows, deadline, reply }) => (final_rows, deadline, Some(reply)),
                        None => (Vec::new(), Instant::now(), None),
                    };
                    for row in data.take(true) {
                        self.push(row);
                    }
                    for row in final_rows {
                        self.push(row);
                    }
                    self.cut(true);
                    let report = self.drain(&mut conn, deadline).await;
                    if let Some(reply) = reply {
                        let _ = reply.send(report);
                    }
                    return;
                }
                permit = reserve(out) => match permit {
                    Some((permit, layer_columns)) => self.send_next(permit, layer_columns),
                    None => conn = self.disconnected(StreamError::Closed("stream closed")),
                },
                message = next_message(&mut conn) => {
                    if let Err(why) = self.on_message(message) {
                        conn = self.disconnected(why);
                    }
                }
                _ = tick.tick() => {
                    self.counters.tick_clocks.refresh();
                    for row in data.take(false) {
                        self.push(row);
                    }
                    if self.current_since.is_some_and(|t| t.elapsed() >= self.config.batch_interval) {
                        self.cut(false);
                    }
                }
            }
        }
    }

    fn push(&mut self, row: Row) {
        row.append_to(&mut self.current);
        self.current_since.get_or_insert_with(Instant::now);
        if self.current.rows() >= self.config.batch_rows {
            self.cut(false);
        }
    }

    /// Closes the current batch (adding a drop report if rows were dropped since
    /// the last one) and hands it to the outbox.
    fn cut(&mut self, is_final: bool) {
        // Room for this batch first, so that its report counts what that drops.
        if self.current.rows() > 0 || is_final {
            self.outbox
                .make_room(self.current.encoded_len() + DROP_EVENT_BYTES);
        }
        let dropped =
            self.counters.dropped_queue.load(Ordering::Relaxed) + self.outbox.dropped_rows();
        // A report that went with a dropped batch is made again.
        self.dropped_reported = self
            .dropped_reported
            .saturating_sub(self.outbox.take_drop_reports_lost());
        if dropped > self.dropped_reported {
            self.current.events.push(EventRow {
                time: now_us(),
                kind: crate::rows::event_kind::ROWS_DROPPED.into(),
                message: "telemetry rows dropped: the agent's queue or outbox was full".into(),
                value: Some((dropped - self.dropped_reported) as i64),
                step: None,
            });
            self.dropped_reported = dropped;
        }
        if self.current.rows() == 0 && !is_final {
            return;
        }
        let mut batch = std::mem::take(&mut self.current);
        batch.r#final = is_final;
        self.current_since = None;
        self.outbox.push(batch);
    }

    async fn connect(&mut self) -> Option<Connection> {
        match self.open().await {
            Ok(conn) => {
                self.backoff = Duration::ZERO;
                self.connected_once = true;
                self.warned_unfixable = false;
                Some(conn)
            }
            Err(why) => self.disconnected(why),
        }
    }

    async fn open(&mut self) -> Result<Connection, StreamError> {
        let tls = self.config.tls.as_ref();
        let uri = if self.config.collector.contains("://") {
            self.config.collector.clone()
        } else if tls.is_some() {
            format!("https://{}", self.config.collector)
        } else {
            format!("http://{}", self.config.collector)
        };
        let mut endpoint = Endpoint::from_shared(uri.clone())
            .map_err(|e| StreamError::Setup(format!("bad collector address {uri:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true);
        match tls {
            Some(tls) => {
                endpoint = endpoint.tls_config(tls.config()).map_err(|e| {
                    StreamError::Setup(format!("TLS settings (RANKSCOPE_TLS_*): {e}"))
                })?;
            }
            None if uri.starts_with("https://") => {
                return Err(StreamError::Setup(format!(
                    "collector address {uri} asks for TLS: set RANKSCOPE_TLS_CA to the CA that signed its certificate"
                )));
            }
            None => {}
        }
        let channel: Channel = endpoint
            .connect()
            .await
            .map_err(|e| StreamError::Unreachable(e.to_string()))?;
        let mut client = CollectorClient::new(channel)
            .max_decoding_message_size(self.config.max_message_bytes)
            .max_encoding_message_size(self.config.max_message_bytes);
        let (out, rx) = mpsc::channel(8);
        let hello = AgentMessage {
            kind: Some(AgentKind::Hello(self.hello.clone())),
        };
        out.send(hello)
            .await
            .map_err(|_| StreamError::Closed("stream closed before the Hello"))?;
        let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        if let Some(token) = &self.config.token {
            let value = format!("Bearer {token}").parse().map_err(|_| {
                StreamError::Setup(
                    "RANKSCOPE_TOKEN holds characters not allowed in a header".to_string(),
                )
            })?;
            request.metadata_mut().insert("authorization", value);
        }
        let response = client.stream(request).await.map_err(StreamError::from)?;
        let mut inbound = response.into_inner();
        match inbound.message().await {
            Ok(Some(CollectorMessage {
                kind: Some(CollectorKind::Welcome(welcome)),
            })) => {
                if !self.connected_once && welcome.durable_seq > 0 {
                    tracing::info!(
                        rank = self.hello.rank,
                        durable_seq = welcome.durable_seq,
                        "continuing after an earlier process of this rank"
                    );
                }
                self.outbox
                    .welcome(welcome.durable_seq)
                    .map_err(|e| StreamError::Invalid(e.to_string()))?;
                tracing::debug!(
                    rank = self.hello.rank,
                    durable_seq = welcome.durable_seq,
                    "connected"
                );
                Ok(Connection {
                    out,
                    inbound,
                    layer_columns: self.config.layer_columns
                        && welcome.schema_minor >= LAYER_COLUMNS_MINOR,
                })
            }
            Ok(_) => Err(StreamError::Closed("collector sent no Welcome")),
            Err(status) => Err(StreamError::from(status)),
        }
    }

    fn on_message(
        &mut self,
        message: Result<Option<CollectorMessage>, tonic::Status>,
    ) -> Result<(), StreamError> {
        match message {
            Ok(Some(CollectorMessage {
                kind: Some(CollectorKind::Ack(ack)),
            })) => {
                self.outbox.acknowledge(ack.durable_seq);
                Ok(())
            }
            Ok(Some(_)) => Ok(()),
            Ok(None) => Err(StreamError::Closed("collector closed the stream")),
            Err(status) => Err(StreamError::from(status)),
        }
    }

    /// Sends the next unsent batch, its `layers` rows as columns to a collector
    /// that reads them (the outbox and the spill keep rows, which every collector
    /// reads).
    fn send_next(&mut self, permit: mpsc::OwnedPermit<AgentMessage>, layer_columns: bool) {
        if let Some(mut batch) = self.outbox.next_unsent() {
            if layer_columns {
                batch.layers_as_columns();
            }
            permit.send(AgentMessage {
                kind: Some(AgentKind::Batch(batch)),
            });
        }
    }

    /// Forgets the connection and schedules the next attempt.
    fn disconnected(&mut self, why: StreamError) -> Option<Connection> {
        if !self.warned_unfixable {
            if why.is_refusal() {
                self.warned_unfixable = true;
                tracing::error!(
                    rank = self.hello.rank,
                    %why,
                    "collector refused this rank's stream; retrying with backoff"
                );
            } else if matches!(why, StreamError::Setup(_)) {
                self.warned_unfixable = true;
                tracing::error!(
                    rank = self.hello.rank,
                    %why,
                    "cannot connect to the collector with these settings; retrying with backoff"
                );
            }
        }
        self.backoff =
            (self.backoff * 2).clamp(Duration::from_millis(100), self.config.max_backoff);
        let jitter = rand::rng().random_range(0.5..1.0);
        self.next_attempt = Instant::now() + self.backoff.mul_f64(jitter);
        tracing::debug!(rank = self.hello.rank, %why, retry_in = ?self.backoff, "stream failed");
        None
    }

    /// Sends and waits for acknowledgements until the outbox is empty or `deadline`.
    async fn drain(&mut self, conn: &mut Option<Connection>, deadline: Instant) -> FinishReport {
        let deadline = tokio::time::Instant::from_std(deadline);
        while !self.outbox.is_empty() && tokio::time::Instant::now() < deadline {
            if conn.is_none() {
                let wait = tokio::time::Instant::from_std(self.next_attempt).min(deadline);
                tokio::time::sleep_until(wait).await;
                if tokio::time::Instant::now() >= deadline {
                    break;
                }
                *conn = self.connect().await;
                continue;
            }
            let out = conn
                .as_ref()
                .filter(|_| self.outbox.has_unsent())
                .map(|c| (c.out.clone(), c.layer_columns));
            tokio::select! {
                permit = reserve(out) => match permit {
                    Some((permit, layer_columns)) => self.send_next(permit, layer_columns),
                    None => *conn = self.disconnected(StreamError::Closed("stream closed")),
                },
                message = next_message(conn) => {
                    if let Err(why) = self.on_message(message) {
                        *conn = self.disconnected(why);
                    }
                }
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        let dropped =
            self.counters.dropped_queue.load(Ordering::Relaxed) + self.outbox.dropped_rows();
        let report = FinishReport {
            rows_queued: self.counters.queued.load(Ordering::Relaxed),
            rows_acked: self.outbox.acked_rows(),
            rows_dropped: dropped,
            rows_unacked: self.outbox.unacked_rows(),
            rows_spilled: self.outbox.spilled_rows(),
            rank_spill_dir: self.outbox.spill().map(|log| log.dir().to_path_buf()),
            connected: self.connected_once,
        };
        if !report.complete() {
            tracing::warn!(
                rank = self.hello.rank,
                rows_unacked = report.rows_unacked,
                rows_dropped = report.rows_dropped,
                rows_spilled = report.rows_spilled,
                rank_spill_dir = ?report.rank_spill_dir,
                connected = report.connected,
                collector = %self.config.collector,
                "telemetry incomplete at finish; spilled rows are sent when this rank runs again under the same run id, or by `rankscope replay`"
            );
        }
        std::mem::replace(&mut self.outbox, Outbox::in_memory(0)).close();
        report
    }
}

/// Waits for room on the connection's outbound queue (None: the stream is gone);
/// pending forever when there is nothing to send.
/// Room for one message on the connection, with what the connection reads
/// (whether `layers` go as columns).
async fn reserve(
    out: Option<(mpsc::Sender<AgentMessage>, bool)>,
) -> Option<(mpsc::OwnedPermit<AgentMessage>, bool)> {
    match out {
        Some((out, layer_columns)) => out.reserve_owned().await.ok().map(|p| (p, layer_columns)),
        None => std::future::pending().await,
    }
}

/// The next message from the collector; pending forever while disconnected.
async fn next_message(
    conn: &mut Option<Connection>,
) -> Result<Option<CollectorMessage>, tonic::Status> {
    match conn {
        Some(c) => c.inbound.message().await,
        None => std::future::pending().await,
    }
}

/// What a `rows_dropped` event adds to a batch, about (its encoded bytes).
const DROP_EVENT_BYTES: usize = 128;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_told_apart_by_their_code() {
        for code in [
            tonic::Code::Unauthenticated,
            tonic::Code::InvalidArgument,
            tonic::Code::FailedPrecondition,
            tonic::Code::PermissionDenied,
        ] {
            let why = StreamError::from(tonic::Status::new(code, "no"));
            assert!(why.is_refusal(), "{why}");
        }
        for why in [
            StreamError::from(tonic::Status::unavailable("draining")),
            StreamError::from(tonic::Status::resource_exhausted("disk full")),
            StreamError::Unreachable("connection refused".into()),
            // A message that merely starts like a code is no refusal.
            StreamError::Setup("InvalidArgument in the address".into()),
            StreamError::Closed("collector closed the stream"),
        ] {
            assert!(!why.is_refusal(), "{why}");
        }
    }
}
