//! Reading the live view of several collectors, and merging it.
//!
//! Each collector is asked over plain HTTP/1.1 (its `--http` server has no TLS),
//! one request per connection, with short timeouts so that a dead collector in
//! the list costs a refused connection, not a frozen screen.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use rankscope_collector::live::snapshot::{RunList, RunSnapshot, RunSummary};
use std::collections::BTreeMap;

/// How long connecting to a collector may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How long an answer may take.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest answer read (a 4,096-rank run with 64 steps each is ~70 MiB).
const MAX_ANSWER_BYTES: u64 = 256 << 20;

/// One collector's `--http` address and the token for its `/live`.
#[derive(Debug, Clone)]
pub struct Collector {
    /// `HOST:PORT`.
    pub addr: String,
    pub token: Option<String>,
}

/// What went wrong asking one collector, in words for the screen.
pub type FetchError = String;

impl Collector {
    /// `GET path`: the body of a 200 answer, or why there is none.
    fn get(&self, path: &str) -> Result<(u16, Vec<u8>), FetchError> {
        let addrs: Vec<_> = self
            .addr
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve {}: {e}", self.addr))?
            .collect();
        let mut last = format!("{} resolves to no address", self.addr);
        let mut stream = None;
        for a in addrs {
            match TcpStream::connect_timeout(&a, CONNECT_TIMEOUT) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = format!("cannot reach {}: {e}", self.addr),
            }
        }
        let mut stream = stream.ok_or_else(|| {
            format!(
                "{last} (is its collector running with --http {}?)",
                self.addr
            )
        })?;
        let io = |e: std::io::Error| format!("{}: {e}", self.addr);
        stream.set_read_timeout(Some(READ_TIMEOUT)).map_err(io)?;
        stream.set_write_timeout(Some(READ_TIMEOUT)).map_err(io)?;
        let auth = self
            .token
            .as_ref()
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n{auth}\r\n",
            self.addr
        )
        .map_err(io)?;
        let mut raw = Vec::new();
        stream
            .take(MAX_ANSWER_BYTES)
            .read_to_end(&mut raw)
            .map_err(|e| match e.kind() {
                // The gRPC port (HTTP/2 only) resets an HTTP/1.1 request.
                std::io::ErrorKind::ConnectionReset => format!(
                    "{}: {e}: is this the collector's --http port, not its gRPC port (--listen)?",
                    self.addr
                ),
                _ => io(e),
            })?;
        parse_response(&raw).map_err(|why| format!("{}: {why}", self.addr))
    }

    /// The runs the collector's live view holds.
    pub fn runs(&self) -> Result<RunList, FetchError> {
        let body = self.ok(self.get("/live/runs")?)?;
        serde_json::from_slice(&body)
            .map_err(|e| format!("{}: /live/runs is not the live view's JSON: {e}", self.addr))
    }

    /// One run with its last `steps` steps per rank; `None` when this collector
    /// does not hold it (a sharded run's ranks may all be elsewhere).
    pub fn run(&self, run_id: &str, steps: usize) -> Result<Option<RunSnapshot>, FetchError> {
        let (status, body) = self.get(&format!("/live/runs/{run_id}?steps={steps}"))?;
        if status == 404 {
            return Ok(None);
        }
        let body = self.ok((status, body))?;
        serde_json::from_slice(&body).map(Some).map_err(|e| {
            format!(
                "{}: the run's answer is not the live view's JSON: {e}",
                self.addr
            )
        })
    }

    fn ok(&self, (status, body): (u16, Vec<u8>)) -> Result<Vec<u8>, FetchError> {
        match status {
            200 => Ok(body),
            401 => Err(format!(
                "{} asks for its token: pass --token-file (the collector's --token-file) or set RANKSCOPE_TOKEN",
                self.addr
            )),
            _ => Err(format!(
                "{} answered {status}: {}",
                self.addr,
                String::from_utf8_lossy(&body).trim()
            )),
        }
    }
}

/// (status, body) of a raw HTTP/1.1 response; a chunked body is joined.
fn parse_response(raw: &[u8]) -> Result<(u16, Vec<u8>), String> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("the answer is not HTTP (no end of headers): is this the collector's --http port, not its gRPC port?")?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let body = &raw[split + 4..];
    let status = head
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or("the answer has no HTTP status line: is this the collector's --http port?")?;
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    if !chunked {
        return Ok((status, body.to_vec()));
    }
    let mut out = Vec::new();
    let mut rest = body;
    loop {
        let line_end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("a chunked answer ends early")?;
        let size_text = String::from_utf8_lossy(&rest[..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| format!("a bad chunk size {size_text:?}"))?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Ok((status, out));
        }
        if rest.len() < size {
            return Err("a chunked answer ends early".into());
        }
        out.extend_from_slice(&rest[..size]);
        rest = rest.get(size + 2..).unwrap_or(&[]);
    }
}

/// The runs of every collector, merged by run id, most recently updated first.
pub fn merge_runs(lists: impl IntoIterator<Item = RunList>) -> Vec<RunSummary> {
    let mut by_id: BTreeMap<String, RunSummary> = BTreeMap::new();
    for run in lists.into_iter().flat_map(|l| l.runs) {
        match by_id.get_mut(&run.run_id) {
            None => {
                by_id.insert(run.run_id.clone(), run);
            }
            Some(held) => {
                held.world_size = held.world_size.max(run.world_size);
                held.ranks_seen += run.ranks_seen;
                held.ranks_finished += run.ranks_finished;
                held.last_step = held.last_step.max(run.last_step);
                held.updated_us = held.updated_us.max(run.updated_us);
            }
        }
    }
    let mut runs: Vec<RunSummary> = by_id.into_values().collect();
    runs.sort_by(|a, b| {
        b.updated_us
            .cmp(&a.updated_us)
            .then_with(|| a.run_id.cmp(&b.run_id))
    });
    runs
}

/// One run as several collectors hold it (each some of its ranks), as one.
/// A rank held twice (it moved between collectors) keeps its newer steps; a
/// layer keeps its lowest rank's history.
pub fn merge_run(parts: Vec<RunSnapshot>) -> Option<RunSnapshot> {
    let mut parts = parts.into_iter();
    let mut merged = parts.next()?;
    for part in parts {
        let s = &mut merged.summary;
        s.world_size = s.world_size.max(part.summary.world_size);
        s.last_step = s.last_step.max(part.summary.last_step);
        s.updated_us = s.updated_us.max(part.summary.updated_us);
        merged.now_us = merged.now_us.max(part.now_us);
        merged.steps_kept = merged.steps_kept.max(part.steps_kept);
        merged.sample_every = merged.sample_every.or(part.sample_every);
        merged.counters.add(&part.counters);
        for rank in part.ranks {
            let newest =
                |r: &rankscope_collector::live::snapshot::RankLive| r.steps.last().map(|s| s.step);
            match merged.ranks.iter_mut().find(|r| r.rank == rank.rank) {
                Some(held) if newest(&*held) < newest(&rank) => *held = rank,
                Some(_) => {}
                None => merged.ranks.push(rank),
            }
        }
        for layer in part.layers {
            match merged.layers.iter_mut().find(|l| l.layer == layer.layer) {
                Some(held) if layer.rank < held.rank => *held = layer,
                Some(_) => {}
                None => merged.layers.push(layer),
            }
        }
    }
    merged.ranks.sort_by_key(|r| r.rank);
    merged.layers.sort_by(|a, b| a.layer.cmp(&b.layer));
    merged.summary.ranks_seen = merged.ranks.len() as u32;
    merged.summary.ranks_finished = merged.ranks.iter().filter(|r| r.finished).count() as u32;
    Some(merged)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rankscope_collector::live::snapshot::{RankLive, StepPoint};

    #[test]
    fn reads_plain_and_chunked_answers() {
        let plain = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(parse_response(plain).unwrap(), (200, b"{}".to_vec()));
        let chunked =
            b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked).unwrap(), (404, b"abcde".to_vec()));
        assert!(parse_response(b"\x00\x00\x00\x04\x08").is_err());
        assert!(
            parse_response(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n").is_err()
        );
    }

    fn part(ranks: &[u32], last: u64) -> RunSnapshot {
        RunSnapshot {
            summary: RunSummary {
                run_id: "r".into(),
                world_size: 4,
                last_step: Some(last),
                ..Default::default()
            },
            ranks: ranks
                .iter()
                .map(|&rank| RankLive {
                    rank,
                    steps: vec![StepPoint {
                        step: last,
                        ..Default::default()
                    }],
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn merges_the_ranks_of_several_collectors() {
        let merged = merge_run(vec![part(&[1, 3], 10), part(&[0, 2, 3], 12)]).unwrap();
        let ranks: Vec<u32> = merged.ranks.iter().map(|r| r.rank).collect();
        assert_eq!(ranks, [0, 1, 2, 3]);
        assert_eq!(merged.summary.ranks_seen, 4);
        assert_eq!(merged.summary.last_step, Some(12));
        // Rank 3, held by both, keeps the newer steps.
        assert_eq!(merged.ranks[3].steps[0].step, 12);
        assert!(merge_run(Vec::new()).is_none());
    }
}
