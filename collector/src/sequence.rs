//! The rules that make "acknowledged" mean "stored", as plain functions over the
//! numbers involved (`intake` applies them under its lock):
//!
//! - [`judge`]: what a batch's `seq` may be, given what the collector has accepted
//!   for its (run, rank) and what its own stream sent before. Within a stream seqs
//!   increase; the next seq is `accepted + 1`; a batch past it is taken only when
//!   it declares the batches between dropped by its agent (`Batch.dropped_from`),
//!   never because the collector guesses so. A seq at or below `accepted` is held
//!   already (a resend after a reconnect) and dropped as a duplicate.
//! - [`Claim`]: which stream may send for a (run, rank). A stream of another
//!   process while one is live is refused (two processes claim one rank: a wrong
//!   `RANK` or run id); a new stream of the same process (a reconnect whose old
//!   connection is not yet seen dead) takes over, and the old one is fenced: what
//!   it sends next is refused.
//!
//! Imports nothing of the collector.

use rankscope_proto::v1::Hello;

/// How far past the highest accepted `seq` a batch may jump before it is refused
/// as absurd, declared gap or not.
pub const MAX_SEQ_JUMP: u64 = 1_000_000_000;

/// What a batch's `seq` is, when it may be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// `accepted + 1`: buffer it.
    Next,
    /// Past the next one, with the batches `from..=to` declared dropped by the
    /// agent: buffer it, and count the gap.
    Gap { from: u64, to: u64 },
    /// Held already: drop it (its ack follows from the watermark).
    Duplicate,
}

/// A batch refused for its sequence number, or for the stream it came on.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum SeqError {
    #[error("batch seq must start at 1, got 0")]
    Zero,
    #[error("batch seq {seq} jumps more than {MAX_SEQ_JUMP} past the last accepted seq {accepted}")]
    Absurd { seq: u64, accepted: u64 },
    #[error(
        "batch seq {seq} does not follow seq {last}, sent before it on this stream: seqs increase within a stream (resend on a new stream)"
    )]
    NotIncreasing { seq: u64, last: u64 },
    #[error(
        "batch seq {seq} skips seqs {expected} to {} that the collector does not hold and the batch does not declare dropped (dropped_from = {declared}): send them first, or declare them dropped by the agent",
        seq - 1
    )]
    UndeclaredGap {
        seq: u64,
        expected: u64,
        declared: u64,
    },
    #[error(
        "this stream of rank {rank} was taken over by a newer stream of the same process: resend on that one"
    )]
    Superseded { rank: u32 },
}

/// Judges batch `seq` (declaring `dropped_from`, 0 for none) against `accepted`,
/// the highest seq of its (run, rank) the collector holds, and `last`, the seq its
/// stream sent before (0 for none).
pub fn judge(seq: u64, dropped_from: u64, accepted: u64, last: u64) -> Result<Verdict, SeqError> {
    if seq == 0 {
        return Err(SeqError::Zero);
    }
    if seq <= last {
        return Err(SeqError::NotIncreasing { seq, last });
    }
    if seq <= accepted {
        return Ok(Verdict::Duplicate);
    }
    if seq - accepted > MAX_SEQ_JUMP {
        return Err(SeqError::Absurd { seq, accepted });
    }
    let expected = accepted + 1;
    if seq == expected {
        return Ok(Verdict::Next);
    }
    if dropped_from != 0 && dropped_from <= expected {
        return Ok(Verdict::Gap {
            from: expected,
            to: seq - 1,
        });
    }
    Err(SeqError::UndeclaredGap {
        seq,
        expected,
        declared: dropped_from,
    })
}

/// The process a stream speaks for, as its `Hello` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Process {
    pub hostname: String,
    pub pid: u32,
    pub started_at: i64,
}

impl Process {
    pub fn of(hello: &Hello) -> Process {
        Process {
            hostname: hello.hostname.clone(),
            pid: hello.pid,
            started_at: hello.started_at,
        }
    }
}

/// A second process that claims a rank a live stream sends for.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error(
    "rank {rank} of run {run_id} is already streaming from host {host} pid {pid}: two processes claim one rank (check RANK, WORLD_SIZE and RANKSCOPE_RUN_ID); this process is refused until that stream ends"
)]
pub struct Claimed {
    pub run_id: String,
    pub rank: u32,
    pub host: String,
    pub pid: u32,
}

/// Which stream may send for one (run, rank).
#[derive(Debug, Default)]
pub struct Claim {
    /// The process of the newest stream, and that stream's generation.
    owner: Option<(Process, u64)>,
}

impl Claim {
    /// A new stream of `hello`'s process, while `live` streams of the rank are open:
    /// its generation, or the refusal when another process holds the rank.
    pub fn attach(&mut self, hello: &Hello, live: u32) -> Result<u64, Claimed> {
        let process = Process::of(hello);
        match &self.owner {
            Some((owner, _)) if live > 0 && *owner != process => Err(Claimed {
                run_id: hello.run_id.clone(),
                rank: hello.rank,
                host: owner.hostname.clone(),
                pid: owner.pid,
            }),
            _ => {
                let generation = self.owner.as_ref().map_or(0, |(_, g)| g + 1);
                self.owner = Some((process, generation));
                Ok(generation)
            }
        }
    }

    /// Whether the stream of `generation` still sends for the rank.
    pub fn current(&self, generation: u64) -> bool {
        self.owner.as_ref().is_none_or(|(_, g)| *g == generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_seq_is_taken_and_a_held_one_is_a_duplicate() {
        assert_eq!(judge(1, 0, 0, 0), Ok(Verdict::Next));
        assert_eq!(judge(8, 0, 7, 0), Ok(Verdict::Next));
        // A reconnect resends what is held: a duplicate, on a fresh stream.
        assert_eq!(judge(3, 0, 7, 0), Ok(Verdict::Duplicate));
        assert_eq!(judge(7, 0, 7, 3), Ok(Verdict::Duplicate));
    }

    #[test]
    fn within_a_stream_seqs_increase() {
        assert_eq!(
            judge(4, 0, 5, 5),
            Err(SeqError::NotIncreasing { seq: 4, last: 5 })
        );
        assert_eq!(
            judge(5, 0, 5, 5),
            Err(SeqError::NotIncreasing { seq: 5, last: 5 })
        );
    }

    #[test]
    fn a_gap_is_taken_only_when_declared_and_covering() {
        // 5 after 1: 2 to 4 missing.
        assert_eq!(
            judge(5, 0, 1, 1),
            Err(SeqError::UndeclaredGap {
                seq: 5,
                expected: 2,
                declared: 0
            })
        );
        assert_eq!(judge(5, 2, 1, 1), Ok(Verdict::Gap { from: 2, to: 4 }));
        // A declaration from further back covers it too (the collector holds 1).
        assert_eq!(judge(5, 1, 1, 1), Ok(Verdict::Gap { from: 2, to: 4 }));
        // One that leaves out 2 does not.
        assert_eq!(
            judge(5, 3, 1, 1),
            Err(SeqError::UndeclaredGap {
                seq: 5,
                expected: 2,
                declared: 3
            })
        );
        // A declaration on the next seq changes nothing.
        assert_eq!(judge(2, 2, 1, 1), Ok(Verdict::Next));
        assert!(matches!(
            judge(MAX_SEQ_JUMP + 2, 1, 1, 0),
            Err(SeqError::Absurd { .. })
        ));
        assert_eq!(judge(0, 0, 0, 0), Err(SeqError::Zero));
    }

    fn hello(pid: u32) -> Hello {
        Hello {
            run_id: "r".into(),
            rank: 3,
            hostname: "node-1".into(),
            pid,
            started_at: 1,
            ..Default::default()
        }
    }

    #[test]
    fn another_process_is_refused_while_a_stream_lives_and_the_same_one_takes_over() {
        let mut claim = Claim::default();
        let first = claim.attach(&hello(100), 0).unwrap();
        let refused = claim.attach(&hello(200), 1).unwrap_err();
        assert_eq!((refused.rank, refused.pid), (3, 100));
        assert!(refused.to_string().contains("pid 100"), "{refused}");
        assert!(claim.current(first));
        // A reconnect of the same process fences the first stream.
        let second = claim.attach(&hello(100), 1).unwrap();
        assert!(claim.current(second) && !claim.current(first));
        // Once no stream lives, another process may send for the rank.
        let third = claim.attach(&hello(200), 0).unwrap();
        assert!(claim.current(third) && !claim.current(second));
    }
}
