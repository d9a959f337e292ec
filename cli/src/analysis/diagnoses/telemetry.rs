//! Diagnoses of the telemetry itself: the agent's overhead above its budget, and
//! samples or rows it dropped.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{Diagnosis, Evidence, RunData, Thresholds};

/// One rank's overhead.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankOverhead {
    pub rank: u32,
    /// Σ overhead_ms / Σ step_ms.
    pub share: f64,
    pub overhead_ms: f64,
    pub steps: usize,
}

/// Evidence of [`agent_overhead`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OverheadEvidence {
    /// Ranks over the budget, highest first.
    pub ranks: Vec<RankOverhead>,
    pub budget: f64,
}

/// Ranks where the agent took more than its budget of the training thread's
/// time (Σ overhead_ms / Σ step_ms): the run's recorded budget, else
/// `t.overhead_budget`. A budget of 100 % sets no limit.
pub fn agent_overhead(run: &RunData, t: &Thresholds) -> Option<Diagnosis> {
    // A recorded budget that no agent writes (0, negative, NaN) reads as unrecorded.
    let budget = run
        .overhead_budget
        .filter(|b| *b > 0.0 && b.is_finite())
        .unwrap_or(t.overhead_budget);
    if budget >= 1.0 {
        return None;
    }
    let mut per_rank: BTreeMap<u32, (f64, f64, usize)> = BTreeMap::new();
    for s in &run.steps {
        let e = per_rank.entry(s.rank).or_default();
        e.0 += s.overhead_ms;
        e.1 += s.step_ms;
        e.2 += 1;
    }
    let mut over: Vec<RankOverhead> = per_rank
        .into_iter()
        .filter(|(_, (_, step, _))| *step > 0.0)
        .map(|(rank, (overhead_ms, step, steps))| RankOverhead {
            rank,
            share: overhead_ms / step,
            overhead_ms,
            steps,
        })
        .filter(|r| r.share > budget)
        .collect();
    if over.is_empty() {
        return None;
    }
    over.sort_by(|a, b| b.share.total_cmp(&a.share));
    Some(Diagnosis {
        message: format!(
            "agent overhead above its {} budget on {} rank{} (rank {}: {:.2}% of step time); \
             sample less often (RANKSCOPE_SAMPLE_EVERY) or fewer layers (RANKSCOPE_LAYERS)",
            budget_percent(budget),
            over.len(),
            if over.len() == 1 { "" } else { "s" },
            over[0].rank,
            100.0 * over[0].share
        ),
        evidence: Evidence::AgentOverhead(OverheadEvidence {
            ranks: over,
            budget,
        }),
    })
}

/// An overhead budget given as a fraction, written as RANKSCOPE_OVERHEAD_BUDGET
/// reads it: `2%`, `0.5%`, `0.0001%`.
pub fn budget_percent(fraction: f64) -> String {
    format!("{}%", (100.0 * fraction * 1e6).round() / 1e6)
}

/// Evidence of [`telemetry_loss`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossEvidence {
    /// Per rank: activation samples not measured (`samples_dropped` events).
    pub samples_dropped: BTreeMap<u32, i64>,
    /// Per rank: rows lost from the tables (`rows_dropped` events).
    pub rows_dropped: BTreeMap<u32, i64>,
}

/// Any `samples_dropped` or `rows_dropped` event with a positive count: the
/// tables are missing data, so other diagnoses see less than happened.
pub fn telemetry_loss(run: &RunData) -> Option<Diagnosis> {
    let mut evidence = LossEvidence {
        samples_dropped: BTreeMap::new(),
        rows_dropped: BTreeMap::new(),
    };
    for e in &run.events {
        let Some(v) = e.value.filter(|v| *v > 0) else {
            continue;
        };
        let slot = match e.kind.as_str() {
            "samples_dropped" => &mut evidence.samples_dropped,
            "rows_dropped" => &mut evidence.rows_dropped,
            _ => continue,
        };
        *slot.entry(e.rank).or_default() += v;
    }
    let samples: i64 = evidence.samples_dropped.values().sum();
    let rows: i64 = evidence.rows_dropped.values().sum();
    if samples == 0 && rows == 0 {
        return None;
    }
    let mut parts = Vec::new();
    if samples > 0 {
        parts.push(format!(
            "{samples} activation samples taken but not measured on ranks {:?} (libtorch could not \
             prepare them, or the metrics thread had not measured them when the agent finished)",
            evidence.samples_dropped.keys().collect::<Vec<_>>()
        ));
    }
    if rows > 0 {
        parts.push(format!(
            "{rows} rows dropped on ranks {:?} (queues or outbox full)",
            evidence.rows_dropped.keys().collect::<Vec<_>>()
        ));
    }
    Some(Diagnosis {
        message: format!("telemetry incomplete: {}", parts.join("; ")),
        evidence: Evidence::TelemetryLoss(evidence),
    })
}

#[cfg(test)]
mod tests {
    use super::super::{EventRecord, synthetic};
    use super::*;

    #[test]
    fn overhead_over_budget() {
        let t = Thresholds::default();
        let mut run = synthetic::healthy(4, 1, 50, 9);
        assert!(agent_overhead(&run, &t).is_none());
        for s in run.steps.iter_mut().filter(|s| s.rank == 3) {
            s.overhead_ms = 0.03 * s.step_ms;
        }
        let d = agent_overhead(&run, &t).expect("over budget");
        let Evidence::AgentOverhead(e) = &d.evidence else {
            panic!()
        };
        assert_eq!(e.ranks.len(), 1);
        assert_eq!(e.ranks[0].rank, 3);
        assert!((e.ranks[0].share - 0.03).abs() < 1e-9);
        assert!(d.message.contains("above its 2% budget"), "{}", d.message);

        // The run's own budget, when recorded, holds instead of the default.
        run.overhead_budget = Some(0.05);
        assert!(agent_overhead(&run, &t).is_none(), "3 % is within 5 %");
        run.overhead_budget = Some(0.01);
        let d = agent_overhead(&run, &t).expect("over a 1 % budget");
        assert!(d.message.contains("above its 1% budget"), "{}", d.message);
        let Evidence::AgentOverhead(e) = &d.evidence else {
            panic!()
        };
        assert_eq!(e.budget, 0.01);
        run.overhead_budget = Some(1.0);
        assert!(agent_overhead(&run, &t).is_none(), "100 % sets no limit");
        run.overhead_budget = Some(f64::NAN);
        assert!(
            agent_overhead(&run, &t).is_some(),
            "NaN reads as the default"
        );
    }

    #[test]
    fn dropped_samples_and_rows() {
        let mut run = synthetic::healthy(2, 1, 30, 9);
        run.events.push(EventRecord {
            rank: 0,
            kind: "user_note".into(),
            value: Some(5),
            step: Some(1),
        });
        run.events.push(EventRecord {
            rank: 1,
            kind: "samples_dropped".into(),
            value: Some(0),
            step: None,
        });
        assert!(telemetry_loss(&run).is_none());
        for (rank, kind, value) in [
            (1, "samples_dropped", 4),
            (1, "samples_dropped", 3),
            (0, "rows_dropped", 100),
        ] {
            run.events.push(EventRecord {
                rank,
                kind: kind.into(),
                value: Some(value),
                step: None,
            });
        }
        let d = telemetry_loss(&run).expect("loss");
        let Evidence::TelemetryLoss(e) = &d.evidence else {
            panic!()
        };
        assert_eq!(e.samples_dropped, BTreeMap::from([(1, 7)]));
        assert_eq!(e.rows_dropped, BTreeMap::from([(0, 100)]));
    }
}
