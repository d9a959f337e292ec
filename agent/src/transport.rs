//! The transport: a background thread, with its own single-threaded tokio runtime,
//! that batches rows and streams them to the collector.
//!
//! The training thread only calls [`Transport::send`], a `try_send` into a bounded
//! queue: when the queue is full the row is dropped and counted, never waited for.
//! The queue never wakes the transport thread; the thread takes what is queued
//! every [`DRAIN_EVERY`], so a row costs the training thread a short uncontended
//! lock and no system call.
//! The thread cuts rows into batches numbered by `seq` and keeps every batch in the
//! [`Outbox`] until the collector acknowledges it as durable. After a reconnect
//! (exponential backoff with jitter) it resends what is unacknowledged; the
//! collector drops what it already holds. Drops are reported as `events` rows
//! (`kind = "rows_dropped"`), and [`Transport::finish`] reports what was never
//! acknowledged.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rand::Rng;
use rankscope_proto::v1::agent_message::Kind as AgentKind;
use rankscope_proto::v1::collector_client::CollectorClient;
use rankscope_proto::v1::collector_message::Kind as CollectorKind;
use rankscope_proto::v1::{AgentMessage, Batch, EventRow, Hello};
use tokio::sync::mpsc;
use tonic::Streaming;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::now_us;
use crate::outbox::{Outbox, OutboxConfig};
use crate::row::Row;
use crate::spill::SpillLog;

/// How often the transport thread takes the rows queued by the training side.
pub const DRAIN_EVERY: Duration = Duration::from_millis(20);

/// The bounded row queue between the training side and the transport thread.
#[derive(Debug)]
struct RowQueue {
    /// The rows, and whether the queue is closed (after `finish`).
    state: Mutex<(Vec<Row>, bool)>,
    capacity: usize,
}

impl RowQueue {
    fn new(capacity: usize) -> RowQueue {
        RowQueue {
            state: Mutex::new((Vec::new(), false)),
            capacity: capacity.max(1),
        }
    }

    // The row comes back by value: boxing it would allocate on the hot path.
    #[allow(clippy::result_large_err)]
    fn push(&self, row: Row) -> Result<(), Row> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (rows, closed) = &mut *state;
        if *closed || rows.len() >= self.capacity {
            return Err(row);
        }
        rows.push(row);
        Ok(())
    }

    /// Everything queued so far, in order; with `close`, later pushes fail.
    fn take(&self, close: bool) -> Vec<Row> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.1 |= close;
        std::mem::take(&mut state.0)
    }
}

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
    /// Root of the spill directories (`<root>/<run id>/rank-<rank>`); `None`
    /// keeps unacknowledged batches in memory only.
    pub spill_dir: Option<PathBuf>,
    /// Bound on one rank's spill, in bytes.
    pub spill_bytes: u64,
    /// Largest message sent, in bytes.
    pub max_message_bytes: usize,
    /// Longest wait between reconnection attempts.
    pub max_backoff: Duration,
    /// Bearer token sent with every stream (`RANKSCOPE_TOKEN`).
    pub token: Option<String>,
    /// TLS to the collector; `None` is plaintext.
    pub tls: Option<ClientTls>,
}

/// PEM contents for TLS to the collector.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientTls {
    /// The CA that signed the collector's certificate.
    pub ca_pem: Vec<u8>,
    /// Client certificate and key, for mutual TLS.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// The name to verify in the collector's certificate, if not the address's host.
    pub domain: Option<String>,
}

impl std::fmt::Debug for ClientTls {
    // Never prints the private key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("mutual", &self.identity.is_some())
            .field("domain", &self.domain)
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    fn config(&self) -> ClientTlsConfig {
        let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.ca_pem));
        if let Some((cert, key)) = &self.identity {
            config = config.identity(Identity::from_pem(cert, key));
        }
        if let Some(domain) = &self.domain {
            config = config.domain_name(domain.clone());
        }
        config
    }
}

impl TransportConfig {
    pub fn new(collector: impl Into<String>) -> TransportConfig {
        TransportConfig {
            collector: collector.into(),
            queue_rows: 65_536,
            batch_rows: 4096,
            batch_interval: Duration::from_millis(500),
            outbox_bytes: 64 * 1024 * 1024,
            spill_dir: None,
            spill_bytes: 1024 * 1024 * 1024,
            max_message_bytes: rankscope_proto::DEFAULT_MAX_MESSAGE_BYTES,
            max_backoff: Duration::from_secs(5),
            token: None,
            tls: None,
        }
    }
}

/// What the transport delivered, as known when it finished.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FinishReport {
    /// Rows handed to the transport.
    pub rows_sent: u64,
    /// Rows the collector acknowledged as durable.
    pub rows_acked: u64,
    /// Rows dropped because the queue or the outbox was full.
    pub rows_dropped: u64,
    /// Rows still unacknowledged when the deadline passed (collector unreachable).
    pub rows_unsent: u64,
    /// Of those, rows kept in the spill directory: a later process of the same run
    /// and rank, or `rankscope replay`, sends them.
    pub rows_spilled: u64,
    /// The spill directory that holds them.
    pub spill_dir: Option<PathBuf>,
    /// Whether the collector was ever reached.
    pub connected: bool,
}

impl FinishReport {
    /// True when every row reached durable storage.
    pub fn complete(&self) -> bool {
        self.rows_dropped == 0 && self.rows_unsent == 0
    }
}

#[derive(Debug, Default)]
struct Counters {
    sent: AtomicU64,
    dropped_queue: AtomicU64,
}

enum Control {
    Finish {
        final_rows: Vec<Row>,
        deadline: Instant,
        reply: std_mpsc::Sender<FinishReport>,
    },
}

/// The handle the training side holds. Cheap to call from the hot path.
#[derive(Debug)]
pub struct Transport {
    data: Arc<RowQueue>,
    control: mpsc::UnboundedSender<Control>,
    counters: Arc<Counters>,
    warned_full: std::sync::atomic::AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
    report: OnceLock<FinishReport>,
}

impl Transport {
    /// Starts the background thread; it connects lazily and never blocks the caller.
    pub fn start(config: TransportConfig, hello: Hello) -> std::io::Result<Transport> {
        let data = Arc::new(RowQueue::new(config.queue_rows));
        let data_rx = data.clone();
        let (control_tx, control_rx) = mpsc::unbounded_channel();
        let counters = Arc::new(Counters::default());
        let thread_counters = counters.clone();
        let thread = std::thread::Builder::new()
            .name(format!("rankscope-transport-{}", hello.rank))
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(error) => {
                        tracing::error!(%error, "cannot start the transport runtime; telemetry is off");
                        return;
                    }
                };
                let worker = Worker::new(config, hello, thread_counters);
                runtime.block_on(worker.run(data_rx, control_rx));
            })?;
        Ok(Transport {
            data,
            control: control_tx,
            counters,
            warned_full: Default::default(),
            thread: Mutex::new(Some(thread)),
            report: OnceLock::new(),
        })
    }

    /// Queues a row, or gives it back when the queue is full (nothing counted): for
    /// producers that can wait, such as the load generator.
    // The row comes back by value: boxing it would allocate on the hot path.
    #[allow(clippy::result_large_err)]
    pub fn try_send(&self, row: Row) -> Result<(), Row> {
        match self.data.push(row) {
            Ok(()) => {
                self.counters.sent.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(row) => Err(row),
        }
    }

    /// Queues a row; never blocks. Returns false (and counts the row as dropped)
    /// when the queue is full or the transport has finished.
    pub fn send(&self, row: Row) -> bool {
        match self.try_send(row) {
            Ok(()) => true,
            Err(_) => {
                self.counters.dropped_queue.fetch_add(1, Ordering::Relaxed);
                if !self.warned_full.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "telemetry queue full: dropping rows (counted, reported as rows_dropped events)"
                    );
                }
                false
            }
        }
    }

    /// Sends `final_rows` in a final batch, waits at most `timeout` for everything
    /// to be acknowledged, and stops the thread. Callable more than once: later
    /// calls return the first report.
    pub fn finish(&self, final_rows: Vec<Row>, timeout: Duration) -> FinishReport {
        if let Some(report) = self.report.get() {
            return report.clone();
        }
        let (reply_tx, reply_rx) = std_mpsc::channel();
        self.counters
            .sent
            .fetch_add(final_rows.len() as u64, Ordering::Relaxed);
        let control = Control::Finish {
            final_rows,
            deadline: Instant::now() + timeout,
            reply: reply_tx,
        };
        let report = if self.control.send(control).is_ok() {
            reply_rx
                .recv_timeout(timeout + Duration::from_secs(1))
                .unwrap_or_default()
        } else {
            FinishReport::default()
        };
        if let Some(thread) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = thread.join();
        }
        self.report.get_or_init(|| report).clone()
    }
}

impl Drop for Transport {
    fn drop(&mut self) {
        if self.report.get().is_none() {
            self.finish(Vec::new(), Duration::from_secs(2));
        }
    }
}

/// An open stream to the collector.
struct Connection {
    out: mpsc::Sender<AgentMessage>,
    inbound: Streaming<rankscope_proto::v1::CollectorMessage>,
}

struct Worker {
    config: TransportConfig,
    hello: Hello,
    counters: Arc<Counters>,
    outbox: Outbox,
    current: Batch,
    current_since: Option<Instant>,
    dropped_reported: u64,
    connected_once: bool,
    warned_refusal: bool,
    backoff: Duration,
    next_attempt: Instant,
}

impl Worker {
    /// Runs on the transport thread: opening the spill reads back what an earlier
    /// process left, which the training thread must not wait for.
    fn new(config: TransportConfig, hello: Hello, counters: Arc<Counters>) -> Worker {
        let spill_dir = config
            .spill_dir
            .as_ref()
            .map(|root| SpillLog::rank_dir(root, &hello.run_id, hello.rank));
        let outbox = Outbox::open(OutboxConfig {
            spill_dir,
            spill_bytes: config.spill_bytes,
            segment_bytes: (config.spill_bytes / 64).clamp(64 * 1024, 16 * 1024 * 1024),
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
                kind: "spill_damaged".into(),
                message: "damaged spill records skipped (bytes): the machine crashed while they were written".into(),
                value: Some(outbox.damaged_bytes() as i64),
                step: None,
            });
        }
        Worker {
            config,
            hello,
            counters,
            current_since: (!current.events.is_empty()).then(Instant::now),
            outbox,
            current,
            dropped_reported: 0,
            connected_once: false,
            warned_refusal: false,
            backoff: Duration::ZERO,
            next_attempt: Instant::now(),
        }
    }

    async fn run(mut self, data: Arc<RowQueue>, mut control: mpsc::UnboundedReceiver<Control>) {
        let mut conn: Option<Connection> = None;
        let mut tick = tokio::time::interval(DRAIN_EVERY);
        loop {
            if conn.is_none() && Instant::now() >= self.next_attempt {
                conn = self.connect().await;
            }
            let out = conn
                .as_ref()
                .filter(|_| self.outbox.has_unsent())
                .map(|c| c.out.clone());
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
                    Some(permit) => self.send_next(permit),
                    None => conn = self.disconnected("stream closed"),
                },
                message = next_message(&mut conn) => {
                    if let Err(why) = self.on_message(message) {
                        conn = self.disconnected(&why);
                    }
                }
                _ = tick.tick() => {
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
        if batch_rows(&self.current) >= self.config.batch_rows {
            self.cut(false);
        }
    }

    /// Closes the current batch (adding a drop report if rows were dropped since
    /// the last one) and hands it to the outbox.
    fn cut(&mut self, is_final: bool) {
        let dropped =
            self.counters.dropped_queue.load(Ordering::Relaxed) + self.outbox.dropped_rows();
        if dropped > self.dropped_reported {
            self.current.events.push(EventRow {
                time: now_us(),
                kind: "rows_dropped".into(),
                message: "telemetry rows dropped: the agent's queue or outbox was full".into(),
                value: Some((dropped - self.dropped_reported) as i64),
                step: None,
            });
            self.dropped_reported = dropped;
        }
        if batch_rows(&self.current) == 0 && !is_final {
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
                self.warned_refusal = false;
                Some(conn)
            }
            Err(why) => self.disconnected(&why),
        }
    }

    async fn open(&mut self) -> Result<Connection, String> {
        let tls = self.config.tls.as_ref();
        let uri = if self.config.collector.contains("://") {
            self.config.collector.clone()
        } else if tls.is_some() {
            format!("https://{}", self.config.collector)
        } else {
            format!("http://{}", self.config.collector)
        };
        let mut endpoint = Endpoint::from_shared(uri.clone())
            .map_err(|e| format!("bad collector address {uri:?}: {e}"))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true);
        match tls {
            Some(tls) => {
                endpoint = endpoint
                    .tls_config(tls.config())
                    .map_err(|e| format!("TLS settings (RANKSCOPE_TLS_*): {e}"))?;
            }
            None if uri.starts_with("https://") => {
                return Err(format!(
                    "collector address {uri} asks for TLS: set RANKSCOPE_TLS_CA to the CA that signed its certificate"
                ));
            }
            None => {}
        }
        let channel: Channel = endpoint.connect().await.map_err(|e| e.to_string())?;
        let mut client = CollectorClient::new(channel)
            .max_decoding_message_size(self.config.max_message_bytes)
            .max_encoding_message_size(self.config.max_message_bytes);
        let (out, rx) = mpsc::channel(8);
        let hello = AgentMessage {
            kind: Some(AgentKind::Hello(self.hello.clone())),
        };
        out.send(hello).await.map_err(|e| e.to_string())?;
        let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        if let Some(token) = &self.config.token {
            let value = format!("Bearer {token}").parse().map_err(|_| {
                "RANKSCOPE_TOKEN holds characters not allowed in a header".to_string()
            })?;
            request.metadata_mut().insert("authorization", value);
        }
        let response = client
            .stream(request)
            .await
            .map_err(|status| format!("{:?}: {}", status.code(), status.message()))?;
        let mut inbound = response.into_inner();
        match inbound.message().await {
            Ok(Some(rankscope_proto::v1::CollectorMessage {
                kind: Some(CollectorKind::Welcome(welcome)),
            })) => {
                if !self.connected_once && welcome.durable_seq > 0 {
                    tracing::info!(
                        rank = self.hello.rank,
                        durable_seq = welcome.durable_seq,
                        "continuing after an earlier process of this rank"
                    );
                }
                self.outbox.welcome(welcome.durable_seq);
                tracing::debug!(
                    rank = self.hello.rank,
                    durable_seq = welcome.durable_seq,
                    "connected"
                );
                Ok(Connection { out, inbound })
            }
            Ok(_) => Err("collector sent no Welcome".into()),
            Err(status) => Err(status.message().to_string()),
        }
    }

    fn on_message(
        &mut self,
        message: Result<Option<rankscope_proto::v1::CollectorMessage>, tonic::Status>,
    ) -> Result<(), String> {
        match message {
            Ok(Some(rankscope_proto::v1::CollectorMessage {
                kind: Some(CollectorKind::Ack(ack)),
            })) => {
                self.outbox.acknowledge(ack.durable_seq);
                Ok(())
            }
            Ok(Some(_)) => Ok(()),
            Ok(None) => Err("collector closed the stream".into()),
            Err(status) => Err(format!("{:?}: {}", status.code(), status.message())),
        }
    }

    fn send_next(&mut self, permit: mpsc::OwnedPermit<AgentMessage>) {
        if let Some(batch) = self.outbox.next_unsent() {
            permit.send(AgentMessage {
                kind: Some(AgentKind::Batch(batch)),
            });
        }
    }

    /// Forgets the connection and schedules the next attempt.
    fn disconnected(&mut self, why: &str) -> Option<Connection> {
        let refused = [
            "Unauthenticated",
            "InvalidArgument",
            "FailedPrecondition",
            "PermissionDenied",
        ]
        .iter()
        .any(|code| why.starts_with(code));
        if refused && !self.warned_refusal {
            self.warned_refusal = true;
            tracing::error!(
                rank = self.hello.rank,
                why,
                "collector refused this rank's stream; retrying with backoff"
            );
        }
        self.backoff =
            (self.backoff * 2).clamp(Duration::from_millis(100), self.config.max_backoff);
        let jitter = rand::rng().random_range(0.5..1.0);
        self.next_attempt = Instant::now() + self.backoff.mul_f64(jitter);
        tracing::debug!(rank = self.hello.rank, why, retry_in = ?self.backoff, "collector unreachable");
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
                .map(|c| c.out.clone());
            tokio::select! {
                permit = reserve(out) => match permit {
                    Some(permit) => self.send_next(permit),
                    None => *conn = self.disconnected("stream closed"),
                },
                message = next_message(conn) => {
                    if let Err(why) = self.on_message(message) {
                        *conn = self.disconnected(&why);
                    }
                }
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        let dropped =
            self.counters.dropped_queue.load(Ordering::Relaxed) + self.outbox.dropped_rows();
        let report = FinishReport {
            rows_sent: self.counters.sent.load(Ordering::Relaxed),
            rows_acked: self.outbox.acked_rows(),
            rows_dropped: dropped,
            rows_unsent: self.outbox.unacked_rows(),
            rows_spilled: self.outbox.spilled_rows(),
            spill_dir: self.outbox.spill().map(|log| log.dir().to_path_buf()),
            connected: self.connected_once,
        };
        if !report.complete() {
            tracing::warn!(
                rank = self.hello.rank,
                rows_unsent = report.rows_unsent,
                rows_dropped = report.rows_dropped,
                rows_spilled = report.rows_spilled,
                spill_dir = ?report.spill_dir,
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
async fn reserve(
    out: Option<mpsc::Sender<AgentMessage>>,
) -> Option<mpsc::OwnedPermit<AgentMessage>> {
    match out {
        Some(out) => out.reserve_owned().await.ok(),
        None => std::future::pending().await,
    }
}

/// The next message from the collector; pending forever while disconnected.
async fn next_message(
    conn: &mut Option<Connection>,
) -> Result<Option<rankscope_proto::v1::CollectorMessage>, tonic::Status> {
    match conn {
        Some(c) => c.inbound.message().await,
        None => std::future::pending().await,
    }
}

/// Rows of all tables in a batch.
pub fn batch_rows(b: &Batch) -> usize {
    b.steps.len() + b.layers.len() + b.runs.len() + b.ranks.len() + b.model.len() + b.events.len()
}
