//! `rankscope collector`: runs the collector until SIGTERM or Ctrl-C, then drains.

use anyhow::Context;
use rankscope_collector::{CollectorConfig, Output};
use std::net::SocketAddr;
use std::path::PathBuf;

use crate::duration_arg;

/// Receive every rank's telemetry and write it as Parquet.
#[derive(clap::Args)]
#[command(after_help = "Examples:
  rankscope collector --out ./rankscope-out
  rankscope collector --listen 0.0.0.0:50051 --out /data/rankscope --token-file token.txt
  rankscope collector --out /data/rankscope --min-free-bytes 10737418240   # keep 10 GiB free
  rankscope collector --listen 0.0.0.0:50051 --token-file token.txt \
      --tls-cert server.pem --tls-key server.key --tls-client-ca ca.pem   # mutual TLS
  rankscope collector --out /data/rankscope --http 127.0.0.1:9464   # Prometheus, health, live view
  rankscope top --collector 127.0.0.1:9464                           # then watch the run live
  rankscope collector --out delta:/data/rankscope                    # Delta Lake tables
  AWS_REGION=us-east-1 rankscope collector --out s3://bucket/rankscope   # Delta tables on S3

With --http ADDR it also serves, over plain HTTP: GET /metrics (Prometheus
figures: rows and batches received, duplicates, refusals by reason, commit
durations, buffer bytes, open streams, rows per run, free disk), GET /healthz
(200 while the process runs), GET /readyz (200 while it accepts batches, 503
while it drains or its disk is below --min-free-bytes), and the live view of
every run: GET /live (a page), /live/runs and /live/runs/<run> (JSON),
/live/runs/<run>/events (server-sent events); with --token-file, /live asks for
the token. The gRPC port always serves the standard health service
(grpc.health.v1.Health), with the same readiness.

Files appear as OUT/<table>/run_id=<run>/part-*.parquet (tables: runs, ranks, steps,
layers, model, events, comm). With delta:PATH or s3://BUCKET/PREFIX (or gs://, az://) each table is the
Delta table PATH/<table>, partitioned by run_id, each commit one Delta transaction
(docs/past-one-machine.md). On SIGTERM or Ctrl-C the collector commits and acknowledges
everything it accepted, then exits 0.")]
pub struct Args {
    /// Address to listen on (port 0 picks a free port). Loopback by default:
    /// listen on a cluster address only with --token-file (see deploy/).
    #[arg(long, default_value = "127.0.0.1:50051", env = "RANKSCOPE_LISTEN", value_parser = socket_address)]
    pub listen: SocketAddr,
    /// Where to write: a folder (hive-partitioned Parquet), `delta:PATH` (one
    /// Delta Lake table per table under PATH) or `s3://BUCKET/PREFIX` (the same
    /// Delta tables on S3, with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    /// AWS_REGION, AWS_ENDPOINT_URL and AWS_ALLOW_HTTP); also `gs://BUCKET/PREFIX`
    /// (GCS) and `az://CONTAINER/PREFIX` (Azure); see docs/past-one-machine.md.
    #[arg(long, default_value = CollectorConfig::DEFAULT_OUT, env = "RANKSCOPE_OUT", value_parser = Output::parse)]
    pub out: Output,
    /// Close a file at most this long after its first row (data is queryable then).
    #[arg(long, default_value_t = duration_arg::Arg(CollectorConfig::DEFAULT_MAX_FILE_AGE), value_parser = duration_arg::parse_arg)]
    pub max_file_age: duration_arg::Arg,
    /// Close a file once it holds this many rows.
    #[arg(long, default_value_t = CollectorConfig::DEFAULT_MAX_FILE_ROWS)]
    pub max_file_rows: usize,
    /// Most rank streams open at once.
    #[arg(long, default_value_t = CollectorConfig::DEFAULT_MAX_STREAMS)]
    pub max_streams: usize,
    /// Largest message accepted, in bytes: at least 4096, at most an eighth of
    /// --max-memory-bytes (the room for decoding). Byte counts here take K, M
    /// or G (binary units).
    #[arg(long, default_value_t = rankscope_proto::DEFAULT_MAX_MESSAGE_BYTES, value_parser = crate::bytes_arg::parse_usize)]
    pub max_message_bytes: usize,
    /// Bound on the collector's resident memory, in bytes: 112 MiB reserved, an
    /// eighth for messages arriving and batches being decoded (without room a
    /// stream is not read), what the open streams take (about 290 KiB
    /// each) and the rest for rows buffered or being committed; past it streams
    /// wait. The rows always get a sixteenth: past about 1,080 streams per 512 MiB
    /// the collector warns and may pass the bound. At least 268435456 (256 MiB).
    #[arg(long, alias = "max-pending-bytes", default_value_t = CollectorConfig::DEFAULT_MAX_MEMORY_BYTES, value_parser = crate::bytes_arg::parse_usize)]
    pub max_memory_bytes: usize,
    /// How long a message may take from its first byte to its last; past it the
    /// stream ends (DEADLINE_EXCEEDED), freeing what it held, and the agent
    /// resends on a new one.
    #[arg(long, default_value_t = duration_arg::Arg(CollectorConfig::DEFAULT_MESSAGE_TIMEOUT), value_parser = duration_arg::parse_arg)]
    pub message_timeout: duration_arg::Arg,
    /// How long a disconnected rank may stay away before it is recorded as vanished.
    #[arg(long, default_value_t = duration_arg::Arg(CollectorConfig::DEFAULT_RANK_GRACE), value_parser = duration_arg::parse_arg)]
    pub rank_grace: duration_arg::Arg,
    /// A file holding the bearer token every agent must present (RANKSCOPE_TOKEN).
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// PEM certificate (chain) of the collector: serve TLS. Agents then use
    /// https://HOST:PORT with RANKSCOPE_TLS_CA.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificate: only agents with a client certificate it signed may
    /// connect (mutual TLS; agents set RANKSCOPE_TLS_CERT and RANKSCOPE_TLS_KEY).
    #[arg(long, requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// Refuse new batches while the output filesystem has less free space than
    /// this many bytes (0: never). Agents keep refused batches and resend them,
    /// so they land once space is freed.
    #[arg(long, default_value_t = rankscope_collector::space::DEFAULT_MIN_FREE_BYTES, value_parser = crate::bytes_arg::parse)]
    pub min_free_bytes: u64,
    /// Serve /metrics (Prometheus), /healthz, /readyz and /live over plain HTTP
    /// on this address (port 0 picks a free port). Off by default; no TLS (only
    /// /live asks for the --token-file token), so bind it to loopback or a
    /// monitoring network.
    #[arg(long, value_name = "ADDR", env = "RANKSCOPE_HTTP", value_parser = socket_address)]
    pub http: Option<SocketAddr>,
    /// Steps the live view (/live, `rankscope top`) keeps per rank, in memory;
    /// 0 turns it off.
    #[arg(long, value_name = "N", default_value_t = rankscope_collector::live::DEFAULT_STEPS)]
    pub live_steps: usize,
}

impl Args {
    /// The collector's configuration; reads the token and TLS files (once: call it
    /// once).
    pub fn config(&self) -> anyhow::Result<CollectorConfig> {
        let mut config = CollectorConfig::new(self.out.clone());
        config.max_file_age = self.max_file_age.0;
        config.max_file_rows = self.max_file_rows;
        config.max_streams = self.max_streams;
        config.max_message_bytes = self.max_message_bytes;
        config.max_memory_bytes = self.max_memory_bytes;
        config.message_timeout = self.message_timeout.0;
        config.rank_grace = self.rank_grace.0;
        config.min_free_bytes = self.min_free_bytes;
        config.live_steps = self.live_steps;
        config.live_findings = Some(crate::analysis::live::collector_findings());
        config.check()?;
        if let Some(path) = &self.token_file {
            let token = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read --token-file {}", path.display()))?;
            if token.trim().is_empty() {
                anyhow::bail!(
                    "--token-file {} is empty: put the shared token in it",
                    path.display()
                );
            }
            config.token = Some(token.trim().to_string());
        }
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            let read = |flag: &str, path: &PathBuf| {
                std::fs::read(path)
                    .with_context(|| format!("cannot read {flag} {}", path.display()))
            };
            config.tls = Some(rankscope_collector::tls::ServerTls {
                cert_pem: read("--tls-cert", cert)?,
                key_pem: read("--tls-key", key)?,
                client_ca_pem: self
                    .tls_client_ca
                    .as_ref()
                    .map(|ca| read("--tls-client-ca", ca))
                    .transpose()?,
            });
        }
        Ok(config)
    }
}

/// An address to listen on: IP:PORT, with a hint where a host name or a bare port
/// was given.
fn socket_address(text: &str) -> Result<SocketAddr, String> {
    text.trim().parse().map_err(|_| {
        format!(
            "{text:?} is not IP:PORT: give an IP address and a port, e.g. 127.0.0.1:50051 \
             (this machine only) or 0.0.0.0:50051 (every interface, with --token-file); \
             host names are not looked up"
        )
    })
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    let config = args.config()?;
    runtime.block_on(async {
        let shutdown = shutdown_signal();
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("cannot listen on {}: is the port in use? choose another with --listen", args.listen))?;
        let addr = listener.local_addr()?;
        // Tests and scripts read this line to find a port chosen with :0.
        let scheme = if args.tls_cert.is_some() { "TLS" } else { "plaintext" };
        say(format_args!("rankscope collector listening on {addr}, writing {} ({scheme})", args.out));
        if !addr.ip().is_loopback() && args.token_file.is_none() && args.tls_client_ca.is_none() {
            tracing::warn!(%addr, "listening beyond loopback with no --token-file and no --tls-client-ca: anyone who reaches this port can write");
        }
        let http = match args.http {
            Some(http) => {
                let listener = tokio::net::TcpListener::bind(http)
                    .await
                    .with_context(|| format!("cannot listen on --http {http}: is the port in use? choose another"))?;
                // Tests and scripts read this second line to find a port chosen with :0.
                say(format_args!("rankscope collector ops on http://{} (/metrics, /healthz, /readyz, /live)", listener.local_addr()?));
                Some(listener)
            }
            None => None,
        };
        let summary = rankscope_collector::serve_with_http(listener, http, config, shutdown)
            .await
            .with_context(|| format!("collector writing to {} failed", args.out))?;
        say(format_args!(
            "rankscope collector stopped: {} streams, {} batches ({} duplicates dropped, {} refused), {} rows in {} files",
            summary.streams, summary.batches, summary.duplicates, summary.refused, summary.rows, summary.files
        ));
        Ok(())
    })
}

/// Prints a line on stdout. A stdout nobody reads any more (a closed pipe) is no
/// reason for a collector to stop: the line is then dropped (`println!` would
/// panic).
fn say(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = out
        .write_fmt(line)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
}

/// Takes over SIGTERM and Ctrl-C at once (so that a signal arriving while the
/// collector starts up drains it instead of killing it) and resolves on either.
/// Must be called inside the runtime.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
    async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        match term {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
        #[cfg(not(unix))]
        let _ = ctrl_c.await;
        tracing::info!("shutdown requested");
    }
}
