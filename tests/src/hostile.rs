//! What the hostile-input tests (`tests/hostile.rs`, `tests/hostile_streams.rs`)
//! share: messages and gRPC frames built by hand, a raw HTTP/2 call, the
//! well-formed "bystander" stream that must keep landing rows, and a process's
//! resident memory.

use std::path::Path;

use bytes::Bytes;
use rankscope_proto::v1::agent_message::Kind as AgentKind;
use rankscope_proto::v1::{AgentMessage, Batch};
use tonic::Status;

use crate::{ANSWER_TIMEOUT, RawStream, batch, count, duckdb, hello, open, table};

pub fn hello_message(run_id: &str, rank: u32) -> AgentMessage {
    AgentMessage {
        kind: Some(AgentKind::Hello(hello(run_id, rank))),
    }
}

pub fn batch_message(b: Batch) -> AgentMessage {
    AgentMessage {
        kind: Some(AgentKind::Batch(b)),
    }
}

/// A well-formed stream that keeps sending while hostile ones come and go.
pub struct Bystander {
    stream: RawStream,
    seq: u64,
}

impl Bystander {
    const ROWS: u64 = 5;

    pub async fn open(addr: &str) -> Bystander {
        let (stream, _) = open(addr, hello("bystander", 0)).await.expect("opens");
        Bystander { stream, seq: 0 }
    }

    /// Sends one more batch and waits until it is durable.
    pub async fn lands_a_batch(&mut self) {
        self.seq += 1;
        self.stream.send(batch(self.seq, Self::ROWS, false)).await;
        assert_eq!(self.stream.acked(self.seq).await, self.seq);
    }

    /// Rows it has had acknowledged.
    pub fn rows(&self) -> u64 {
        self.seq * Self::ROWS
    }
}

/// Checks, after the collector stopped, that the bystander's rows are all there once.
pub fn bystander_landed(out: &Path, rows: u64) {
    assert_eq!(count(out, "steps", "run_id = 'bystander'"), rows);
    let dups = duckdb(&format!(
        "select count(*) from (select step from {} where run_id = 'bystander' group by step having count(*) > 1)",
        table(out, "steps")
    ));
    assert_eq!(dups.trim(), "0");
}

/// One gRPC frame: compression flag, big-endian length, payload.
pub fn frame(flag: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![flag];
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// One `Collector/Stream` call on a raw HTTP/2 connection of its own (no gRPC
/// library on the client side).
pub struct RawRequest {
    /// The connection's client, kept for as long as the call should live.
    pub client: h2::client::SendRequest<Bytes>,
    /// The task that drives the connection: aborting it closes the connection.
    pub connection: tokio::task::JoinHandle<()>,
    pub response: h2::client::ResponseFuture,
    pub send: h2::SendStream<Bytes>,
}

/// Opens a [`RawRequest`]; with `end`, its headers are the whole request.
pub async fn raw_request(addr: &str, end: bool) -> RawRequest {
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
    let (response, send) = client.send_request(request, end).expect("send headers");
    RawRequest {
        client,
        connection,
        response,
        send,
    }
}

/// The status a call ends with, from its response body's trailers (the body read
/// and its capacity released on the way).
pub async fn trailer_status(body: &mut h2::RecvStream) -> Status {
    while let Some(chunk) = body.data().await {
        let chunk = chunk.expect("response body");
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    let trailers = body.trailers().await.expect("trailers").expect("some");
    Status::from_header_map(&trailers).expect("a grpc-status trailer")
}

/// Sends `body` as the whole request of one `Collector/Stream` call over a raw
/// HTTP/2 connection, and returns the status the collector ends the call with.
pub async fn raw_call(addr: &str, body: Vec<u8>) -> Status {
    tokio::time::timeout(ANSWER_TIMEOUT, async {
        let mut call = raw_request(addr, body.is_empty()).await;
        if !body.is_empty() {
            call.send
                .send_data(Bytes::from(body), true)
                .expect("send body");
        }
        let response = call.response.await.expect("response headers");
        let (parts, mut body) = response.into_parts();
        if let Some(status) = Status::from_header_map(&parts.headers) {
            return status; // a trailers-only answer
        }
        trailer_status(&mut body).await
    })
    .await
    .expect("the collector answers a raw call within 30 s")
}

/// Peak resident memory of a process, in bytes (`VmHWM`).
pub fn peak_rss_bytes(pid: u32) -> u64 {
    status_bytes(pid, "VmHWM")
}

/// Resident memory of a process now, in bytes (`VmRSS`).
pub fn rss_bytes(pid: u32) -> u64 {
    status_bytes(pid, "VmRSS")
}

/// A `kB` field of `/proc/PID/status`, in bytes.
fn status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("procfs");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("a {field} line"));
    kib * 1024
}
