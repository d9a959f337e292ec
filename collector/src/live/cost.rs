//! What the agent cost a rank, per share of its overhead budget (docs/metrics.md,
//! "Which steps are sampled"), from its `steps` rows: the one rule that the live
//! view, `top`, `summary`, `report` and the `agent_overhead` diagnosis share.
//!
//! - host: Σ `overhead_ms` / Σ `step_ms`, the agent's time on the training thread;
//! - device: Σ `overhead_device_ms` / Σ `step_ms`, absent where every row is null
//!   (CPU tensors, a tch program);
//! - observed: the median over the sampled spans of a span's mean
//!   `overhead_observed_ms`, × (steps that have it) / Σ `step_ms`.
//!
//! The observed figure is a robust sum. Each of its values is a step's time less a
//! running median, so it carries the step-to-step noise of the run and, now and
//! then, a step that was slow for another reason (a checkpoint, a collective that
//! waited on a peer, the allocator). A plain sum adds such a step whole: one
//! checkpoint of 2 s on a sampled step of a run of 100 ms steps reads as a
//! slowdown of 2 s. The values come in spans (a sampled step and the steps after
//! it while its work is in flight: consecutive steps that carry the column), and a
//! sample's cost can sit on any step of its span (the sampled step on CPU, the
//! next ones on a GPU), so the median is taken over the spans' means, not over the
//! steps: a span of [20, 0, 0] ms costs 20 ms, where the median of its steps reads
//! 0. Times the steps that carry a value, it estimates their sum without the
//! outlying spans; the agent's budget reads the median of the recent spans too.
//! Its noise falls with the count, so below [`MIN_OBSERVED_STEPS`] values the
//! figure is shown but held to no budget.

use serde::{Deserialize, Serialize};

use super::snapshot::StepPoint;

/// Steps with an `overhead_observed_ms` value below which the observed share
/// is too noisy to hold to the budget.
pub const MIN_OBSERVED_STEPS: usize = 5;

/// The columns of one `steps` row the cost reads.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CostRow {
    pub step: u64,
    pub step_ms: f64,
    pub overhead_ms: f64,
    pub overhead_device_ms: Option<f64>,
    pub overhead_observed_ms: Option<f64>,
}

impl From<&StepPoint> for CostRow {
    fn from(s: &StepPoint) -> CostRow {
        CostRow {
            step: s.step,
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
    /// The median span's mean `overhead_observed_ms` × `observed_steps` / Σ
    /// `step_ms` (see the module); `None` when no step has a value. Signed: a span
    /// of sampled steps can run faster than the median of the others.
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
                observed.push((s.step, o));
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
            observed: median(&mut span_means(&mut observed))
                .map(|m| m * observed.len() as f64 / step_ms),
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

/// The mean value of each span of `(step, value)`s: runs of consecutive steps
/// (sorted here).
fn span_means(values: &mut [(u64, f64)]) -> Vec<f64> {
    values.sort_by_key(|&(step, _)| step);
    let mut means = Vec::new();
    let (mut sum, mut n, mut last) = (0.0, 0usize, None);
    for &(step, value) in values.iter() {
        if last.is_some_and(|l: u64| step != l + 1) {
            means.push(sum / n as f64);
            (sum, n) = (0.0, 0);
        }
        sum += value;
        n += 1;
        last = Some(step);
    }
    if n > 0 {
        means.push(sum / n as f64);
    }
    means
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
            step: 0,
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
                CostRow {
                    step: i,
                    ..row(100.0, 0.1, None, observed)
                }
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

    #[test]
    fn a_samples_cost_counts_wherever_it_sits_in_its_span() {
        // Every 10th step sampled; its span is 3 steps, and the cost (12 ms) sits on
        // the step after the sampled one (a GPU's side stream still running): the
        // median of the steps would read 0, the median of the spans' means 4 ms.
        let rows = (0..100u64).map(|i| {
            let observed = match i % 10 {
                0 | 2 => Some(0.0),
                1 => Some(12.0),
                _ => None,
            };
            CostRow {
                step: i,
                ..row(100.0, 0.0, None, observed)
            }
        });
        let c = AgentCost::of(rows);
        assert_eq!(c.observed_steps, 30);
        let observed = c.observed.unwrap();
        assert!((observed - 10.0 * 12.0 / 10_000.0).abs() < 1e-12, "{c:?}");
    }
}
