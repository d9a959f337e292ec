//! Measurements, not checks: the collector's resident memory under senders that
//! start messages and do not finish them, the figures RELIABILITY.md quotes. Each
//! test is `#[ignore]`d (they take minutes and their figures are for a release
//! build); run one with
//!
//! ```sh
//! cargo build --release -p rankscope --no-default-features
//! cargo test -p rankscope-tests --test slow_senders -- --ignored --nocapture flood
//! ```
//!
//! `RANKSCOPE_MEASURE_BIN` names the collector binary to measure (by default the
//! release build, `target/release/rankscope`), so two builds can be measured side
//! by side. Every client here speaks raw HTTP/2 (h2), so nothing on the client
//! side hides or finishes what it sends.
//!
//! - `flood`: 48 streams each send a Hello, then 16 MiB − 2 bytes of a
//!   16 MiB − 1 message, and then wait (answering keepalive pings);
//! - `slow`: 4,096 streams each send a Hello, then the prefix of a
//!   16 MiB − 1 message, then dribble its bytes (`RANKSCOPE_MEASURE_RATE` bytes a
//!   second each, 16 by default);
//! - `idle`: 4,096 streams each send a Hello and nothing else (what an open
//!   stream costs);
//! - `drops`: streams dropped by gRPC clients, then reset by raw ones with each
//!   HTTP/2 reason, and what `refused_total` counts them as.
//!
//! `RANKSCOPE_MEASURE_SECS` (45) is how long the streams are held,
//! `RANKSCOPE_MEASURE_STREAMS` how many (`slow`, `idle`: 4,096; `drops`: 200),
//! and `RANKSCOPE_MEASURE_ARGS` adds collector flags (`--max-memory-bytes N`).
//! Each prints the collector's resident memory before, its peak (`VmHWM`) and at
//! the end, and the collector's own figures from `/metrics`. The file descriptor
//! limit must allow the streams twice over (test and collector; 4,096 each).

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use prost::Message;
use rankscope_proto::v1::AgentMessage;
use rankscope_proto::v1::agent_message::Kind as AgentKind;
use rankscope_tests::hostile::{RawRequest, raw_request};
use rankscope_tests::{hello, workspace};
use tokio::task::JoinHandle;
use tonic::Status;

/// The collector binary measured (a relative path is taken from the workspace).
fn collector_bin() -> PathBuf {
    std::env::var_os("RANKSCOPE_MEASURE_BIN")
        .map(|p| workspace().join(p))
        .unwrap_or_else(|| workspace().join("target/release/rankscope"))
}

struct Collector {
    child: Child,
    addr: String,
    http: String,
}

impl Collector {
    fn start(out: &Path, args: &[&str]) -> Collector {
        let bin = collector_bin();
        assert!(bin.exists(), "{} is not built", bin.display());
        let mut child = Command::new(&bin)
            .args([
                "collector",
                "--listen",
                "127.0.0.1:0",
                "--http",
                "127.0.0.1:0",
            ])
            .arg("--out")
            .arg(out)
            .args(args)
            .env("RANKSCOPE_LOG", "warn")
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the collector");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let mut next = || lines.next().expect("a line").expect("utf-8");
        let first = next();
        let addr = first
            .split_whitespace()
            .map(|w| w.trim_end_matches(','))
            .find(|w| w.parse::<std::net::SocketAddr>().is_ok())
            .expect("an address")
            .to_string();
        let second = next();
        let http = second
            .split_whitespace()
            .find_map(|w| w.strip_prefix("http://"))
            .expect("an ops address")
            .to_string();
        std::thread::spawn(move || lines.map_while(Result::ok).for_each(drop));
        eprintln!("measuring {} (pid {})", bin.display(), child.id());
        Collector { child, addr, http }
    }

    /// (resident, peak resident) bytes.
    fn rss(&self) -> (u64, u64) {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).expect("procfs");
        let field = |name: &str| -> u64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .expect("a field")
        };
        (field("VmRSS:") * 1024, field("VmHWM:") * 1024)
    }

    /// The `/metrics` lines of the memory bound, the streams and refusals.
    fn figures(&self) -> String {
        let mut tcp = std::net::TcpStream::connect(&self.http).expect("connect /metrics");
        write!(
            tcp,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut text = String::new();
        tcp.read_to_string(&mut text).unwrap();
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| {
                [
                    "open_streams",
                    "stream_memory",
                    "memory_limit",
                    "buffer_limit",
                    "decode_room",
                    "unfinished",
                    "message_timeout",
                    "refused_total",
                ]
                .iter()
                .any(|k| l.contains(k))
            })
            .filter(|l| !l.ends_with(" 0"))
            .map(|l| format!("  {}\n", l.trim_start_matches("rankscope_collector_")))
            .collect()
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// One gRPC frame prefix: no compression, big-endian length.
fn prefix(len: u32) -> Vec<u8> {
    let mut p = vec![0];
    p.extend_from_slice(&len.to_be_bytes());
    p
}

/// A raw stream: its sending half, and the task that reads the collector's
/// answers and returns the status that ends the call.
struct Raw {
    send: Option<h2::SendStream<Bytes>>,
    answer: JoinHandle<Option<Status>>,
    _client: h2::client::SendRequest<Bytes>,
}

/// Opens a stream on a connection of its own and sends a Hello.
async fn open_raw(addr: &str, run_id: &str, rank: u32) -> Raw {
    let RawRequest {
        client,
        response,
        mut send,
        ..
    } = raw_request(addr, false).await;
    let mut hello = hello(run_id, rank);
    hello.world_size = 1 << 20;
    let hello = AgentMessage {
        kind: Some(AgentKind::Hello(hello)),
    }
    .encode_to_vec();
    let mut frame = prefix(hello.len() as u32);
    frame.extend_from_slice(&hello);
    send.send_data(Bytes::from(frame), false).expect("hello");
    let answer = tokio::spawn(async move {
        let response = response.await.ok()?;
        let (parts, mut body) = response.into_parts();
        if let Some(status) = Status::from_header_map(&parts.headers) {
            return Some(status);
        }
        while let Some(chunk) = body.data().await {
            let chunk = chunk.ok()?;
            let _ = body.flow_control().release_capacity(chunk.len());
        }
        let trailers = body.trailers().await.ok()??;
        Status::from_header_map(&trailers)
    });
    Raw {
        send: Some(send),
        answer,
        _client: client,
    }
}

/// Samples the collector's RSS until `until`, printing a line every `every`.
async fn watch(collector: &Collector, until: Instant, every: Duration, start: Instant) {
    while Instant::now() < until {
        tokio::time::sleep(every).await;
        let (rss, peak) = collector.rss();
        eprintln!(
            "  t={:5.1}s rss {:7.1} MiB, peak {:7.1} MiB",
            start.elapsed().as_secs_f64(),
            mib(rss),
            mib(peak)
        );
    }
}

/// How the streams ended so far: (still open, ended by code).
fn endings(raws: &[Raw]) -> String {
    let open = raws.iter().filter(|r| !r.answer.is_finished()).count();
    format!("{open} of {} streams still open", raws.len())
}

async fn report(collector: &Collector, raws: Vec<Raw>, before: u64) {
    let (rss, peak) = collector.rss();
    eprintln!(
        "RESULT rss before {:.1} MiB, peak {:.1} MiB (+{:.1}), at the end {:.1} MiB; {}",
        mib(before),
        mib(peak),
        mib(peak.saturating_sub(before)),
        mib(rss),
        endings(&raws)
    );
    eprint!("{}", collector.figures());
    let mut codes = std::collections::BTreeMap::new();
    for raw in raws {
        if raw.answer.is_finished() {
            let status = raw.answer.await.ok().flatten();
            let key = status.map_or("no status".to_string(), |s| {
                format!("{:?}: {}", s.code(), s.message())
            });
            *codes.entry(key).or_insert(0) += 1;
        }
    }
    for (status, n) in codes {
        eprintln!("  {n} ended with {status}");
    }
}

/// How long to keep the streams waiting (`RANKSCOPE_MEASURE_SECS`, 45 by default).
fn hold_for() -> Duration {
    Duration::from_secs(env_or("RANKSCOPE_MEASURE_SECS", 45))
}

fn extra_args() -> Vec<String> {
    std::env::var("RANKSCOPE_MEASURE_ARGS")
        .map(|a| a.split_whitespace().map(String::from).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: minutes, against a release build"]
async fn flood() {
    let dir = tempfile::tempdir().unwrap();
    let args = extra_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let collector = Collector::start(dir.path(), &args);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (before, _) = collector.rss();
    let start = Instant::now();
    let declared = (16 << 20) - 1u32;
    let mut raws = Vec::new();
    for rank in 0..48 {
        let mut raw = open_raw(&collector.addr, "flood", rank).await;
        let mut message = prefix(declared);
        message.resize(5 + declared as usize - 1, 0x5a);
        let send = raw.send.as_mut().expect("a send half");
        send.send_data(Bytes::from(message), false).unwrap();
        raws.push(raw);
    }
    eprintln!("48 streams opened in {:?}", start.elapsed());
    watch(
        &collector,
        start + hold_for(),
        Duration::from_secs(3),
        start,
    )
    .await;
    report(&collector, raws, before).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: minutes, against a release build"]
async fn slow() {
    let dir = tempfile::tempdir().unwrap();
    let args = extra_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let collector = Collector::start(dir.path(), &args);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (before, _) = collector.rss();
    let streams = env_or("RANKSCOPE_MEASURE_STREAMS", 4096);
    let rate = env_or("RANKSCOPE_MEASURE_RATE", 16) as usize;
    let start = Instant::now();
    let stop = start + hold_for();
    let declared = (16 << 20) - 1u32;
    let mut raws = Vec::new();
    let mut dribblers = Vec::new();
    for rank in 0..streams as u32 {
        let mut raw = open_raw(&collector.addr, "slow", rank).await;
        let mut send = raw.send.take().expect("a send half");
        send.send_data(Bytes::from(prefix(declared)), false)
            .unwrap();
        // Each stream sends `rate` bytes a second, the streams spread over the second.
        let offset = Duration::from_micros(u64::from(rank) * 1_000_000 / streams);
        dribblers.push(tokio::spawn(async move {
            tokio::time::sleep(offset).await;
            let mut sent = 0usize;
            while Instant::now() < stop && sent + rate < declared as usize {
                if send
                    .send_data(Bytes::from(vec![0x5a; rate]), false)
                    .is_err()
                {
                    break;
                }
                sent += rate;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            send
        }));
        raws.push(raw);
    }
    eprintln!("{streams} streams opened in {:?}", start.elapsed());
    watch(&collector, stop, Duration::from_secs(5), start).await;
    report(&collector, raws, before).await;
    drop(dribblers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: minutes, against a release build"]
async fn idle() {
    let dir = tempfile::tempdir().unwrap();
    let args = extra_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let collector = Collector::start(dir.path(), &args);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (before, _) = collector.rss();
    let streams = env_or("RANKSCOPE_MEASURE_STREAMS", 4096);
    let start = Instant::now();
    let mut raws = Vec::new();
    for rank in 0..streams as u32 {
        raws.push(open_raw(&collector.addr, "idle", rank).await);
    }
    eprintln!("{streams} streams opened in {:?}", start.elapsed());
    watch(
        &collector,
        start + hold_for(),
        Duration::from_secs(5),
        start,
    )
    .await;
    report(&collector, raws, before).await;
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: what dropped streams are counted as"]
async fn drops() {
    let dir = tempfile::tempdir().unwrap();
    let collector = Collector::start(dir.path(), &[]);
    let streams = env_or("RANKSCOPE_MEASURE_STREAMS", 200);
    let mut open = Vec::new();
    for rank in 0..streams as u32 {
        let (stream, _) = rankscope_tests::open(&collector.addr, hello("drops", rank % 4))
            .await
            .expect("opens");
        open.push(stream);
    }
    drop(open);
    // Raw streams reset by the client with each reason, after their Welcome.
    for reason in [
        h2::Reason::CANCEL,
        h2::Reason::NO_ERROR,
        h2::Reason::INTERNAL_ERROR,
        h2::Reason::PROTOCOL_ERROR,
    ] {
        for rank in 0..10 {
            let mut raw = open_raw(&collector.addr, "drops", rank).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
            raw.send.as_mut().expect("a send half").send_reset(reason);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        eprintln!("after 10 resets with {reason:?}:");
        eprint!("{}", collector.figures());
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    eprint!("{}", collector.figures());
}
