//! The `comm` table: collectives counted by kind, and the rows that carry them.
//!
//! Whoever times a collective (the Python package's `torch.distributed` wrapper,
//! from any thread: gloo completes futures on its own threads) adds it to the
//! recorder's [`CommTally`] with [`crate::Agent::add_comm`]. A step takes the
//! tally when its clock stops and sends one row per kind that ran, with its step;
//! what completed between steps is sent when the next step begins (or at finish)
//! as rows without a step. A caller that reads the times later (CUDA events) adds
//! them to the step itself ([`crate::StepGuard::add_comm`]).
//!
//! The tally is a handful of relaxed atomics: adding costs three atomic adds, and
//! a step that ran no collective sends nothing.

use std::sync::atomic::{AtomicU64, Ordering};

use rankscope_proto::Row;
use rankscope_proto::v1::CommRow;

use crate::rows::now_us;

/// The kind of a collective, as the `comm.kind` column names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CommKind {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    /// Every other collective: reduce, gather, scatter, all-to-all, barrier,
    /// point-to-point.
    Other,
}

impl CommKind {
    pub const ALL: [CommKind; 5] = [
        CommKind::AllReduce,
        CommKind::AllGather,
        CommKind::ReduceScatter,
        CommKind::Broadcast,
        CommKind::Other,
    ];

    /// The `comm.kind` value.
    pub fn label(self) -> &'static str {
        match self {
            CommKind::AllReduce => "all_reduce",
            CommKind::AllGather => "all_gather",
            CommKind::ReduceScatter => "reduce_scatter",
            CommKind::Broadcast => "broadcast",
            CommKind::Other => "other",
        }
    }

    /// The kind a label names, if any.
    pub fn parse(label: &str) -> Option<CommKind> {
        CommKind::ALL.into_iter().find(|k| k.label() == label)
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// One kind's collectives in one step: how many, their bytes, their time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CommTotals {
    pub count: u64,
    pub bytes: u64,
    pub ns: u64,
}

impl CommTotals {
    fn add(&mut self, other: CommTotals) {
        self.count = self.count.saturating_add(other.count);
        self.bytes = self.bytes.saturating_add(other.bytes);
        self.ns = self.ns.saturating_add(other.ns);
    }
}

/// Per-kind totals of one step, in [`CommKind::ALL`] order.
pub type CommStep = [CommTotals; 5];

/// Collectives added since the tally was last taken, shared between threads.
#[derive(Debug, Default)]
pub struct CommTally {
    count: [AtomicU64; 5],
    bytes: [AtomicU64; 5],
    ns: [AtomicU64; 5],
}

impl CommTally {
    /// Adds `count` collectives of `kind` with `bytes` and `ms` in all. A
    /// negative or non-finite `ms` counts as 0.
    pub fn add(&self, kind: CommKind, count: u64, bytes: u64, ms: f64) {
        let i = kind.index();
        self.count[i].fetch_add(count, Ordering::Relaxed);
        self.bytes[i].fetch_add(bytes, Ordering::Relaxed);
        self.ns[i].fetch_add(ms_to_ns(ms), Ordering::Relaxed);
    }

    /// Takes everything added so far, leaving the tally empty.
    pub fn take(&self) -> CommStep {
        let mut out = CommStep::default();
        for (i, totals) in out.iter_mut().enumerate() {
            // Count last: a collective added meanwhile shows in a later take
            // whole, never as a count without its bytes.
            totals.ns = self.ns[i].swap(0, Ordering::Relaxed);
            totals.bytes = self.bytes[i].swap(0, Ordering::Relaxed);
            totals.count = self.count[i].swap(0, Ordering::Relaxed);
        }
        out
    }
}

/// Adds `more` into `into`, kind by kind.
pub fn merge(into: &mut CommStep, more: &CommStep) {
    for (a, b) in into.iter_mut().zip(more) {
        a.add(*b);
    }
}

/// Adds one kind's figures into a step's totals.
pub fn add_to(step: &mut CommStep, kind: CommKind, count: u64, bytes: u64, ms: f64) {
    step[kind.index()].add(CommTotals {
        count,
        bytes,
        ns: ms_to_ns(ms),
    });
}

/// The `comm` rows of `totals`: one per kind that has anything.
pub fn rows(step: Option<u64>, totals: &CommStep) -> Vec<Row> {
    let time = now_us();
    CommKind::ALL
        .into_iter()
        .zip(totals)
        .filter(|(_, t)| t.count > 0 || t.ns > 0 || t.bytes > 0)
        .map(|(kind, t)| {
            Row::Comm(CommRow {
                step,
                time,
                kind: kind.label().into(),
                count: t.count,
                bytes: t.bytes,
                comm_ms: t.ns as f64 / 1e6,
            })
        })
        .collect()
}

fn ms_to_ns(ms: f64) -> u64 {
    if ms.is_finite() && ms > 0.0 {
        // Saturates at u64::MAX for absurd values (`as` on floats saturates).
        (ms * 1e6) as u64
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_through_their_labels() {
        for kind in CommKind::ALL {
            assert_eq!(CommKind::parse(kind.label()), Some(kind));
        }
        assert_eq!(CommKind::parse("allreduce"), None);
    }

    #[test]
    fn a_tally_is_taken_once_and_rows_only_for_kinds_that_ran() {
        let tally = CommTally::default();
        tally.add(CommKind::AllGather, 1, 400, 1.5);
        tally.add(CommKind::AllGather, 1, 400, 0.5);
        tally.add(CommKind::Broadcast, 1, 8, f64::NAN);
        tally.add(CommKind::Other, 1, 0, -3.0);
        let taken = tally.take();
        assert_eq!(
            taken[1],
            CommTotals {
                count: 2,
                bytes: 800,
                ns: 2_000_000
            }
        );
        assert_eq!(taken[3].ns, 0);
        assert_eq!(tally.take(), CommStep::default());
        let rows = rows(Some(7), &taken);
        let kinds: Vec<_> = rows
            .iter()
            .map(|r| match r {
                Row::Comm(c) => (c.kind.as_str(), c.step, c.count, c.bytes),
                other => panic!("not a comm row: {other:?}"),
            })
            .collect();
        assert_eq!(
            kinds,
            [
                ("all_gather", Some(7), 2, 800),
                ("broadcast", Some(7), 1, 8),
                ("other", Some(7), 1, 0)
            ]
        );
    }

    #[test]
    fn merged_totals_add_up_and_saturate() {
        let mut step = CommStep::default();
        add_to(&mut step, CommKind::AllReduce, 1, u64::MAX, 1e300);
        let mut more = CommStep::default();
        add_to(&mut more, CommKind::AllReduce, 2, 5, 1.0);
        merge(&mut step, &more);
        assert_eq!(step[0].count, 3);
        assert_eq!((step[0].bytes, step[0].ns), (u64::MAX, u64::MAX));
    }
}
