//! Hostile streams against the real collector binary on 127.0.0.1:0: more
//! streams than `--max-streams`, messages begun and never finished, streams
//! dropped without a word. (Hostile bytes and batches are in `hostile.rs`.)
//!
//! Each must end only its own stream, keep the collector within its memory bound
//! and count it as what it was, and leave the collector serving: a well-formed
//! "bystander" stream open across the test still lands every row, checked with
//! the real DuckDB CLI.

use std::time::Duration;

use bytes::Bytes;
use prost::Message;
use rankscope_proto::v1::AgentMessage;
use rankscope_proto::v1::agent_message::Kind as AgentKind;
use rankscope_tests::hostile::{
    Bystander, RawRequest, bystander_landed, frame, peak_rss_bytes, raw_call, raw_request,
    rss_bytes, trailer_status,
};
use rankscope_tests::{
    ANSWER_TIMEOUT, CollectorProc, FAST_COMMITS as FAST, RawStream, batch, count, duckdb, hello,
    open, rankscope, table,
};
use tonic::{Code, Status};

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
            let RawRequest {
                client,
                connection,
                response,
                mut send,
            } = raw_request(addr, false).await;
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
            trailer_status(&mut self.body).await
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
