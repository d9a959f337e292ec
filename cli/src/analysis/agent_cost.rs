//! What the agent cost each rank of a run, per share of its overhead budget:
//! the live view's rule ([`rankscope_collector::live::cost`], where the observed
//! figure's robust sum is explained) over the rows the diagnoses read, so
//! `summary`, `report`, `top`, the live page and `agent_overhead` agree.

use std::collections::BTreeMap;

pub use rankscope_collector::live::cost::{AgentCost, CostRow, MIN_OBSERVED_STEPS};

use super::diagnoses::StepRecord;

impl From<&StepRecord> for CostRow {
    fn from(s: &StepRecord) -> CostRow {
        CostRow {
            step: s.step,
            step_ms: s.step_ms,
            overhead_ms: s.overhead_ms,
            overhead_device_ms: s.overhead_device_ms,
            overhead_observed_ms: s.overhead_observed_ms,
        }
    }
}

/// [`AgentCost::of`] per rank.
pub fn rank_costs(steps: &[StepRecord]) -> BTreeMap<u32, AgentCost> {
    let mut by_rank: BTreeMap<u32, Vec<CostRow>> = BTreeMap::new();
    for s in steps {
        by_rank.entry(s.rank).or_default().push(s.into());
    }
    by_rank
        .into_iter()
        .map(|(rank, rows)| (rank, AgentCost::of(rows)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_are_per_rank() {
        let step = |rank, overhead_ms, observed| StepRecord {
            rank,
            step_ms: 100.0,
            overhead_ms,
            overhead_observed_ms: observed,
            ..Default::default()
        };
        let costs = rank_costs(&[
            step(0, 1.0, None),
            step(1, 2.0, Some(3.0)),
            step(0, 1.0, None),
        ]);
        assert_eq!(costs[&0].host, 0.01);
        assert_eq!((costs[&0].steps, costs[&0].observed), (2, None));
        assert_eq!((costs[&1].host, costs[&1].observed), (0.02, Some(0.03)));
    }
}
