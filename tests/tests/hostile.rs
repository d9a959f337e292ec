//! Hostile input against the real collector binary on 127.0.0.1:0: bytes that
//! are not protobuf, batches that break the limits, odd sequence numbers, odd
//! floats and labels, path-like run ids, too many streams, messages begun and
//! never finished, streams dropped without a word. (A hostile disk is in
//! `disk.rs`; the memory figures of RELIABILITY.md come from `slow_senders.rs`.)
//!
//! Each refusal must carry a clear status and message, end only its own stream,
//! and leave the collector serving: a well-formed "bystander" stream open across
//! the test still lands every row, checked with the real DuckDB CLI.

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use prost::Message;
use rankscope_proto::v1::agent_message::Kind as AgentKind;
use rankscope_proto::v1::{AgentMessage, Batch, EventRow, LayerRow, StepRow};
use rankscope_tests::{
    ANSWER_TIMEOUT, CollectorProc, FAST_COMMITS as FAST, RawStream, batch, count, duckdb, hello,
    open, open_with, rankscope, table,
};
use tonic::{Code, Status};

fn hello_message(run_id: &str, rank: u32) -> AgentMessage {
    AgentMessage {
        kind: Some(AgentKind::Hello(hello(run_id, rank))),
    }
}

fn batch_message(b: Batch) -> AgentMessage {
    AgentMessage {
        kind: Some(AgentKind::Batch(b)),
    }
}

/// A well-formed stream that keeps sending while hostile ones come and go.
struct Bystander {
    stream: RawStream,
    seq: u64,
}

impl Bystander {
    const ROWS: u64 = 5;

    async fn open(addr: &str) -> Bystander {
        let (stream, _) = open(addr, hello("bystander", 0)).await.expect("opens");
        Bystander { stream, seq: 0 }
    }

    /// Sends one more batch and waits until it is durable.
    async fn lands_a_batch(&mut self) {
        self.seq += 1;
        self.stream.send(batch(self.seq, Self::ROWS, false)).await;
        assert_eq!(self.stream.acked(self.seq).await, self.seq);
    }

    /// Rows it has had acknowledged.
    fn rows(&self) -> u64 {
        self.seq * Self::ROWS
    }
}

/// Checks, after the collector stopped, that the bystander's rows are all there once.
fn bystander_landed(out: &Path, rows: u64) {
    assert_eq!(count(out, "steps", "run_id = 'bystander'"), rows);
    let dups = duckdb(&format!(
        "select count(*) from (select step from {} where run_id = 'bystander' group by step having count(*) > 1)",
        table(out, "steps")
    ));
    assert_eq!(dups.trim(), "0");
}

/// One gRPC frame: compression flag, big-endian length, payload.
fn frame(flag: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![flag];
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// Sends `body` as the whole request of one `Collector/Stream` call over a raw
/// HTTP/2 connection (no gRPC library on the client side), and returns the status
/// the collector ends the call with.
async fn raw_call(addr: &str, body: Vec<u8>) -> Status {
    tokio::time::timeout(ANSWER_TIMEOUT, async {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (client, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
        tokio::spawn(connection);
        let mut client = client.ready().await.expect("h2 ready");
        let request = http::Request::builder()
            .method("POST")
            .uri(format!("http://{addr}/rankscope.v1.Collector/Stream"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .expect("request");
        let (response, mut send) = client
            .send_request(request, body.is_empty())
            .expect("send headers");
        if !body.is_empty() {
            send.send_data(Bytes::from(body), true).expect("send body");
        }
        let response = response.await.expect("response headers");
        let (parts, mut body) = response.into_parts();
        if let Some(status) = Status::from_header_map(&parts.headers) {
            return status; // a trailers-only answer
        }
        while let Some(chunk) = body.data().await {
            let chunk = chunk.expect("response body");
            let _ = body.flow_control().release_capacity(chunk.len());
        }
        let trailers = body.trailers().await.expect("trailers").expect("some");
        Status::from_header_map(&trailers).expect("a grpc-status trailer")
    })
    .await
    .expect("the collector answers a raw call within 30 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_bytes_are_refused_with_invalid_argument() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &FAST);
    let addr = collector.addr.clone();
    let mut bystander = Bystander::open(&addr).await;
    bystander.lands_a_batch().await;

    let hello_frame = frame(0, &hello_message("raw", 0).encode_to_vec());
    let garbage = b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff this is not protobuf".to_vec();
    let after_hello = |bytes: Vec<u8>| [hello_frame.clone(), bytes].concat();
    let good_batch = batch_message(batch(1, 3, false)).encode_to_vec();
    let cases: Vec<(&str, Vec<u8>, Code, &str)> = vec![
        (
            "garbage instead of a Hello",
            frame(0, &garbage),
            Code::InvalidArgument,
            "malformed message from the agent",
        ),
        (
            "garbage after a valid Hello",
            after_hello(frame(0, &garbage)),
            Code::InvalidArgument,
            "malformed message from the agent",
        ),
        (
            "a protobuf of another message (a Welcome) after a valid Hello",
            after_hello(frame(0, &[0x08, 0x05, 0x12, 0x01, b'x'])),
            Code::InvalidArgument,
            "malformed message from the agent",
        ),
        (
            "a batch cut short mid-frame",
            after_hello(frame(0, &good_batch)[..good_batch.len() / 2].to_vec()),
            Code::InvalidArgument,
            "malformed message from the agent",
        ),
        (
            "a compressed flag without a grpc-encoding",
            after_hello(frame(1, &good_batch)),
            Code::InvalidArgument,
            "compressed-flag",
        ),
        (
            "an unknown compression flag",
            after_hello(frame(7, &good_batch)),
            Code::InvalidArgument,
            "invalid compression flag",
        ),
        (
            "a length prefix of 4 GiB",
            after_hello(vec![0, 0xff, 0xff, 0xff, 0xff, 1, 2, 3]),
            Code::OutOfRange,
            "message length too large",
        ),
        (
            "an empty AgentMessage first",
            frame(0, &[]),
            Code::InvalidArgument,
            "first message of a stream must be a Hello",
        ),
        (
            "no message at all",
            Vec::new(),
            Code::InvalidArgument,
            "first message of a stream must be a Hello",
        ),
    ];
    for (what, body, code, says) in cases {
        let status = raw_call(&addr, body).await;
        assert_eq!(status.code(), code, "{what}: {status:?}");
        assert!(status.message().contains(says), "{what}: {status:?}");
        bystander.lands_a_batch().await;
    }

    // The raw client itself is sound: a valid Hello and batch over it land.
    let status = raw_call(
        &addr,
        after_hello(frame(0, &batch_message(batch(1, 3, true)).encode_to_vec())),
    )
    .await;
    assert_eq!(status.code(), Code::Ok, "{status:?}");

    // Many hostile calls at once, beside the bystander.
    let storm: Vec<_> = (0..32u8)
        .map(|i| {
            let addr = addr.clone();
            let body = after_hello(frame(0, &[i, 0xff, i.wrapping_mul(37), 0x80]));
            tokio::spawn(async move { raw_call(&addr, body).await })
        })
        .collect();
    bystander.lands_a_batch().await;
    for call in storm {
        let status = call.await.unwrap();
        assert_ne!(status.code(), Code::Ok, "{status:?}");
    }
    bystander.lands_a_batch().await;

    let rows = bystander.rows();
    drop(bystander);
    assert!(collector.stop(), "the collector exits 0 after all that");
    bystander_landed(dir.path(), rows);
    assert_eq!(count(dir.path(), "steps", "run_id = 'raw'"), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_breaking_the_protocol_or_limits_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &FAST);
    let addr = collector.addr.clone();
    let mut bystander = Bystander::open(&addr).await;
    bystander.lands_a_batch().await;

    let long_layer = |len: usize| {
        let mut b = batch(1, 0, false);
        b.layers.push(LayerRow {
            layer: "x".repeat(len),
            ..Default::default()
        });
        b
    };
    let mut long_event = batch(1, 0, false);
    long_event.events.push(EventRow {
        kind: "note".into(),
        message: "m".repeat(4097),
        ..Default::default()
    });
    // Over the rows limit, far under the 16 MiB message limit (about 1.4 MiB).
    let too_many_rows = batch(1, 100_001, false);
    assert!(too_many_rows.encoded_len() < 2 * 1024 * 1024);
    let cases: Vec<(&str, Vec<Batch>, &str)> = vec![
        (
            "100,001 rows in one batch",
            vec![too_many_rows],
            "batch of 100001 rows is too large (at most 100000)",
        ),
        ("seq 0", vec![batch(0, 1, false)], "seq must start at 1"),
        (
            "a seq jump past the limit",
            vec![batch(1, 1, false), batch(1_000_000_002, 1, false)],
            "jumps more than 1000000000 past the last accepted seq 1",
        ),
        (
            "a 257-byte layer name",
            vec![long_layer(257)],
            "layer of 257 bytes is too long (at most 256)",
        ),
        (
            "a 4097-byte event message",
            vec![long_event],
            "message of 4097 bytes is too long (at most 4096)",
        ),
    ];
    for (n, (what, batches, says)) in cases.into_iter().enumerate() {
        let (mut stream, _) = open(&addr, hello(&format!("limits-{n}"), 0)).await.unwrap();
        for b in batches {
            stream.send(b).await;
        }
        let status = stream.error().await;
        assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
        assert!(status.message().contains(says), "{what}: {status:?}");
        bystander.lands_a_batch().await;
    }

    // A stream that opens with a Batch, or sends a second Hello.
    let status = open_with(&addr, batch_message(batch(1, 1, false)))
        .await
        .err()
        .expect("a Batch first is refused");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status
            .message()
            .contains("first message of a stream must be a Hello"),
        "{status:?}"
    );
    let (mut twice, _) = open(&addr, hello("twice", 0)).await.unwrap();
    twice.send(batch(1, 4, false)).await;
    twice.send_message(hello_message("twice", 0)).await;
    let status = twice.error().await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status
            .message()
            .contains("a stream carries one Hello, first"),
        "{status:?}"
    );
    bystander.lands_a_batch().await;

    // At the limits exactly, everything is accepted.
    let (mut edge, _) = open(&addr, hello("edge", 0)).await.unwrap();
    edge.send(batch(1, 100_000, false)).await;
    let mut b = long_layer(256);
    b.seq = 1_000_000_001;
    // The largest jump, declared as batches the agent dropped (acks.rs).
    b.dropped_from = 2;
    b.r#final = true;
    edge.send(b).await;
    assert_eq!(edge.acked(1_000_000_001).await, 1_000_000_001);

    let rows = bystander.rows();
    drop((bystander, edge));
    assert!(collector.stop());
    let out = dir.path();
    bystander_landed(out, rows);
    assert_eq!(count(out, "steps", "run_id = 'edge'"), 100_000);
    assert_eq!(count(out, "layers", "run_id = 'edge'"), 1);
    // A refused batch stores nothing; the batch before it on that stream stays.
    assert_eq!(count(out, "steps", "run_id like 'limits-%'"), 1);
    assert_eq!(count(out, "steps", "run_id = 'twice'"), 4);
}

/// Peak resident memory of a process, in bytes (`VmHWM`).
fn peak_rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("procfs");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("a VmHWM line");
    kib * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn millions_of_empty_rows_are_refused_before_they_are_allocated() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &FAST);
    let mut bystander = Bystander::open(&collector.addr).await;
    bystander.lands_a_batch().await;
    let before = peak_rss_bytes(collector.pid());

    // 8 million empty step rows: 2 bytes each on the wire (16 MB, under the
    // 16 MiB message limit), about 240 bytes each once decoded (1.8 GB).
    let rows = 8_000_000usize;
    let mut inner = vec![0x08, 0x01]; // seq = 1
    inner.extend(std::iter::repeat_n([0x1a, 0x00], rows).flatten());
    let mut message = vec![0x12]; // AgentMessage.batch
    let mut len = inner.len();
    while len >= 0x80 {
        message.push(len as u8 | 0x80);
        len >>= 7;
    }
    message.push(len as u8);
    message.extend_from_slice(&inner);
    let hello_frame = frame(0, &hello_message("sparse", 0).encode_to_vec());
    let status = raw_call(&collector.addr, [hello_frame, frame(0, &message)].concat()).await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status
            .message()
            .contains("batch of 8000000 rows is too large (at most 100000)"),
        "{status:?}"
    );
    let grown = peak_rss_bytes(collector.pid()).saturating_sub(before);
    assert!(
        grown < 256 * 1024 * 1024,
        "refusing 16 MB of empty rows raised the collector's peak memory by {grown} bytes"
    );
    bystander.lands_a_batch().await;
    let rows = bystander.rows();
    drop(bystander);
    assert!(collector.stop());
    bystander_landed(dir.path(), rows);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_seqs_are_acknowledged_on_a_new_stream_and_refused_on_the_same_one() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &FAST);
    let (mut stream, _) = open(&collector.addr, hello("reuse", 2)).await.unwrap();
    for seq in [1, 2, 3] {
        stream.send(batch(seq, 10, false)).await;
    }
    assert_eq!(stream.acked(3).await, 3);
    // A seq that does not increase on its stream ends that stream (acks.rs has
    // the rules); nothing of it is stored.
    stream.send(batch(2, 10, false)).await;
    let status = stream.error().await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    // Resent on a new stream after a reconnect: acknowledged, stored once.
    let (mut again, durable) = open(&collector.addr, hello("reuse", 2)).await.unwrap();
    assert_eq!(durable, 3);
    for seq in 1..=4 {
        again.send(batch(seq, 10, seq == 4)).await;
    }
    assert_eq!(again.acked(4).await, 4);
    drop(again);
    assert!(collector.stop());
    let out = dir.path();
    assert_eq!(count(out, "steps", ""), 40);
    let dups = duckdb(&format!(
        "select count(*) from (select step from {} group by step having count(*) > 1)",
        table(out, "steps")
    ));
    assert_eq!(dups.trim(), "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_floats_and_long_unicode_labels_are_stored_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &FAST);
    let floats = [
        f64::NAN,
        -f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        -0.0,
        0.0,
        5e-324, // the smallest subnormal
        f64::MAX,
    ];
    let names = [
        // Exactly 256 bytes: 85 three-byte characters and one ASCII.
        format!("{}a", "层".repeat(85)),
        // Combining marks, a ZWJ emoji sequence, right-to-left text.
        format!("e\u{301}.👩\u{200d}🔬.{}", "مرحبا".repeat(20)),
        "model.blocks.0.attn'; drop table layers; --,\"quoted\"".to_string(),
        "🦀".repeat(64), // 256 bytes of 4-byte characters
    ];
    for name in &names {
        assert!(name.len() <= 256, "{} bytes", name.len());
    }
    let mut b = batch(1, 0, true);
    b.steps = floats
        .iter()
        .enumerate()
        .map(|(i, &x)| StepRow {
            step: i as u64,
            step_ms: x,
            loss: Some(x),
            ..Default::default()
        })
        .collect();
    b.layers = names
        .iter()
        .enumerate()
        .map(|(i, name)| LayerRow {
            step: i as u64,
            layer: name.clone(),
            stable_rank: Some(floats[i]),
            ..Default::default()
        })
        .collect();
    let (mut stream, _) = open(&collector.addr, hello("odd", 0)).await.unwrap();
    stream.send(b).await;
    assert_eq!(stream.acked(1).await, 1);
    drop(stream);
    assert!(collector.stop());

    let out = dir.path();
    // The sign of -0.0 is checked on `loss`, an `optional` field: prost's encoder
    // (the sender's side) drops -0.0 from implicit-presence doubles such as
    // `step_ms`, as if it were the default +0.0 (tokio-rs/prost#1177).
    let counts = duckdb(&format!(
        "select count(*) filter (where isnan(loss)), \
                count(*) filter (where isinf(loss) and loss > 0), \
                count(*) filter (where isinf(loss) and loss < 0), \
                count(*) filter (where loss = 0 and signbit(loss)), \
                count(*) filter (where loss = 0 and not signbit(loss)), \
                count(*) filter (where loss = 5e-324), \
                count(*) filter (where loss = 1.7976931348623157e308), \
                count(*) filter (where isnan(step_ms)), \
                count(*) filter (where isinf(step_ms)) \
         from {}",
        table(out, "steps")
    ));
    assert_eq!(counts.trim(), "2,1,1,1,1,1,1,2,2");
    // Each name, byte for byte, in step order.
    let stored = duckdb(&format!(
        "select hex(layer) from {} order by step",
        table(out, "layers")
    ));
    let expected: Vec<String> = names
        .iter()
        .map(|n| n.bytes().map(|b| format!("{b:02X}")).collect())
        .collect();
    assert_eq!(stored.lines().collect::<Vec<_>>(), expected);
    let ranks = duckdb(&format!(
        "select count(*) filter (where isnan(stable_rank)), count(*) filter (where isinf(stable_rank)) from {}",
        table(out, "layers")
    ));
    assert_eq!(ranks.trim(), "2,2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_like_run_ids_are_refused_and_touch_no_folder() {
    let root = tempfile::tempdir().unwrap();
    let out = root.path().join("out");
    let collector = CollectorProc::start(&out, &FAST);
    let mut bystander = Bystander::open(&collector.addr).await;
    for bad in [
        "..%2f",
        "..%2fetc",
        "%2e%2e",
        "a\\b",
        "..\\..\\x",
        "a\0b",
        "run\0",
        "C:",
        "C:\\Windows",
        "c:/x",
        "run/",
        "./run",
        ".",
        "~root",
        "$HOME",
        "run\n",
        "ｒｕｎ", // full-width letters
        "\u{202e}run",
        "run=1/x",
        "/",
    ] {
        let status = open(&collector.addr, hello(bad, 0))
            .await
            .err()
            .unwrap_or_else(|| panic!("{bad:?} was accepted"));
        assert_eq!(status.code(), Code::InvalidArgument, "{bad:?}");
        assert!(
            status.message().contains("run id") && status.message().contains("is not allowed"),
            "{bad:?}: {status:?}"
        );
    }
    bystander.lands_a_batch().await;
    let rows = bystander.rows();
    drop(bystander);
    assert!(collector.stop());
    // Nothing was created beside the output directory, and inside it only the
    // bystander's run.
    let beside: Vec<_> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(beside, ["out"]);
    let runs: Vec<_> = std::fs::read_dir(out.join("steps"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(runs, ["run_id=bystander"]);
    bystander_landed(&out, rows);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_over_max_streams_is_refused_and_the_others_work() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = FAST.to_vec();
    args.extend(["--max-streams", "2"]);
    let collector = CollectorProc::start(dir.path(), &args);
    let addr = collector.addr.clone();
    let (mut first, _) = open(&addr, hello("slots", 0)).await.unwrap();
    let (mut second, _) = open(&addr, hello("slots", 1)).await.unwrap();
    let status = open(&addr, hello("slots", 2))
        .await
        .err()
        .expect("a third stream is refused");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status
            .message()
            .contains("too many streams: 2 are open (limit 2); raise --max-streams"),
        "{status:?}"
    );
    first.send(batch(1, 5, false)).await;
    second.send(batch(1, 5, false)).await;
    assert_eq!(first.acked(1).await, 1);
    assert_eq!(second.acked(1).await, 1);

    // Refused and malformed streams give their slot back: with one stream open,
    // a second still opens after many failures.
    drop(second);
    for _ in 0..8 {
        raw_call(&addr, frame(0, b"\xff\xff garbage")).await;
        let _ = open(&addr, hello("../x", 0)).await.err().expect("refused");
    }
    let (mut third, _) = within(Duration::from_secs(10), || open(&addr, hello("slots", 2))).await;
    third.send(batch(1, 5, true)).await;
    first.send(batch(2, 5, true)).await;
    assert_eq!(third.acked(1).await, 1);
    assert_eq!(first.acked(2).await, 2);
    drop((first, third));
    assert!(collector.stop());
    assert_eq!(count(dir.path(), "steps", ""), 20);
}

/// Retries `open` until it succeeds or `limit` passes (a closed stream frees its
/// slot shortly after the client goes away).
async fn within<F, Fut>(limit: Duration, open: F) -> (RawStream, u64)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<(RawStream, u64), Status>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match open().await {
            Ok(opened) => return opened,
            Err(status) if tokio::time::Instant::now() < deadline => {
                assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(status) => panic!("no slot within {limit:?}: {status:?}"),
        }
    }
}

/// The value of one series (`name` or `name{labels}`) on the collector's
/// `/metrics` (at `http`), read over a plain HTTP/1.1 request.
async fn figure(http: &str, series: &str) -> f64 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(http).await.expect("connect");
    tcp.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("request");
    let mut text = String::new();
    tcp.read_to_string(&mut text).await.expect("response");
    let name = format!("rankscope_collector_{series} ");
    text.lines()
        .find_map(|l| {
            l.strip_prefix(&name)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{text}"))
}

/// Resident memory of a process now, in bytes (`VmRSS`).
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("procfs");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("a VmRSS line");
    kib * 1024
}

/// A stream opened over a raw HTTP/2 connection of its own: its Hello sent and
/// its Welcome received.
struct RawCall {
    send: h2::SendStream<Bytes>,
    body: h2::RecvStream,
    connection: tokio::task::JoinHandle<()>,
    _client: h2::client::SendRequest<Bytes>,
}

impl RawCall {
    async fn open(addr: &str, run_id: &str, rank: u32) -> RawCall {
        tokio::time::timeout(ANSWER_TIMEOUT, async {
            let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
            let (client, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
            let connection = tokio::spawn(async move {
                let _ = connection.await;
            });
            let mut client = client.ready().await.expect("h2 ready");
            let request = http::Request::builder()
                .method("POST")
                .uri(format!("http://{addr}/rankscope.v1.Collector/Stream"))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(())
                .expect("request");
            let (response, mut send) = client.send_request(request, false).expect("headers");
            let mut hello = hello(run_id, rank);
            hello.world_size = 1 << 20;
            let hello = AgentMessage {
                kind: Some(AgentKind::Hello(hello)),
            };
            send.send_data(Bytes::from(frame(0, &hello.encode_to_vec())), false)
                .expect("send the Hello");
            let response = response.await.expect("response headers");
            assert_eq!(
                Status::from_header_map(response.headers()).map(|s| s.code()),
                None,
                "a stream, not a refusal"
            );
            let mut body = response.into_body();
            let welcome = body.data().await.expect("a Welcome").expect("its bytes");
            let _ = body.flow_control().release_capacity(welcome.len());
            RawCall {
                send,
                body,
                connection,
                _client: client,
            }
        })
        .await
        .expect("a Welcome within 30 s")
    }

    /// The status the collector ends the call with.
    async fn status(mut self) -> Status {
        tokio::time::timeout(ANSWER_TIMEOUT, async {
            while let Some(chunk) = self.body.data().await {
                let chunk = chunk.expect("response body");
                let _ = self.body.flow_control().release_capacity(chunk.len());
            }
            let trailers = self.body.trailers().await.expect("trailers").expect("some");
            Status::from_header_map(&trailers).expect("a grpc-status trailer")
        })
        .await
        .expect("the collector ends the call within 30 s")
    }
}

/// Waits (up to 30 s) until `/metrics` says `open` streams are open.
async fn until_open_streams(http: &str, open: f64) {
    let deadline = tokio::time::Instant::now() + ANSWER_TIMEOUT;
    while figure(http, "open_streams").await != open {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the collector still counts {} open streams, not {open}",
            figure(http, "open_streams").await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_messages_stay_within_the_memory_bound_and_time_out() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = FAST.to_vec();
    // The default memory bound (512 MiB, so 64 MiB of room for decoding); a short
    // --message-timeout so the test does not wait the default 30 s.
    args.extend(["--http", "127.0.0.1:0", "--message-timeout", "3s"]);
    let collector = CollectorProc::start(dir.path(), &args);
    let (addr, http) = (collector.addr.clone(), collector.http.clone().unwrap());
    let bound = figure(&http, "memory_limit_bytes").await;
    assert_eq!(bound, (512u64 << 20) as f64);
    let room = figure(&http, "decode_room_bytes").await;
    assert_eq!(room, bound / 8.0);
    assert_eq!(figure(&http, "message_timeout_seconds").await, 3.0);
    let mut bystander = Bystander::open(&addr).await;
    bystander.lands_a_batch().await;

    // Real agents send beside the flood: their batches (about 128 KiB) wait for
    // room like any message, may time out, and are resent on a new stream.
    let agents = {
        let addr = addr.clone();
        tokio::task::spawn_blocking(move || {
            rankscope(&[
                "loadgen",
                "--run-id",
                "beside",
                "--ranks",
                "2",
                "--steps",
                "200",
                "--layers",
                "16",
                "--collector",
                &addr,
                "--finish-timeout",
                "120s",
            ])
        })
    };

    // 48 streams each send a Hello, then 16 MiB - 2 bytes of a 16 MiB - 1
    // message, and wait (their connections answer keepalive pings).
    let declared = (16u32 << 20) - 1;
    let mut calls = Vec::new();
    for rank in 0..48 {
        let mut call = RawCall::open(&addr, "flood", rank).await;
        let mut message = vec![0];
        message.extend_from_slice(&declared.to_be_bytes());
        message.resize(5 + declared as usize - 1, 0x5a);
        call.send
            .send_data(Bytes::from(message), false)
            .expect("queue the message");
        calls.push(call);
    }
    // While they wait: the room held by unfinished messages stays within the room
    // for decoding, and resident memory within the bound.
    let mut largest = 0f64;
    let ended = loop {
        let unfinished = figure(&http, "unfinished_message_bytes").await;
        assert!(
            unfinished <= room,
            "{unfinished} bytes of unfinished messages, over the room of {room}"
        );
        largest = largest.max(unfinished);
        let rss = rss_bytes(collector.pid());
        assert!(
            (rss as f64) < bound,
            "resident memory {rss} passed the bound {bound}"
        );
        if figure(&http, "refused_total{reason=\"message_timeout\"}").await >= 48.0 {
            break figure(&http, "refused_total{reason=\"message_timeout\"}").await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        largest >= f64::from(declared),
        "the flood held room ({largest} bytes at most)"
    );
    for call in calls {
        let status = call.status().await;
        assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
        assert!(
            status.message().contains("within 3s of its first byte")
                && status.message().contains("(--message-timeout)"),
            "{status:?}"
        );
    }
    assert!(ended >= 48.0);
    let peak = peak_rss_bytes(collector.pid());
    eprintln!(
        "flood: peak RSS {} MiB, unfinished messages held at most {} MiB of room, {ended} \
         messages timed out",
        peak >> 20,
        largest as u64 >> 20
    );
    assert!(
        (peak as f64) < bound,
        "peak resident memory {peak} passed the bound {bound}"
    );
    assert_eq!(
        figure(&http, "refused_total{reason=\"malformed\"}").await,
        0.0
    );
    // Once the flood is gone, the room is free and everything lands.
    assert_eq!(figure(&http, "unfinished_message_bytes").await, 0.0);
    agents
        .await
        .expect("the agents finish with every row acknowledged");
    bystander.lands_a_batch().await;
    let rows = bystander.rows();
    drop(bystander);
    assert!(collector.stop());
    let out = dir.path();
    bystander_landed(out, rows);
    assert_eq!(count(out, "steps", "run_id = 'beside'"), 2 * 200);
    assert_eq!(count(out, "layers", "run_id = 'beside'"), 2 * 200 * 16);
    let dups = duckdb(&format!(
        "select count(*) from (select rank, step, layer from {} where run_id = 'beside' group by all having count(*) > 1)",
        table(out, "layers")
    ));
    assert_eq!(dups.trim(), "0");
    assert_eq!(count(out, "steps", "run_id = 'flood'"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_streams_count_as_disconnected_not_malformed() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = FAST.to_vec();
    args.extend(["--http", "127.0.0.1:0"]);
    let collector = CollectorProc::start(dir.path(), &args);
    let (addr, http) = (collector.addr.clone(), collector.http.clone().unwrap());
    let mut bystander = Bystander::open(&addr).await;
    bystander.lands_a_batch().await;

    // Well-formed idle streams, each dropped a way an agent can go: its
    // connection closed; its stream reset with CANCEL, INTERNAL_ERROR or
    // PROTOCOL_ERROR (what tonic reported as INTERNAL, and the collector counted
    // as malformed); its connection closed in the middle of a message; and gRPC
    // clients simply dropped, as the agent's transport drops its connection.
    const EACH: u32 = 20;
    let mut rank = 0;
    let mut next = || {
        rank += 1;
        rank
    };
    for _ in 0..EACH {
        let call = RawCall::open(&addr, "gone", next()).await;
        call.connection.abort();
    }
    let resets = [
        h2::Reason::CANCEL,
        h2::Reason::INTERNAL_ERROR,
        h2::Reason::PROTOCOL_ERROR,
    ];
    for reason in resets {
        for _ in 0..EACH {
            let mut call = RawCall::open(&addr, "gone", next()).await;
            call.send.send_reset(reason);
            // Let the connection send the reset before it closes.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    for _ in 0..EACH {
        let mut call = RawCall::open(&addr, "gone", next()).await;
        let mut message = vec![0];
        message.extend_from_slice(&(1u32 << 20).to_be_bytes());
        message.resize(5 + 100_000, 0);
        call.send.send_data(Bytes::from(message), false).unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        call.connection.abort();
    }
    let raw = f64::from(EACH) * 5.0;
    // A reset with NO_ERROR ends the request's body as if it had finished (hyper
    // reports it so): an idle stream's end, counted nowhere.
    for _ in 0..EACH {
        let mut call = RawCall::open(&addr, "gone", next()).await;
        call.send.send_reset(h2::Reason::NO_ERROR);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for _ in 0..EACH {
        let (stream, _) = open(&addr, hello("gone", 0)).await.expect("opens");
        drop(stream);
    }
    until_open_streams(&http, 1.0).await;
    let reason = |r: &str| format!("refused_total{{reason=\"{r}\"}}");
    assert_eq!(figure(&http, &reason("malformed")).await, 0.0);
    assert_eq!(figure(&http, &reason("invalid")).await, 0.0);
    assert_eq!(figure(&http, &reason("message_timeout")).await, 0.0);
    // The raw ones were cut mid-stream; a dropped gRPC client may close its side
    // cleanly first (not counted).
    let gone = figure(&http, &reason("disconnected")).await;
    assert!(
        (raw..=raw + f64::from(EACH)).contains(&gone),
        "{gone} disconnects counted for {raw} streams cut and {EACH} clients dropped"
    );
    // Nothing was held for them afterwards.
    assert_eq!(figure(&http, "unfinished_message_bytes").await, 0.0);
    bystander.lands_a_batch().await;
    let rows = bystander.rows();
    drop(bystander);
    assert!(collector.stop());
    bystander_landed(dir.path(), rows);
}
