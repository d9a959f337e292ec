//! Diagnoses of the telemetry itself: the agent's overhead above its budget, and
//! samples or rows it dropped.

use std::collections::{BTreeMap, BTreeSet};

use rankscope_agent::event_kind;
use serde::{Deserialize, Serialize};

use super::{Diagnosis, Evidence, RunData, Thresholds};
use crate::analysis::agent_cost::{MIN_OBSERVED_STEPS, rank_costs};

/// One rank's overhead, in the measures held to the budget.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankOverhead {
    pub rank: u32,
    /// The agent's share of the process's CPU time, the measure the budget
    /// limits (the rank's `overhead_share` event, as a fraction); `None` when the
    /// rank did not finish and so never reported it.
    #[serde(default)]
    pub cpu_share: Option<f64>,
    /// Σ overhead_ms / Σ step_ms: the agent's time on the training thread, as a
    /// share of step time.
    pub share: f64,
    /// Σ overhead_device_ms / Σ step_ms: the agent's device time; `None` where
    /// the rank recorded none (CPU).
    #[serde(default)]
    pub device_share: Option<f64>,
    /// The observed slowdown as a share of step time, robustly summed
    /// ([`crate::analysis::agent_cost`]); `None` where no step has a value.
    #[serde(default)]
    pub observed_share: Option<f64>,
    /// Steps with an `overhead_observed_ms` value.
    #[serde(default)]
    pub observed_steps: usize,
    pub overhead_ms: f64,
    pub steps: usize,
    /// Steps with a `layers` row from the rank: the samples it took.
    #[serde(default)]
    pub sampled_steps: usize,
    /// The budget's share that is furthest over it: `cpu`, `device` or
    /// `observed`.
    #[serde(default)]
    pub over: String,
}

impl RankOverhead {
    /// The shares held to the budget: cpu (the larger of the process's CPU
    /// time and the training thread's), device, and observed once enough steps
    /// carry it.
    fn shares(&self) -> Vec<(&'static str, f64)> {
        let cpu = self.cpu_share.map_or(self.share, |c| c.max(self.share));
        let mut out = vec![("cpu", cpu)];
        out.extend(self.device_share.map(|d| ("device", d)));
        if self.observed_steps >= MIN_OBSERVED_STEPS {
            out.extend(self.observed_share.map(|o| ("observed", o)));
        }
        out
    }

    /// The share furthest over the budget, and its value.
    fn worst(&self) -> (&'static str, f64) {
        self.shares()
            .into_iter()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap_or(("cpu", self.share))
    }
}

/// Evidence of [`agent_overhead`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OverheadEvidence {
    /// Ranks over the budget, highest first.
    pub ranks: Vec<RankOverhead>,
    pub budget: f64,
    /// The layers whose samples cost most on those ranks (Σ `layers.compute_ms`,
    /// at most 3), costliest first.
    #[serde(default)]
    pub costly_layers: Vec<(String, f64)>,
    /// `budget_limited` events of those ranks, by the share they name.
    #[serde(default)]
    pub budget_limited: BTreeMap<String, usize>,
}

/// Per rank, the agent's share of the process's CPU time (a fraction), from its
/// `overhead_share` events: the largest when a rank reported several (one per
/// agent that finished, so a restarted rank may have more than one).
pub fn cpu_shares(run: &RunData) -> BTreeMap<u32, f64> {
    let mut shares: BTreeMap<u32, f64> = BTreeMap::new();
    for e in &run.events {
        if e.kind != event_kind::OVERHEAD_SHARE {
            continue;
        }
        if let Some(share) = e.value.and_then(share_of_millionths) {
            let slot = shares.entry(e.rank).or_insert(share);
            *slot = slot.max(share);
        }
    }
    shares
}

/// An `overhead_share` event's value (millionths of the process's CPU time)
/// as a fraction; `None` for a negative value, which no agent writes.
pub fn share_of_millionths(value: i64) -> Option<f64> {
    (value >= 0).then(|| value as f64 / 1e6)
}

/// The share a `budget_limited` event names (`the cpu share`, `the device
/// share`, `the observed share` in its message).
fn limited_share(message: &str) -> Option<&'static str> {
    ["cpu", "device", "observed"]
        .into_iter()
        .find(|s| message.contains(&format!("the {s} share")))
}

/// Ranks where the agent took more than its budget: the run's recorded budget,
/// else `t.overhead_budget`. A budget of 100 % sets no limit. The budget's three
/// shares (docs/metrics.md, "Which steps are sampled") are held to it, and a
/// rank is over when any is:
/// - cpu: the agent's share of the process's CPU time (the `overhead_share`
///   event at finish), or its time on the training thread as a share of step
///   time (Σ overhead_ms / Σ step_ms), whichever is larger. The second delays
///   every step directly: on a process that runs many threads the first can
///   stay within the budget while it does not;
/// - device: Σ overhead_device_ms / Σ step_ms;
/// - observed: the observed slowdown as a share of step time, robustly summed
///   ([`crate::analysis::agent_cost`]), from [`MIN_OBSERVED_STEPS`] steps on.
///
/// The message names the share furthest over, the layers whose samples cost
/// most (Σ `layers.compute_ms`), and the `budget_limited` events of the ranks.
pub fn agent_overhead(run: &RunData, t: &Thresholds) -> Option<Diagnosis> {
    // A recorded budget that no agent writes (0, negative, NaN) reads as unrecorded.
    let budget = run
        .overhead_budget
        .filter(|b| *b > 0.0 && b.is_finite())
        .unwrap_or(t.overhead_budget);
    if budget >= 1.0 {
        return None;
    }
    let cpu = cpu_shares(run);
    let mut sampled: BTreeMap<u32, BTreeSet<u64>> = BTreeMap::new();
    for l in &run.layers {
        sampled.entry(l.rank).or_default().insert(l.step);
    }
    let mut over: Vec<RankOverhead> = rank_costs(&run.steps)
        .into_iter()
        .filter(|(_, c)| c.step_ms > 0.0)
        .map(|(rank, c)| {
            let mut r = RankOverhead {
                rank,
                cpu_share: cpu.get(&rank).copied(),
                share: c.host,
                device_share: c.device,
                observed_share: c.observed,
                observed_steps: c.observed_steps,
                overhead_ms: c.host * c.step_ms,
                steps: c.steps,
                sampled_steps: sampled.get(&rank).map_or(0, BTreeSet::len),
                over: String::new(),
            };
            r.over = r.worst().0.to_string();
            r
        })
        .filter(|r| r.worst().1 > budget)
        .collect();
    if over.is_empty() {
        return None;
    }
    over.sort_by(|a, b| b.worst().1.total_cmp(&a.worst().1));
    let ranks_over: BTreeSet<u32> = over.iter().map(|r| r.rank).collect();
    let top = &over[0];
    let measure = match top.worst().0 {
        "device" => format!(
            "the device share, {:.2}% of step time on the GPU",
            100.0 * top.device_share.unwrap_or_default()
        ),
        "observed" => format!(
            "the observed share, {:.2}% of step time ({} steps slowed by samples)",
            100.0 * top.observed_share.unwrap_or_default(),
            top.observed_steps
        ),
        _ => match top.cpu_share {
            Some(c) if c >= top.share => {
                format!("{:.2}% of the process's CPU time", 100.0 * c)
            }
            _ => format!(
                "{:.2}% of step time on the training thread",
                100.0 * top.share
            ),
        },
    };
    let mut layer_cost: BTreeMap<&str, f64> = BTreeMap::new();
    for l in run.layers.iter().filter(|l| ranks_over.contains(&l.rank)) {
        if let Some(ms) = l.compute_ms.filter(|ms| ms.is_finite()) {
            *layer_cost.entry(&l.layer).or_default() += ms;
        }
    }
    let mut costly_layers: Vec<(String, f64)> = layer_cost
        .into_iter()
        .map(|(l, ms)| (l.to_string(), ms))
        .collect();
    costly_layers.sort_by(|a, b| b.1.total_cmp(&a.1));
    costly_layers.truncate(3);
    let mut budget_limited: BTreeMap<String, usize> = BTreeMap::new();
    for e in &run.events {
        if e.kind == event_kind::BUDGET_LIMITED && ranks_over.contains(&e.rank) {
            let share = e.message.as_deref().and_then(limited_share);
            *budget_limited
                .entry(share.unwrap_or("unnamed").to_string())
                .or_default() += 1;
        }
    }
    // Sampled steps the floor took over the budget (one every 100 steps): sampling
    // less often does not remove them, and the user should know they were chosen.
    let floor: u64 = run
        .events
        .iter()
        .filter(|e| e.kind == event_kind::SAMPLES_SKIPPED && ranks_over.contains(&e.rank))
        .filter_map(|e| e.message.as_deref().and_then(floor_steps))
        .sum();
    // A rank that sampled once took only the first planned sample, which the
    // agent always takes (to learn what a sample costs): sampling less often
    // cannot lower it, a longer run spreads it.
    let mut advice = if top.sampled_steps == 1 {
        format!(
            "its one sample is the first, always taken, and weighs most in a run of {} steps; \
             a longer run spreads it, fewer layers (RANKSCOPE_LAYERS) lower it",
            top.steps
        )
    } else {
        "sample less often (RANKSCOPE_SAMPLE_EVERY) or fewer layers (RANKSCOPE_LAYERS)".to_string()
    };
    if !costly_layers.is_empty() {
        let names: Vec<String> = costly_layers
            .iter()
            .map(|(l, ms)| format!("{l} ({ms:.1} ms)"))
            .collect();
        advice += &format!("; the costliest layers to sample: {}", names.join(", "));
    }
    if floor > 0 {
        advice += &format!(
            "; {floor} sampled step{} the floor's (one sampled step every 100 steps, within 2.5 times the budget, so that every layer's series has points)",
            if floor == 1 { " was" } else { "s were" }
        );
    }
    if !budget_limited.is_empty() {
        let named: Vec<String> = budget_limited
            .iter()
            .map(|(share, n)| format!("{share} share \u{d7}{n}"))
            .collect();
        advice += &format!(
            "; the agent skipped samples to hold it (budget_limited events: {})",
            named.join(", ")
        );
    }
    Some(Diagnosis {
        message: format!(
            "agent overhead above its {} budget on {} rank{} (rank {}: {measure}); {advice}",
            budget_percent(budget),
            over.len(),
            if over.len() == 1 { "" } else { "s" },
            top.rank,
        ),
        evidence: Evidence::AgentOverhead(OverheadEvidence {
            ranks: over,
            budget,
            costly_layers,
            budget_limited,
        }),
    })
}

/// The steps the floor sampled over the budget, from a `samples_skipped` event's
/// message (`...; 2 steps sampled by the floor (one every 100 steps) over the
/// budget`).
fn floor_steps(message: &str) -> Option<u64> {
    let before = message.split(" steps sampled by the floor").next()?;
    if before.len() == message.len() {
        return None;
    }
    before.rsplit(' ').next()?.parse().ok()
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
            event_kind::SAMPLES_DROPPED => &mut evidence.samples_dropped,
            event_kind::ROWS_DROPPED => &mut evidence.rows_dropped,
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

    fn share_event(rank: u32, millionths: i64) -> EventRecord {
        EventRecord {
            rank,
            kind: "overhead_share".into(),
            value: Some(millionths),
            step: None,
            message: None,
        }
    }

    #[test]
    fn overhead_over_budget_in_cpu_time() {
        let t = Thresholds::default();
        let mut run = synthetic::healthy(4, 1, 50, 9);
        // Within 2 % of the process's CPU time: silent.
        run.events.push(share_event(1, 19_000));
        assert!(agent_overhead(&run, &t).is_none());
        // Over it on rank 2, though its training-thread share is small.
        run.events.push(share_event(2, 35_000));
        let d = agent_overhead(&run, &t).expect("over budget in CPU time");
        let Evidence::AgentOverhead(e) = &d.evidence else {
            panic!()
        };
        assert_eq!(e.ranks.len(), 1);
        assert_eq!(e.ranks[0].rank, 2);
        assert_eq!(e.ranks[0].cpu_share, Some(0.035));
        assert!(e.ranks[0].share < 0.02);
        assert!(
            d.message
                .contains("rank 2: 3.50% of the process's CPU time"),
            "{}",
            d.message
        );
        // A restarted rank reports once per agent: the largest counts.
        run.events.push(share_event(2, 1_000));
        assert_eq!(cpu_shares(&run).get(&2), Some(&0.035));
        // The training thread's share is held to the budget too, and named when
        // it is the larger.
        for s in run.steps.iter_mut().filter(|s| s.rank == 1) {
            s.overhead_ms = 0.05 * s.step_ms;
        }
        let d = agent_overhead(&run, &t).expect("two ranks over");
        assert!(
            d.message
                .contains("2 ranks (rank 1: 5.00% of step time on the training thread)"),
            "{}",
            d.message
        );
    }

    #[test]
    fn overhead_over_budget_in_the_observed_and_device_shares() {
        let t = Thresholds::default();
        let mut run = synthetic::healthy(4, 1, 50, 9);
        // Rank 1's sampled spans (two steps in five) run 6 % slow: 2.4 % of
        // its step time, though its CPU figures are small.
        for s in run.steps.iter_mut().filter(|s| s.rank == 1) {
            s.overhead_observed_ms = (s.step % 5 < 2).then_some(0.06 * s.step_ms);
        }
        run.events.push(EventRecord {
            rank: 1,
            kind: "budget_limited".into(),
            value: Some(3),
            step: Some(20),
            message: Some("skipped: the observed share is 1.4 times its room".into()),
        });
        run.events.push(EventRecord {
            rank: 1,
            kind: "samples_skipped".into(),
            value: Some(3),
            step: None,
            message: Some("planned activation samples not taken: 3 (...); 1 planned steps skipped, each whole (...); 2 steps sampled by the floor (one every 100 steps) over the budget".into()),
        });
        let d = agent_overhead(&run, &t).expect("over budget in the observed share");
        let Evidence::AgentOverhead(e) = &d.evidence else {
            panic!()
        };
        assert_eq!(e.ranks.len(), 1);
        assert_eq!((e.ranks[0].rank, e.ranks[0].over.as_str()), (1, "observed"));
        assert_eq!(e.ranks[0].observed_steps, 20);
        assert!((e.ranks[0].observed_share.unwrap() - 0.024).abs() < 0.002);
        assert!(
            d.message.contains("(rank 1: the observed share, 2.4"),
            "{}",
            d.message
        );
        // The layers whose samples cost most, costliest first.
        let names: Vec<&str> = e.costly_layers.iter().map(|l| l.0.as_str()).collect();
        assert_eq!(names, ["head", "fc2", "fc1"]);
        assert!(
            d.message.contains(
                "the costliest layers to sample: head (7.5 ms), fc2 (5.0 ms), fc1 (2.5 ms)"
            ),
            "{}",
            d.message
        );
        assert_eq!(
            e.budget_limited,
            BTreeMap::from([("observed".to_string(), 1)])
        );
        assert!(
            d.message.contains("observed share \u{d7}1"),
            "{}",
            d.message
        );
        assert!(
            d.message.contains("; 2 sampled steps were the floor's"),
            "{}",
            d.message
        );
        assert_eq!(floor_steps("no floor here"), None);

        // Rank 2 spends 3 % of its step time on the GPU: the device share, and
        // the first named.
        for s in run.steps.iter_mut().filter(|s| s.rank == 2) {
            s.overhead_device_ms = Some(0.03 * s.step_ms);
        }
        let d = agent_overhead(&run, &t).expect("two ranks over");
        assert!(
            d.message
                .contains("2 ranks (rank 2: the device share, 3.00% of step time on the GPU)"),
            "{}",
            d.message
        );
        run.overhead_budget = Some(1.0);
        assert!(agent_overhead(&run, &t).is_none(), "100 % sets no limit");
    }

    #[test]
    fn a_few_observed_steps_are_held_to_no_budget() {
        let t = Thresholds::default();
        let mut run = synthetic::healthy(2, 1, 50, 9);
        // Four steps, each slowed by a whole step: too few to tell the agent's
        // cost from the run's noise.
        for s in run.steps.iter_mut().filter(|s| s.rank == 0 && s.step < 4) {
            s.overhead_observed_ms = Some(s.step_ms);
        }
        assert!(agent_overhead(&run, &t).is_none());
        run.steps
            .iter_mut()
            .find(|s| s.rank == 0 && s.step == 4)
            .unwrap()
            .overhead_observed_ms = Some(100.0);
        let d = agent_overhead(&run, &t).expect("five steps are enough");
        assert!(d.message.contains("the observed share"), "{}", d.message);
    }

    #[test]
    fn a_run_with_only_its_first_sample_is_told_so() {
        let t = Thresholds::default();
        let mut run = synthetic::healthy(2, 1, 30, 9);
        run.events.push(share_event(0, 147_000));
        let d = agent_overhead(&run, &t).expect("over budget");
        assert!(d.message.contains("sample less often"), "{}", d.message);
        let first = run.layers.iter().map(|l| l.step).min().unwrap();
        run.layers.retain(|l| l.step == first);
        let d = agent_overhead(&run, &t).expect("over budget");
        let Evidence::AgentOverhead(e) = &d.evidence else {
            panic!()
        };
        assert_eq!(e.ranks[0].sampled_steps, 1);
        assert!(
            d.message.contains(
                "its one sample is the first, always taken, and weighs most in a run of 30 steps"
            ),
            "{}",
            d.message
        );
        assert!(!d.message.contains("sample less often"), "{}", d.message);
    }

    #[test]
    fn dropped_samples_and_rows() {
        let mut run = synthetic::healthy(2, 1, 30, 9);
        run.events.push(EventRecord {
            rank: 0,
            kind: "user_note".into(),
            value: Some(5),
            step: Some(1),
            message: None,
        });
        run.events.push(EventRecord {
            rank: 1,
            kind: "samples_dropped".into(),
            value: Some(0),
            step: None,
            message: None,
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
                message: None,
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
