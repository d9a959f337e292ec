//! Acknowledged means stored, against the real collector binary on 127.0.0.1:0,
//! read back with the real DuckDB CLI: every seq a stream had acknowledged has its
//! rows in the Parquet output exactly once, whatever order a client sends in, how
//! many streams claim one rank, or which gaps it leaves.
//!
//! The rules (ARCHITECTURE.md, "The durability and acknowledgement contract"):
//! - within a stream, seqs increase; a seq that does not is refused;
//! - a seq past the next one is refused unless the batch declares the batches
//!   between dropped by its agent (`Batch.dropped_from`); a declared gap is
//!   counted in `events` (`seq_gap`);
//! - a second live stream of one (run, rank) from another process is refused; one
//!   from the same process (a reconnect whose old connection is not yet seen dead)
//!   takes over, and the old stream ends.

use std::path::Path;

use rankscope_proto::v1::{Batch, Hello};
use rankscope_tests::{CollectorProc, FAST_COMMITS as FAST, batch, duckdb, hello, open, table};
use tonic::Code;

/// A Hello as an agent of this release sends it: schema minor 1, a process
/// identity of its own.
fn hello_of(run_id: &str, rank: u32, pid: u32) -> Hello {
    Hello {
        pid,
        started_at: 1_700_000_000_000_000 + i64::from(pid),
        schema_minor: rankscope_proto::SCHEMA_MINOR,
        ..hello(run_id, rank)
    }
}

fn declaring(mut b: Batch, dropped_from: u64) -> Batch {
    b.dropped_from = dropped_from;
    b
}

/// The seqs whose rows landed for `run_id` (steps are numbered `seq * 1000 + i`),
/// each with its row count.
fn landed(out: &Path, run_id: &str) -> Vec<(u64, u64)> {
    let text = duckdb(&format!(
        "select step // 1000, count(*) from {} where run_id = '{run_id}' group by 1 order by 1",
        table(out, "steps")
    ));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (seq, n) = l.split_once(',').expect("two columns");
            (seq.trim().parse().unwrap(), n.trim().parse().unwrap())
        })
        .collect()
}

fn events(out: &Path, run_id: &str, kind: &str) -> String {
    duckdb(&format!(
        "select message || '|' || value from {} where run_id = '{run_id}' and kind = '{kind}'",
        table(out, "events")
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seq_that_does_not_increase_within_a_stream_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &FAST);
    let (mut stream, _) = open(&collector.addr, hello_of("reorder", 0, 7))
        .await
        .unwrap();
    for seq in [1, 2, 3] {
        stream.send(batch(seq, 10, false)).await;
    }
    assert_eq!(stream.acked(3).await, 3);
    // 3 again, then 2: the same stream may not go back.
    stream.send(batch(3, 10, false)).await;
    let status = stream.error().await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("seq 3"), "{}", status.message());
    // A new stream may resend what is durable: acknowledged at once, stored once.
    let (mut again, durable) = open(&collector.addr, hello_of("reorder", 0, 7))
        .await
        .unwrap();
    assert_eq!(durable, 3);
    for seq in 1..=4 {
        again.send(batch(seq, 10, seq == 4)).await;
    }
    assert_eq!(again.acked(4).await, 4);
    drop(again);
    assert!(collector.stop());
    assert_eq!(
        landed(dir.path(), "reorder"),
        [(1, 10), (2, 10), (3, 10), (4, 10)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descending_seqs_are_refused_before_anything_is_acknowledged() {
    // The attack of the issue: 5, 4, 3 on one stream used to give Ack 5 with the
    // rows of 4 and 3 never stored.
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &FAST);
    let (mut stream, _) = open(&collector.addr, hello_of("descend", 0, 7))
        .await
        .unwrap();
    stream.send(batch(5, 10, false)).await;
    let status = stream.error().await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("seq 5") && status.message().contains("dropped_from"),
        "{}",
        status.message()
    );
    // The agent's reconnect sends in order from the watermark and lands all.
    let (mut again, durable) = open(&collector.addr, hello_of("descend", 0, 7))
        .await
        .unwrap();
    assert_eq!(durable, 0);
    for seq in 1..=5 {
        again.send(batch(seq, 10, seq == 5)).await;
    }
    assert_eq!(again.acked(5).await, 5);
    drop(again);
    assert!(collector.stop());
    assert_eq!(landed(dir.path(), "descend").len(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_lands_only_when_the_agent_declares_it_and_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &FAST);
    let (mut stream, _) = open(&collector.addr, hello_of("gap", 0, 7)).await.unwrap();
    stream.send(batch(1, 10, false)).await;
    assert_eq!(stream.acked(1).await, 1);
    // 2 to 4 dropped by the agent at a full spill: 5 says so.
    stream.send(declaring(batch(5, 10, false), 2)).await;
    assert_eq!(stream.acked(5).await, 5);
    // 6 claims a gap that starts after what the collector holds: 6 is the next
    // one anyway, so a needless declaration changes nothing.
    stream.send(declaring(batch(6, 10, true), 6)).await;
    assert_eq!(stream.acked(6).await, 6);
    drop(stream);
    // A declaration that leaves out a batch the collector lacks is refused.
    let (mut other, _) = open(&collector.addr, hello_of("gap2", 0, 8)).await.unwrap();
    other.send(batch(1, 10, false)).await;
    other.send(declaring(batch(4, 10, false), 3)).await;
    let status = other.error().await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("seq 4"), "{}", status.message());
    assert!(collector.stop());
    let out = dir.path();
    assert_eq!(landed(out, "gap"), [(1, 10), (5, 10), (6, 10)]);
    assert_eq!(landed(out, "gap2"), [(1, 10)]);
    let gap = events(out, "gap", "seq_gap");
    let gap = gap.trim().trim_matches('"');
    assert!(gap.contains("2 to 4") && gap.ends_with("|3"), "{gap}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_claiming_a_live_rank_is_refused_and_takes_nothing() {
    // The second attack: another stream of the same (run, rank) sent seq
    // 1000, after which the first stream's batches were acknowledged and lost.
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &FAST);
    let (mut first, _) = open(&collector.addr, hello_of("claim", 3, 100))
        .await
        .unwrap();
    first.send(batch(1, 10, false)).await;
    assert_eq!(first.acked(1).await, 1);
    let refused = match open(&collector.addr, hello_of("claim", 3, 200)).await {
        Err(status) => status,
        Ok((mut second, _)) => {
            second.send(declaring(batch(1000, 10, false), 2)).await;
            second.error().await
        }
    };
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(
        refused.message().contains("rank 3") && refused.message().contains("pid 100"),
        "{}",
        refused.message()
    );
    for seq in [2, 3] {
        first.send(batch(seq, 10, seq == 3)).await;
    }
    assert_eq!(first.acked(3).await, 3);
    drop(first);
    assert!(collector.stop());
    assert_eq!(landed(dir.path(), "claim"), [(1, 10), (2, 10), (3, 10)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_of_the_same_process_takes_over_its_old_stream_and_lands_everything() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &FAST);
    let (mut old, _) = open(&collector.addr, hello_of("reconnect", 1, 42))
        .await
        .unwrap();
    old.send(batch(1, 10, false)).await;
    assert_eq!(old.acked(1).await, 1);
    // The agent gave up on `old` (its network broke) while the collector still
    // holds it open: the new stream of the same process is welcomed.
    let (mut new, durable) = open(&collector.addr, hello_of("reconnect", 1, 42))
        .await
        .expect("a reconnect of the same process is welcomed");
    assert_eq!(durable, 1);
    for seq in 2..=4 {
        new.send(batch(seq, 10, seq == 4)).await;
    }
    assert_eq!(new.acked(4).await, 4);
    // The old stream is over: what it sends now is refused, not stored.
    old.send(batch(2, 99, false)).await;
    let status = old.error().await;
    assert_eq!(status.code(), Code::Aborted, "{status:?}");
    drop(new);
    assert!(collector.stop());
    assert_eq!(
        landed(dir.path(), "reconnect"),
        [(1, 10), (2, 10), (3, 10), (4, 10)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_of_schema_minor_0_still_lands_its_run() {
    // Today's released agents send schema minor 0 and number without gaps.
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &FAST);
    let old_agent = Hello {
        schema_minor: 0,
        ..hello("minor0", 2)
    };
    let (mut stream, durable) = open(&collector.addr, old_agent).await.unwrap();
    assert_eq!(durable, 0);
    for seq in 1..=20 {
        stream.send(batch(seq, 10, seq == 20)).await;
    }
    assert_eq!(stream.acked(20).await, 20);
    drop(stream);
    assert!(collector.stop());
    assert_eq!(landed(dir.path(), "minor0").len(), 20);
}
