//! What the agent cost a rank, per share of its overhead budget (docs/metrics.md,
//! "Which steps are sampled"), from its `steps` rows: the one rule that the live
//! view, `top`, `summary`, `report` and the `agent_overhead` diagnosis share.
//!
//! - host: Σ `overhead_ms` / Σ `step_ms`, the agent's time on the training thread;
//! - device: Σ `overhead_device_ms` / Σ `step_ms`, absent where every row is null
//!   (CPU tensors, a tch program);
//! - observed: median(`overhead_observed_ms`) × (steps that have it) / Σ `step_ms`.
//!
//! The observed figure is a robust sum. Each of its values is a step's time less a
//! running median, so it carries the step-to-step noise of the run and, now and
//! then, a step that was slow for another reason (a checkpoint, a collective that
//! waited on a peer, the allocator). A plain sum adds such a step whole: one
//! checkpoint of 2 s on a sampled step of a run of 100 ms steps reads as a
//! slowdown of 2 s. The median of the values is the typical slowdown of a step in
//! a sampled span, and times the number of such steps it estimates their sum
//! without the outliers; it is what the agent's budget reads too (the median of
//! the recent sampled steps' costs). Its noise falls with the count, so below
//! [`MIN_OBSERVED_STEPS`] values the figure is shown but held to no budget.

use serde::{Deserialize, Serialize};

use super::snapshot::StepPoint;

/// Steps with an `overhead_observed_ms` value below which the observed share
/// is too noisy to hold to the budget.
pub const MIN_OBSERVED_STEPS: usize = 5;

/// The columns of one `steps` row the cost reads.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CostRow {
    pub step_ms: f64,
    pub overhead_ms: f64,
    pub overhead_device_ms: Option<f64>,
    pub overhead_observed_ms: Option<f64>,
}

impl From<&StepPoint> for CostRow {
    fn from(s: &StepPoint) -> CostRow {
        CostRow {
            step_ms: s.step_ms,
            overhead_ms: s.overhead_ms,
            overhead_device_ms: s.overhead_device_ms,
            overhead_observed_ms: s.overhead_observed_ms,
        }
    }
}

/// One rank's cost, as fractions of its step time.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AgentCost {
    /// Steps counted, and Σ `step_ms` over them.
    pub steps: usize,
    pub step_ms: f64,
    /// Σ `overhead_ms` / Σ `step_ms`.
    pub host: f64,
    /// Σ `overhead_device_ms` / Σ `step_ms`; `None` when no step has a value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<f64>,
    /// median(`overhead_observed_ms`) × `observed_steps` / Σ `step_ms`; `None`
    /// when no step has a value. Signed: a span of sampled steps can run faster
    /// than the median of the others.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed: Option<f64>,
    /// Steps with an `overhead_observed_ms` value.
    pub observed_steps: usize,
}

impl AgentCost {
    /// The cost over `rows` (one rank's, any order). Rows with no positive
    /// finite `step_ms` are left out.
    pub fn of(rows: impl IntoIterator<Item = CostRow>) -> AgentCost {
        let (mut n, mut step_ms, mut host) = (0, 0.0, 0.0);
        let mut device: Option<f64> = None;
        let mut observed = Vec::new();
        for s in rows {
            if !(s.step_ms.is_finite() && s.step_ms > 0.0) {
                continue;
            }
            n += 1;
            step_ms += s.step_ms;
            host += s.overhead_ms;
            if let Some(d) = s.overhead_device_ms.filter(|d| d.is_finite()) {
                *device.get_or_insert(0.0) += d;
            }
            if let Some(o) = s.overhead_observed_ms.filter(|o| o.is_finite()) {
                observed.push(o);
            }
        }
        if n == 0 {
            return AgentCost::default();
        }
        AgentCost {
            steps: n,
            step_ms,
            host: host / step_ms,
            device: device.map(|d| d / step_ms),
            observed: median(&mut observed).map(|m| m * observed.len() as f64 / step_ms),
            observed_steps: observed.len(),
        }
    }

    /// The observed share where enough steps carry it to hold it to a budget
    /// ([`MIN_OBSERVED_STEPS`]).
    pub fn observed_held(&self) -> Option<f64> {
        self.observed
            .filter(|_| self.observed_steps >= MIN_OBSERVED_STEPS)
    }
}

/// The median of `values` (finite), sorting them; `None` when empty.
fn median(values: &mut [f64]) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2]),
        _ => Some(0.5 * (values[n / 2 - 1] + values[n / 2])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(step_ms: f64, overhead_ms: f64, device: Option<f64>, observed: Option<f64>) -> CostRow {
        CostRow {
            step_ms,
            overhead_ms,
            overhead_device_ms: device,
            overhead_observed_ms: observed,
        }
    }

    #[test]
    fn the_observed_share_is_a_median_times_the_count() {
        // 100 steps of 100 ms; 10 of them in sampled spans, about 5 ms slower
        // each, one of those also slowed 2 s by a checkpoint.
        let mut rows: Vec<CostRow> = (0..100)
            .map(|i| {
                let observed = (i % 10 == 0).then_some(5.0 + (i % 3) as f64 * 0.1);
                row(100.0, 0.1, None, observed)
            })
            .collect();
        rows[50].overhead_observed_ms = Some(2005.0);
        rows[50].step_ms += 2000.0;
        let c = AgentCost::of(rows);
        assert_eq!(c.steps, 100);
        assert_eq!(c.observed_steps, 10);
        assert!((c.host - 10.0 / 12_000.0).abs() < 1e-12, "{c:?}");
        assert_eq!(c.device, None, "no device figures: absent, not zero");
        // The median, 5.1 ms, × 10 / 12,000 ms: 0.43 %, where the plain sum
        // reads 17 %.
        let observed = c.observed.unwrap();
        assert!((observed - 5.1 * 10.0 / 12_000.0).abs() < 1e-9, "{c:?}");
        assert_eq!(c.observed_held(), c.observed);
    }

    #[test]
    fn device_figures_add_up_and_few_observed_steps_are_held_to_nothing() {
        let rows = [
            row(50.0, 0.5, Some(2.0), Some(-1.0)),
            row(50.0, 0.5, Some(0.0), Some(4.0)),
            row(0.0, 9.0, Some(9.0), Some(9.0)),
        ];
        let c = AgentCost::of(rows);
        assert_eq!(c.steps, 2, "a row without step time counts nothing");
        assert_eq!(c.device, Some(0.02));
        assert_eq!(c.observed, Some(1.5 * 2.0 / 100.0));
        assert_eq!(c.observed_held(), None, "2 steps are too few");
        assert_eq!(AgentCost::of([]), AgentCost::default());
    }
}
