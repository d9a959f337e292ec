//! The rankscope collector: a gRPC server that takes the telemetry streams of every
//! rank of a training job and merges them into hive-partitioned Parquet files,
//! `OUT/<table>/run_id=<run>/part-*.parquet`, that DuckDB reads while the run goes on.
//!
//! It never needs libtorch: it is deployed on machines that never train.
//!
//! Layout:
//! - [`auth`]: the bearer-token check on every stream;
//! - [`tls`]: TLS for the listener, optionally mutual;
//! - [`validate`]: checks on everything that arrives from the network;
//! - [`grpc`]: the gRPC route, with a decoder that bounds a batch's rows before
//!   allocating them;
//! - [`wire`]: the protobuf reader that decodes a batch straight into Arrow
//!   builders;
//! - [`service`]: the gRPC service, one task per rank stream;
//! - [`intake`]: accepted rows and the per-(run, rank) sequence watermarks (dedup);
//! - [`sequence`]: the rules that make an acknowledged seq a stored one (seqs
//!   increase within a stream, a gap is taken only when the agent declares it, one
//!   process per rank), which `intake` applies;
//! - [`room`]: the room for decoding, which unfinished messages and batches being
//!   decoded share;
//! - [`buffer`]: rows waiting for the next commit, grouped by (table, run);
//! - [`table`]: the seven tables' columns and their Arrow builders;
//! - [`committer`]: when buffered rows become files;
//! - [`phase`]: serving, draining, drained: where the collector is in its life,
//!   which the service, the committer and `ops` watch;
//! - [`counters`]: what the service and the committer count, read by `ops` and
//!   the summary `serve` returns;
//! - [`output`]: where the collector writes, `--out` parsed: a folder, `delta:PATH`
//!   or `s3://BUCKET/PREFIX`;
//! - [`sink`]: the output opened, one interface over the two below for the
//!   committer and the service;
//! - [`store`]: the output directory; [`store::writer`] encodes a Parquet file,
//!   [`store::commit`] makes atomic commits and writes the commit log,
//!   [`store::recovery`] recovers after a crash;
//! - `delta` (with the `delta` feature): the Delta Lake output, one Delta table
//!   per table, exactly once through each table's `txn` actions;
//! - [`space`]: free space on the output filesystem, the `--min-free-bytes` floor;
//! - [`live`]: the live view, what every rank is doing now, fed by the rows as
//!   they are accepted and bounded in memory;
//! - [`ops`]: `/metrics`, `/healthz`, `/readyz` and `/live` (`--http`) and the
//!   gRPC health service;
//! - `fuzzing` (only with the `fuzzing` feature, and in unit tests): what the
//!   collector runs on one message's bytes, as plain functions that assert their
//!   contract, for the fuzz targets (`fuzz/`).
//!
//! No module imports one that imports it back: `service`, `committer` and `ops`
//! share only what sits below all three (`phase`, `counters`, `intake`, `space`),
//! and a folder's parent module imports none of its children.

pub mod auth;
pub mod buffer;
pub mod committer;
pub mod counters;
#[cfg(feature = "delta")]
pub mod delta;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod grpc;
pub mod intake;
pub mod live;
pub mod ops;
pub mod output;
pub mod phase;
pub mod room;
pub mod sequence;
pub mod service;
pub mod sink;
pub mod space;
pub mod store;
pub mod table;
pub mod tls;
pub mod validate;
pub mod wire;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;

use crate::committer::CommitPolicy;
use crate::counters::{CommitCounters, Refusal, StreamCounters};
use crate::grpc::{CollectorServer, MessageLimits};
use crate::intake::Intake;
use crate::phase::{Phase, until};
use crate::service::CollectorService;
use crate::sink::{Sink, SinkError};

pub use crate::output::Output;

/// How the collector writes and what it accepts.
#[derive(Debug, Clone)]
pub struct CollectorConfig {
    /// Where commits go: a folder (the default), or Delta tables.
    pub out: Output,
    /// A file is closed at most this long after its first row arrived.
    pub max_file_age: Duration,
    /// A file is closed once it holds this many rows.
    pub max_file_rows: usize,
    /// Rows per Parquet row group.
    pub row_group_rows: usize,
    /// Bound on the collector's resident memory, in bytes: what it reserves, what
    /// the open streams take and the rows held share it (see [`intake::Intake`]);
    /// past it streams wait.
    pub max_memory_bytes: usize,
    /// Largest message accepted, in bytes.
    pub max_message_bytes: usize,
    /// A message not arrived whole this long after its first byte ends its stream
    /// (`DEADLINE_EXCEEDED`; the agent resends on a new one).
    pub message_timeout: Duration,
    /// Most streams open at once.
    pub max_streams: usize,
    /// How long a rank may stay disconnected before it is recorded as vanished.
    pub rank_grace: Duration,
    /// When set, every stream must carry `authorization: Bearer <token>`.
    pub token: Option<String>,
    /// Refuse new batches (`RESOURCE_EXHAUSTED`, retried by agents) while the output
    /// filesystem has less free space than this; 0 turns the check off.
    pub min_free_bytes: u64,
    /// TLS for the listener; `None` serves plaintext.
    pub tls: Option<tls::ServerTls>,
    /// Steps the live view keeps per rank (`/live` on the `--http` server); 0
    /// turns it off.
    pub live_steps: usize,
    /// Runs the live diagnoses for `/live` (the command hands in report's).
    pub live_findings: Option<live::Findings>,
}

impl CollectorConfig {
    /// The output directory of the command line's default.
    pub const DEFAULT_OUT: &str = "rankscope-out";
    pub const DEFAULT_MAX_FILE_AGE: Duration = Duration::from_secs(10);
    pub const DEFAULT_MAX_FILE_ROWS: usize = 1_000_000;
    pub const DEFAULT_ROW_GROUP_ROWS: usize = 1_000_000;
    pub const DEFAULT_MAX_MEMORY_BYTES: usize = 512 * 1024 * 1024;
    pub const DEFAULT_MAX_STREAMS: usize = 4096;
    pub const DEFAULT_RANK_GRACE: Duration = Duration::from_secs(30);
    /// 30 s: a 16 MiB message (the largest by default) arrives within it at
    /// 4.5 Mbit/s, and an agent's batch of about 128 KiB at 35 kbit/s; a network
    /// cut of a few seconds (TCP resends once the link is back) does not end a
    /// message caught in it; and a sender that stalls gives its room back within
    /// it, sooner than the keepalive would notice a dead peer (40 s).
    pub const DEFAULT_MESSAGE_TIMEOUT: Duration = Duration::from_secs(30);

    /// The defaults, writing to `out`. The command line's defaults are these.
    pub fn new(out: impl Into<Output>) -> CollectorConfig {
        CollectorConfig {
            out: out.into(),
            max_file_age: Self::DEFAULT_MAX_FILE_AGE,
            max_file_rows: Self::DEFAULT_MAX_FILE_ROWS,
            row_group_rows: Self::DEFAULT_ROW_GROUP_ROWS,
            max_memory_bytes: Self::DEFAULT_MAX_MEMORY_BYTES,
            max_message_bytes: rankscope_proto::DEFAULT_MAX_MESSAGE_BYTES,
            message_timeout: Self::DEFAULT_MESSAGE_TIMEOUT,
            max_streams: Self::DEFAULT_MAX_STREAMS,
            rank_grace: Self::DEFAULT_RANK_GRACE,
            token: None,
            min_free_bytes: space::DEFAULT_MIN_FREE_BYTES,
            tls: None,
            live_steps: live::DEFAULT_STEPS,
            live_findings: None,
        }
    }

    /// The smallest `max_memory_bytes`: the reserve, the decode room and a
    /// sixteenth for the rows, with 96 MiB left for the open streams (about 340
    /// streams of the agents' batches before the rows are held to their floor).
    pub const MIN_MAX_MEMORY_BYTES: usize = 256 * 1024 * 1024;
    /// The smallest `max_message_bytes`: room for a Hello and a batch of a few rows.
    pub const MIN_MAX_MESSAGE_BYTES: usize = 4096;

    /// Refuses settings that would leave the collector unable to accept rows, or
    /// its memory unbounded, naming the flag and the fix.
    pub fn check(&self) -> Result<(), CollectorError> {
        let bad = |text: String| Err(CollectorError::Config(text));
        if self.max_memory_bytes < Self::MIN_MAX_MEMORY_BYTES {
            return bad(format!(
                "--max-memory-bytes {} is below the smallest bound of {} ({} MiB): the collector \
                 reserves {} MiB for itself, an eighth for decoding and the rest for the open \
                 streams and the rows; give at least {}",
                self.max_memory_bytes,
                Self::MIN_MAX_MEMORY_BYTES,
                Self::MIN_MAX_MEMORY_BYTES >> 20,
                intake::RESERVED_BYTES >> 20,
                Self::MIN_MAX_MEMORY_BYTES
            ));
        }
        if self.max_message_bytes < Self::MIN_MAX_MESSAGE_BYTES {
            return bad(format!(
                "--max-message-bytes {} is below {}: a message must hold a batch of a few rows; \
                 give at least {} (the agents send about 128 KiB; the default is {})",
                self.max_message_bytes,
                Self::MIN_MAX_MESSAGE_BYTES,
                Self::MIN_MAX_MESSAGE_BYTES,
                rankscope_proto::DEFAULT_MAX_MESSAGE_BYTES
            ));
        }
        let decode_room = self.max_memory_bytes / 8;
        if self.max_message_bytes > decode_room {
            return bad(format!(
                "--max-message-bytes {} is more than the room for decoding, an eighth of \
                 --max-memory-bytes {} ({}): lower it (the agents send about 128 KiB), or raise \
                 --max-memory-bytes to at least {}",
                self.max_message_bytes,
                self.max_memory_bytes,
                decode_room,
                self.max_message_bytes.saturating_mul(8)
            ));
        }
        if self.message_timeout.is_zero() {
            return bad(format!(
                "--message-timeout 0 would end every stream at its first message: give the time \
                 a message may take from its first byte to its last (the default is {:?})",
                Self::DEFAULT_MESSAGE_TIMEOUT
            ));
        }
        if self.max_file_rows == 0 {
            return bad(format!(
                "--max-file-rows 0 would close every file before its first row: give at least 1 \
                 (the default is {})",
                Self::DEFAULT_MAX_FILE_ROWS
            ));
        }
        if self.live_steps > live::MAX_STEPS {
            return bad(format!(
                "--live-steps {} is more than the live view keeps ({}): give at most {} \
                 (the default is {}; 0 turns the view off)",
                self.live_steps,
                live::MAX_STEPS,
                live::MAX_STEPS,
                live::DEFAULT_STEPS
            ));
        }
        if self.max_streams == 0 {
            return bad(format!(
                "--max-streams 0 accepts no rank: give at least 1 (the default is {})",
                Self::DEFAULT_MAX_STREAMS
            ));
        }
        if let Output::Dir(dir) = &self.out
            && dir.exists()
            && !dir.is_dir()
        {
            return bad(format!(
                "--out {} is a file, not a directory: give a directory (the collector \
                 creates it when it is missing)",
                dir.display()
            ));
        }
        Ok(())
    }
}

/// Why the collector could not run.
#[derive(Debug, thiserror::Error)]
pub enum CollectorError {
    #[error(transparent)]
    Store(#[from] SinkError),
    #[error("gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error(
        "cannot use the TLS certificate and key: {0} (check --tls-cert, --tls-key and --tls-client-ca: PEM files, key matching certificate)"
    )]
    Tls(tonic::transport::Error),
    /// A setting the collector cannot work with; the text names the value and the fix.
    #[error("{0}")]
    Config(String),
}

/// What the collector did, reported when it stops.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServeSummary {
    pub streams: u64,
    pub batches: u64,
    pub duplicates: u64,
    pub refused: u64,
    pub commits: u64,
    pub files: u64,
    pub rows: u64,
    pub failed_commits: u64,
}

/// Serves on `listener` until `shutdown` resolves, then drains: stops reading,
/// commits everything accepted, acknowledges it, closes the streams and returns.
pub async fn serve(
    listener: TcpListener,
    config: CollectorConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<ServeSummary, CollectorError> {
    serve_with_http(listener, None, config, shutdown).await
}

/// Flow-control window of each HTTP/2 stream and connection, in bytes.
pub const HTTP2_WINDOW_BYTES: u32 = 65_535;

/// [`serve`], plus the ops endpoints (`/metrics`, `/healthz`, `/readyz`) on
/// `http` when given. They answer through the drain (`/readyz` then says 503)
/// and stop once the gRPC server has stopped.
pub async fn serve_with_http(
    listener: TcpListener,
    http: Option<TcpListener>,
    config: CollectorConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<ServeSummary, CollectorError> {
    config.check()?;
    // Each connection (one rank's stream) buffers at most one HTTP/2 window of
    // data the collector has not read yet: the protocol's default of 64 KiB,
    // instead of hyper's 1 MiB, so 1,024 waiting ranks hold 64 MiB, not 1 GiB.
    let mut builder = tonic::transport::Server::builder()
        .initial_stream_window_size(Some(HTTP2_WINDOW_BYTES))
        .initial_connection_window_size(Some(HTTP2_WINDOW_BYTES));
    if let Some(tls) = &config.tls {
        builder = builder
            .tls_config(tls.config())
            .map_err(CollectorError::Tls)?;
    }
    let (sink, recovered) = Sink::open(&config.out, config.row_group_rows).await?;
    let sink = Arc::new(sink);
    if !recovered.is_empty() {
        tracing::info!(ranks = recovered.len(), "recovered durable watermarks");
    }
    let intake = Arc::new(Intake::new(recovered, config.max_memory_bytes));
    let (phase_tx, phase_rx) = watch::channel(Phase::Serving);
    let stream_counters = Arc::new(StreamCounters::default());
    let commit_counters = Arc::new(CommitCounters::default());
    let policy = CommitPolicy {
        max_file_age: config.max_file_age,
        max_file_rows: config.max_file_rows,
        rank_grace: config.rank_grace,
    };
    let phase_for_shutdown = phase_tx.clone();
    let committer = tokio::spawn(committer::run(
        intake.clone(),
        sink.clone(),
        policy,
        phase_tx,
        commit_counters.clone(),
    ));
    // Object storage has no free space to watch.
    let space = Arc::new(match config.out.local_dir() {
        Some(dir) => space::SpaceGuard::new(dir, config.min_free_bytes),
        None => space::SpaceGuard::new(std::path::Path::new("."), 0),
    });
    let readiness = ops::Readiness::new(phase_rx.clone(), space.clone());
    // Only `--http` serves the view: without it nothing is kept.
    let live = (config.live_steps > 0 && http.is_some())
        .then(|| Arc::new(live::LiveView::new(config.live_steps)));
    let service = CollectorService::new(
        intake.clone(),
        space,
        phase_rx.clone(),
        config.max_streams,
        stream_counters.clone(),
    )
    .with_live(live.clone())
    .with_sink(sink.clone());
    let (http_stop, http_task) = match http {
        Some(listener) => {
            let figures = ops::metrics::Figures {
                streams: stream_counters.clone(),
                commits: commit_counters.clone(),
                intake: intake.clone(),
                open_streams: service.open_streams(),
                message_timeout: config.message_timeout,
                readiness: readiness.clone(),
                out: config.out.local_dir().map(std::path::Path::to_path_buf),
                min_free_bytes: config.min_free_bytes,
            };
            let live = live.map(|view| {
                ops::live::LiveEndpoints::new(view, config.token.clone())
                    .with_findings(config.live_findings.clone())
            });
            let endpoints = ops::http::Endpoints::new(figures.registry(), readiness.clone(), live);
            let (stop, stopped) = watch::channel(false);
            let task = tokio::spawn(ops::http::serve(listener, endpoints, stopped));
            (Some(stop), Some(task))
        }
        None => (None, None),
    };
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    let health_task = tokio::spawn(ops::report_grpc_health(health_reporter, readiness));
    let limits = MessageLimits {
        max_message_bytes: config.max_message_bytes,
        room: intake.room(),
        timeout: config.message_timeout,
    };
    let server = CollectorServer::new(service, limits);
    let mut token = auth::BearerToken::new(config.token.clone());
    let counters = stream_counters.clone();
    let server = InterceptedService::new(server, move |request| {
        token.call(request).inspect_err(|_| {
            counters.refuse(Refusal::Unauthenticated);
        })
    });
    let mut drained = phase_rx;
    let shutdown = async move {
        shutdown.await;
        tracing::info!("draining: committing what was accepted");
        let _ = phase_for_shutdown.send(Phase::Draining);
        until(&mut drained, |p| p == Phase::Drained).await;
    };
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    builder
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .add_service(health_service)
        .add_service(server)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    let _ = committer.await;
    let _ = health_task.await;
    if let (Some(stop), Some(task)) = (http_stop, http_task) {
        let _ = stop.send(true);
        let _ = task.await;
    }
    let s = &stream_counters;
    let c = &commit_counters;
    let summary = ServeSummary {
        streams: s.streams.load(Ordering::Relaxed),
        batches: s.batches.load(Ordering::Relaxed),
        duplicates: s.duplicates.load(Ordering::Relaxed),
        refused: s.refused.load(Ordering::Relaxed),
        commits: c.commits.load(Ordering::Relaxed),
        files: c.files.load(Ordering::Relaxed),
        rows: c.rows.load(Ordering::Relaxed),
        failed_commits: c.failures.load(Ordering::Relaxed),
    };
    tracing::info!(?summary, "collector stopped");
    Ok(summary)
}
