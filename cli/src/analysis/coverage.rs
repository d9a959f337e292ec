//! Whether a layer's series is thick enough for a trend: the one rule that
//! `summary`, the report (its page and its JSON summary) and `top` apply before
//! they show a change such as "down −56.8 %".
//!
//! A layer is planned to be sampled at every step with `step % sample_every ==
//! 0` (`runs.sample_every`) within its ranks' step range. The overhead budget
//! skips whole planned steps (the agent's final `samples_skipped` event counts
//! them; docs/columns.md), and dropped samples never arrive, so a layer can
//! have far fewer points than planned, and the few it has can come from any
//! part of the run. The planned samples not measured are counted here as
//! planned − measured: that is the agent's skipped and dropped steps, and it
//! is known mid-run, before the final event arrives.
//!
//! Live (`top`), where the final event has not come yet, the plan runs from a
//! layer's oldest kept sample to its rank's newest step.
//!
//! The rule: a trend needs at least [`MIN_TREND_POINTS`] measured samples and,
//! when the plan is known, at least [`MIN_MEASURED_SHARE`] of the planned ones.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use rankscope_collector::live::snapshot::{LayerLive, RunSnapshot};

use super::diagnoses::RunData;

/// The fewest samples for a trend.
pub const MIN_TREND_POINTS: u64 = 5;
/// The least share of the planned samples measured for a trend.
pub const MIN_MEASURED_SHARE: f64 = 0.5;

/// How much of a layer's plan was measured, and whether that carries a trend.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Coverage {
    /// Planned samples over the layer's ranks' step range; null when the run's
    /// `sample_every` is unknown.
    pub planned: Option<u64>,
    /// Samples measured (distinct sampled steps of the series).
    pub measured: u64,
    /// Planned samples not measured (skipped for the budget, or dropped).
    pub skipped: Option<u64>,
    /// Whether the series carries a trend ([`MIN_TREND_POINTS`],
    /// [`MIN_MEASURED_SHARE`]).
    pub trend_reliable: bool,
    /// Why not, for people, when it does not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl Coverage {
    /// The coverage of a series of `measured` samples out of `planned`.
    pub fn new(planned: Option<u64>, measured: u64) -> Coverage {
        // Mid-run the newest planned sample may still be measured: a plan is
        // never less than what arrived.
        let planned = planned.map(|p| p.max(measured));
        let skipped = planned.map(|p| p - measured);
        let enough_points = measured >= MIN_TREND_POINTS;
        let enough_share = planned.is_none_or(|p| measured as f64 >= MIN_MEASURED_SHARE * p as f64);
        let trend_reliable = enough_points && enough_share;
        let note = (!trend_reliable).then(|| match (planned, skipped) {
            (Some(p), Some(s)) if s > 0 => {
                format!("{s} of {p} planned samples skipped: trends unreliable")
            }
            _ => format!(
                "{measured} sample{}: too few for a trend (at least {MIN_TREND_POINTS})",
                if measured == 1 { "" } else { "s" }
            ),
        });
        Coverage {
            planned,
            measured,
            skipped,
            trend_reliable,
            note,
        }
    }
}

/// Steps with `step % sample_every == 0` in `first..=last`; `None` without a
/// plan (`sample_every` unknown or 0).
pub fn planned_samples(first: u64, last: u64, sample_every: Option<u64>) -> Option<u64> {
    let every = sample_every.filter(|&e| e > 0)?;
    if last < first {
        return Some(0);
    }
    Some((last / every + 1).saturating_sub(first.div_ceil(every)))
}

/// Every layer's coverage in `run`: its measured samples (distinct sampled
/// steps over its ranks) against the plan over those ranks' step range.
pub fn layer_coverage(run: &RunData, sample_every: Option<u64>) -> BTreeMap<String, Coverage> {
    let mut ranges: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for s in &run.steps {
        let r = ranges.entry(s.rank).or_insert((s.step, s.step));
        *r = (r.0.min(s.step), r.1.max(s.step));
    }
    let mut layers: BTreeMap<&str, (BTreeSet<u32>, BTreeSet<u64>)> = BTreeMap::new();
    for l in &run.layers {
        let (ranks, steps) = layers.entry(&l.layer).or_default();
        ranks.insert(l.rank);
        steps.insert(l.step);
    }
    layers
        .into_iter()
        .map(|(layer, (ranks, steps))| {
            let span = ranks
                .iter()
                .filter_map(|r| ranges.get(r))
                .copied()
                .reduce(|a, b| (a.0.min(b.0), a.1.max(b.1)));
            let planned = span.and_then(|(lo, hi)| planned_samples(lo, hi, sample_every));
            (
                layer.to_string(),
                Coverage::new(planned, steps.len() as u64),
            )
        })
        .collect()
}

/// A live layer's coverage: its history (the last samples of one rank)
/// against the plan from the history's first step to that rank's newest step.
pub fn live_layer(layer: &LayerLive, run: &RunSnapshot) -> Coverage {
    let first = layer.history.first().map(|p| p.step);
    let newest = run
        .ranks
        .iter()
        .find(|r| r.rank == layer.rank)
        .and_then(|r| r.steps.last().map(|s| s.step))
        .into_iter()
        .chain(layer.history.last().map(|p| p.step))
        .max();
    let planned = first
        .zip(newest)
        .and_then(|(lo, hi)| planned_samples(lo, hi, run.sample_every));
    Coverage::new(planned, layer.history.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planned_samples_count_the_multiples_in_the_range() {
        assert_eq!(planned_samples(0, 99, Some(10)), Some(10));
        assert_eq!(planned_samples(1, 100, Some(10)), Some(10));
        assert_eq!(planned_samples(5, 9, Some(10)), Some(0));
        assert_eq!(planned_samples(0, 0, Some(1)), Some(1));
        assert_eq!(planned_samples(0, 99, None), None);
        assert_eq!(planned_samples(0, 99, Some(0)), None);
    }

    #[test]
    fn a_thin_series_has_no_trend_and_says_why() {
        // 2 of 40 planned samples measured (the budget skipped the rest).
        let thin = Coverage::new(Some(40), 2);
        assert!(!thin.trend_reliable);
        assert_eq!(thin.skipped, Some(38));
        assert_eq!(
            thin.note.as_deref(),
            Some("38 of 40 planned samples skipped: trends unreliable")
        );
        // Many points, but fewer than half the plan.
        let sparse = Coverage::new(Some(100), 40);
        assert!(!sparse.trend_reliable);
        assert_eq!(
            sparse.note.as_deref(),
            Some("60 of 100 planned samples skipped: trends unreliable")
        );
        // A short run: nothing skipped, still too few.
        let short = Coverage::new(Some(3), 3);
        assert!(!short.trend_reliable);
        assert_eq!(
            short.note.as_deref(),
            Some("3 samples: too few for a trend (at least 5)")
        );
        // Enough, with a few skipped.
        let fine = Coverage::new(Some(40), 30);
        assert!(fine.trend_reliable && fine.note.is_none());
        // Without a plan only the count matters.
        assert!(Coverage::new(None, 5).trend_reliable);
        assert!(!Coverage::new(None, 4).trend_reliable);
        // A sample measured past the plan (mid-run) is not a negative skip.
        assert_eq!(Coverage::new(Some(9), 10).skipped, Some(0));
    }

    #[test]
    fn a_layers_plan_is_its_ranks_step_range() {
        use crate::analysis::diagnoses::{LayerRecord, StepRecord};
        let mut run = RunData::default();
        for rank in 0..2 {
            run.steps.extend((0..400).map(|step| StepRecord {
                rank,
                step,
                ..Default::default()
            }));
        }
        // Sampled every 10 steps, but the budget let only steps 0 and 390 in.
        for step in [0, 390] {
            for rank in 0..2 {
                run.layers.push(LayerRecord {
                    rank,
                    step,
                    layer: "fc1".into(),
                    ..Default::default()
                });
            }
        }
        let c = &layer_coverage(&run, Some(10))["fc1"];
        assert_eq!((c.planned, c.measured), (Some(40), 2));
        assert_eq!(
            c.note.as_deref(),
            Some("38 of 40 planned samples skipped: trends unreliable")
        );
    }
}
