//! Harness for the end-to-end tests: starts the real `rankscope` binary, and
//! queries its output with the real DuckDB CLI.
//!
//! Layout:
//! - [`bin`]: where the built binaries and the venv's tools are;
//! - [`CollectorProc`]: a collector process on 127.0.0.1:0 with its own directory
//!   (or in a network namespace of [`netns`]);
//! - [`RawStream`], [`hello`], [`batch`]: the protocol spoken by hand, as an agent
//!   would (or as a broken one would);
//! - [`duckdb`]: queries run through the `duckdb` command;
//! - [`training`]: real training ranks (`rankscope train`, `rankscope launch`,
//!   the Python package's DDP example under the real `torchrun`) and the
//!   exact-count checks of what they sent;
//! - [`netns`]: "nodes" in network namespaces joined by veth links (root only);
//! - [`hostile`]: what the hostile-input tests share (hand-built frames, a raw
//!   HTTP/2 call, the bystander stream).

pub mod hostile;
pub mod netns;
pub mod training;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rankscope_proto::v1::agent_message::Kind as AgentKind;
use rankscope_proto::v1::collector_client::CollectorClient;
use rankscope_proto::v1::collector_message::Kind as CollectorKind;
use rankscope_proto::v1::{AgentMessage, Batch, CollectorMessage, Hello, StepRow};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// A binary built next to the running test (`target/<profile>/<name>`).
/// A free loopback port (bound, noted, released), for a collector restarted on
/// the same address.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind a free port")
        .local_addr()
        .expect("local address")
        .port()
}

/// Pseudo-random milliseconds in `lo..hi`, from the clock: fault tests print the
/// moments they chose, so a failure names the moment that caused it.
pub fn random_ms(lo: u64, hi: u64) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos() as u64);
    let mut x = nanos ^ 0x9e37_79b9_7f4a_7c15;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    lo + x % (hi - lo)
}

/// The spill root of this test process's ranks: fresh, so batches a failed earlier
/// test run left behind under the same run id are never replayed into this one.
pub fn spill_dir() -> &'static Path {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("spill tempdir"))
        .path()
}

pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built: run `make test` (or `cargo build --workspace --bins` first)",
        path.display()
    );
    path
}

/// Every file under `dir`, recursively.
pub fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// A tool of the project venv (`duckdb`, `torchrun`), or from PATH.
pub fn tool(name: &str) -> PathBuf {
    let venv = workspace().join(".venv/bin").join(name);
    if venv.exists() {
        venv
    } else {
        PathBuf::from(name)
    }
}

/// `program ARGS... INNER_PROGRAM INNER_ARGS...` with `inner`'s environment and
/// working directory: `inner` run under a wrapper (`rankscope launch`, `ip netns
/// exec`).
pub fn wrapped(program: impl AsRef<std::ffi::OsStr>, args: &[&str], inner: &Command) -> Command {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .arg(inner.get_program())
        .args(inner.get_args());
    for (key, value) in inner.get_envs() {
        match value {
            Some(value) => cmd.env(key, value),
            None => cmd.env_remove(key),
        };
    }
    if let Some(dir) = inner.get_current_dir() {
        cmd.current_dir(dir);
    }
    cmd
}

/// A collector process on 127.0.0.1 with a port of its own.
pub struct CollectorProc {
    pub addr: String,
    /// The `--http` ops address (`127.0.0.1:PORT`), when started with `--http`.
    pub http: Option<String>,
    pub out: PathBuf,
    child: Child,
    /// Where its stderr (the log) goes, when captured.
    log: Option<PathBuf>,
    /// The last line it printed on stdout, once stdout closes.
    last_line: Option<std::thread::JoinHandle<Option<String>>>,
}

impl CollectorProc {
    /// Starts `rankscope collector --listen 127.0.0.1:0 --out OUT ARGS...`.
    pub fn start(out: &Path, args: &[&str]) -> CollectorProc {
        Self::start_on("127.0.0.1:0", out, args)
    }

    /// Starts the collector on a given address (for restarts on the same port).
    pub fn start_on(listen: &str, out: &Path, args: &[&str]) -> CollectorProc {
        Self::spawn(listen, out, args, None, None, &[])
    }

    /// Starts the collector on a given address with more environment variables
    /// (the `AWS_*` of an S3 output).
    pub fn start_with_env(
        listen: &str,
        out: &Path,
        args: &[&str],
        env: &[(String, String)],
    ) -> CollectorProc {
        Self::spawn(listen, out, args, None, None, env)
    }

    /// Starts the collector with its log (stderr, `warn` and up) written to `log`,
    /// for tests that check what it says; see [`CollectorProc::log`].
    pub fn start_logged(out: &Path, args: &[&str], log: &Path) -> CollectorProc {
        Self::spawn("127.0.0.1:0", out, args, Some(log), None, &[])
    }

    /// Starts the collector inside network namespace `netns` (see [`netns`]);
    /// `addr` is then the address it printed (`0.0.0.0:PORT` for `0.0.0.0:0`).
    pub fn start_in_netns(netns: &str, listen: &str, out: &Path, args: &[&str]) -> CollectorProc {
        Self::spawn(listen, out, args, None, Some(netns), &[])
    }

    fn spawn(
        listen: &str,
        out: &Path,
        args: &[&str],
        log: Option<&Path>,
        netns: Option<&str>,
        env: &[(String, String)],
    ) -> CollectorProc {
        let stderr = match log {
            Some(path) => Stdio::from(std::fs::File::create(path).expect("create the log file")),
            None => Stdio::inherit(),
        };
        let mut cmd = Command::new(bin("rankscope"));
        cmd.args(["collector", "--listen", listen, "--out"])
            .arg(out)
            .args(args)
            .env("RANKSCOPE_LOG", "warn")
            .envs(env.iter().map(|(k, v)| (k, v)));
        if let Some(netns) = netns {
            cmd = netns::Star::exec_in(netns, &cmd);
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("start rankscope collector");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut lines = BufReader::new(stdout).lines();
        let first = lines
            .next()
            .expect("collector printed its address")
            .expect("utf-8");
        let addr = first
            .split_whitespace()
            .map(|w| w.trim_end_matches(','))
            .find(|w| w.parse::<std::net::SocketAddr>().is_ok())
            .unwrap_or_else(|| panic!("no address in {first:?}"))
            .to_string();
        // With --http, the second line names the ops address.
        let http = args.contains(&"--http").then(|| {
            let line = lines
                .next()
                .expect("collector printed its ops address")
                .expect("utf-8");
            line.split_whitespace()
                .find_map(|w| w.strip_prefix("http://"))
                .unwrap_or_else(|| panic!("no http:// address in {line:?}"))
                .to_string()
        });
        // Keep draining stdout so the collector never blocks on a full pipe; keep
        // the last line (its summary, once it stopped).
        let last_line = std::thread::spawn(move || lines.map_while(Result::ok).last());
        CollectorProc {
            addr,
            http,
            out: out.to_path_buf(),
            child,
            log: log.map(Path::to_path_buf),
            last_line: Some(last_line),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// What it logged so far (empty unless started with [`CollectorProc::start_logged`]).
    pub fn log(&self) -> String {
        self.log
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    }

    /// SIGTERM, then waits for exit; returns whether it exited 0.
    pub fn stop(mut self) -> bool {
        signal(self.child.id(), "TERM");
        wait_for(&mut self.child, Duration::from_secs(60))
    }

    /// SIGTERM, then waits for exit; returns the summary it printed last
    /// ("rankscope collector stopped: N streams, M batches (D duplicates dropped,
    /// ...") if it exited 0.
    pub fn stop_with_summary(mut self) -> Option<String> {
        signal(self.child.id(), "TERM");
        let ok = wait_for(&mut self.child, Duration::from_secs(60));
        let last = self.last_line.take().and_then(|t| t.join().ok()).flatten();
        last.filter(|_| ok)
    }

    /// SIGKILL: a crash.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for CollectorProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends a signal by name to a process.
pub fn signal(pid: u32, name: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status();
}

/// Sends a signal by name to every process of process group `pgid`.
pub fn signal_group(pgid: u32, name: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{name}"))
        .arg("--")
        .arg(format!("-{pgid}"))
        .status();
}

fn wait_for(child: &mut Child, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Ok(Some(status)) = child.try_wait() {
            return status.success();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    false
}

/// The headless browser the page tests drive (Debian's chromium, which `make test`
/// installs).
pub fn chromium() -> PathBuf {
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        if let Ok(out) = Command::new("sh")
            .args(["-c", &format!("command -v {name}")])
            .output()
            && out.status.success()
        {
            return PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        }
    }
    panic!(
        "no headless browser: `make test` installs Debian's chromium package (apt-get install chromium)"
    );
}

/// Runs `sql` in the DuckDB CLI and returns its CSV output without header.
pub fn duckdb(sql: &str) -> String {
    let output = Command::new(tool("duckdb"))
        .args(["-csv", "-noheader", "-c", sql])
        .output()
        .expect("run the duckdb CLI (make setup installs it)");
    assert!(
        output.status.success(),
        "duckdb failed on {sql}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("utf-8")
}

/// `read_parquet(...)` of one table of an output directory.
pub fn table(out: &Path, name: &str) -> String {
    format!(
        "read_parquet('{}/{name}/*/*.parquet', hive_partitioning=true, union_by_name=true)",
        out.display()
    )
}

/// `select count(*)` of a table, with an optional `where` clause.
pub fn count(out: &Path, name: &str, filter: &str) -> u64 {
    let filter = if filter.is_empty() {
        String::new()
    } else {
        format!(" where {filter}")
    };
    duckdb(&format!(
        "select count(*) from {}{filter}",
        table(out, name)
    ))
    .trim()
    .parse()
    .expect("a count")
}

/// Rows of `select rank, count(*) ... group by rank order by rank`.
pub fn count_by_rank(out: &Path, name: &str) -> Vec<(u32, u64)> {
    duckdb(&format!(
        "select rank, count(*) from {} group by rank order by rank",
        table(out, name)
    ))
    .lines()
    .map(|l| {
        let (r, c) = l.split_once(',').expect("rank,count");
        (r.parse().expect("rank"), c.parse().expect("count"))
    })
    .collect()
}

/// Runs the real binary with arguments; panics with its output on failure.
pub fn rankscope(args: &[&str]) -> String {
    let output = Command::new(bin("rankscope"))
        .args(args)
        .env("RANKSCOPE_LOG", "warn")
        .env("RANKSCOPE_SPILL_DIR", spill_dir())
        // Tests count layer rows exactly: every planned sample must be taken, which
        // the default 2 % overhead budget does not promise.
        .env("RANKSCOPE_OVERHEAD_BUDGET", "100%")
        .output()
        .expect("run rankscope");
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "rankscope {args:?} failed:\n{text}"
    );
    text
}

/// A Hello of rank `rank` of a 4-rank run, as an agent sends it.
pub fn hello(run_id: &str, rank: u32) -> Hello {
    Hello {
        run_id: run_id.into(),
        rank,
        world_size: 4,
        hostname: "test".into(),
        schema_major: rankscope_proto::SCHEMA_MAJOR,
        agent_version: "test".into(),
        ..Default::default()
    }
}

/// Batch `seq` with `steps` step rows, numbered `seq * 1000 + i`.
pub fn batch(seq: u64, steps: u64, is_final: bool) -> Batch {
    Batch {
        seq,
        r#final: is_final,
        steps: (0..steps)
            .map(|i| StepRow {
                step: seq * 1000 + i,
                step_ms: 1.0,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// Collector arguments that make commits (and so acks) quick.
pub const FAST_COMMITS: [&str; 2] = ["--max-file-age", "100ms"];

/// How long a test waits for any one answer from the collector.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// A raw protocol stream, opened by hand as an agent would open it.
pub struct RawStream {
    tx: mpsc::Sender<AgentMessage>,
    inbound: Streaming<CollectorMessage>,
}

/// Opens a stream with `hello`; returns it and the Welcome's durable seq.
pub async fn open(addr: &str, hello: Hello) -> Result<(RawStream, u64), Status> {
    open_with(
        addr,
        AgentMessage {
            kind: Some(AgentKind::Hello(hello)),
        },
    )
    .await
}

/// Opens a stream whose first message is `first` (a Hello, or anything else).
pub async fn open_with(addr: &str, first: AgentMessage) -> Result<(RawStream, u64), Status> {
    let mut client = CollectorClient::connect(format!("http://{addr}"))
        .await
        .expect("connect")
        .max_encoding_message_size(64 * 1024 * 1024);
    let (tx, rx) = mpsc::channel(64);
    tx.send(first).await.expect("queue the first message");
    let call = client.stream(ReceiverStream::new(rx));
    let mut inbound = tokio::time::timeout(ANSWER_TIMEOUT, call)
        .await
        .expect("the collector answers a new stream within 30 s")?
        .into_inner();
    match tokio::time::timeout(ANSWER_TIMEOUT, inbound.message())
        .await
        .expect("a Welcome within 30 s")?
    {
        Some(CollectorMessage {
            kind: Some(CollectorKind::Welcome(w)),
        }) => Ok((RawStream { tx, inbound }, w.durable_seq)),
        other => panic!("expected a Welcome, got {other:?}"),
    }
}

impl RawStream {
    /// Sends one batch.
    pub async fn send(&self, batch: Batch) {
        self.send_message(AgentMessage {
            kind: Some(AgentKind::Batch(batch)),
        })
        .await;
    }

    /// Sends any message (a second Hello, an empty one).
    pub async fn send_message(&self, message: AgentMessage) {
        self.tx.send(message).await.expect("stream open");
    }

    /// Waits for an ack of at least `seq`.
    pub async fn acked(&mut self, seq: u64) -> u64 {
        loop {
            let message = tokio::time::timeout(ANSWER_TIMEOUT, self.inbound.message())
                .await
                .expect("an ack within 30 s")
                .expect("stream ok");
            if let Some(CollectorMessage {
                kind: Some(CollectorKind::Ack(ack)),
            }) = message
                && ack.durable_seq >= seq
            {
                return ack.durable_seq;
            }
        }
    }

    /// The status that ends the stream.
    pub async fn error(&mut self) -> Status {
        loop {
            match tokio::time::timeout(ANSWER_TIMEOUT, self.inbound.message())
                .await
                .expect("an answer within 30 s")
            {
                Err(status) => return status,
                Ok(None) => panic!("stream ended without an error"),
                Ok(Some(_)) => {}
            }
        }
    }

    /// Waits up to `wait` for an ack; `None` if none came (the stream stays open).
    pub async fn ack_within(&mut self, wait: Duration) -> Option<u64> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let message = tokio::time::timeout_at(deadline, self.inbound.message())
                .await
                .ok()?
                .expect("stream ok");
            if let Some(CollectorMessage {
                kind: Some(CollectorKind::Ack(ack)),
            }) = message
            {
                return Some(ack.durable_seq);
            }
        }
    }
}
