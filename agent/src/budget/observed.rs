//! The observed slowdown: what sampling costs the training itself, read off the
//! step times. The agent's CPU clocks miss what it costs elsewhere: kernels and
//! copies on a GPU that training also needs, the memory bandwidth they take, a
//! metrics thread that takes a core training wanted. The step times see all of it.
//!
//! The steps on which the agent has no sample work in flight are the baseline: the
//! median of the last [`BASELINE_STEPS`] of them is what a step costs without the
//! agent's sampling. A sampled step opens a span that lasts while its work is in
//! flight (taken on the training thread and not yet measured, or still on the
//! device), plus one step; each step of a span records its excess over the
//! baseline's median (the `overhead_observed_ms` column), signed, since noise makes
//! some steps faster. The span's excesses add up to what that sampled step cost
//! the training, and the budget reads the median of the last [`RECENT_SAMPLES`]
//! such sums: the sampled steps' costs, robust to a slow step that sampling did not
//! cause (a checkpoint, a data stall).
//!
//! Plain arithmetic on the step times it is given, so the tests feed it synthetic
//! ones.

use std::collections::VecDeque;

/// Baseline steps kept (the most recent).
pub const BASELINE_STEPS: usize = 64;

/// Baseline steps needed before an excess is recorded.
pub const MIN_BASELINE: usize = 8;

/// Sampled steps' costs kept for the budget's estimate.
pub const RECENT_SAMPLES: usize = 16;

/// The running record of step times and the sampled steps' excess over them.
#[derive(Debug, Clone, Default)]
pub struct Slowdown {
    /// Step times (ms) of recent steps with no sample work in flight, oldest first.
    baseline: VecDeque<f64>,
    /// A sampled step's span is open.
    open: bool,
    /// The span's work has completed; the next step is its last.
    closing: bool,
    /// The open span's excess so far (ms); `None` while the baseline was too short.
    current: Option<f64>,
    /// The last sampled steps' costs (ms), oldest first.
    recent: VecDeque<f64>,
    /// All sampled steps' costs added up (ms), and how many.
    total_ms: f64,
    counted: u64,
}

impl Slowdown {
    /// A step ended after `step_ms`: `sampled` if it took samples, `in_flight` if
    /// sample work was still in flight at its end. Returns its excess over the
    /// baseline (ms) when it belongs to a sampled step's span and the baseline has
    /// [`MIN_BASELINE`] steps; `None` otherwise.
    pub fn step(&mut self, step_ms: f64, sampled: bool, in_flight: bool) -> Option<f64> {
        if !step_ms.is_finite() || step_ms < 0.0 {
            return None;
        }
        if sampled {
            self.close_span();
            self.open = true;
        }
        if !self.open {
            if self.baseline.len() == BASELINE_STEPS {
                self.baseline.pop_front();
            }
            self.baseline.push_back(step_ms);
            return None;
        }
        let excess = self.median().map(|m| step_ms - m);
        if let Some(e) = excess {
            *self.current.get_or_insert(0.0) += e;
        }
        if in_flight {
            self.closing = false;
        } else if self.closing {
            self.close_span();
        } else {
            self.closing = true;
        }
        excess
    }

    /// The median of the baseline, once it has [`MIN_BASELINE`] steps.
    pub fn median(&self) -> Option<f64> {
        (self.baseline.len() >= MIN_BASELINE).then(|| median(self.baseline.iter().copied()))
    }

    /// What a sampled step costs the training (ms): the median of the recent
    /// sampled steps' excesses, at least 0; `None` before the first is known.
    pub fn per_sample_ms(&self) -> Option<f64> {
        (!self.recent.is_empty()).then(|| median(self.recent.iter().copied()).max(0.0))
    }

    /// All sampled steps' costs added up (ms, signed), and how many were counted.
    pub fn total(&self) -> (f64, u64) {
        (self.total_ms, self.counted)
    }

    fn close_span(&mut self) {
        if let Some(cost) = self.current.take() {
            if self.recent.len() == RECENT_SAMPLES {
                self.recent.pop_front();
            }
            self.recent.push_back(cost);
            self.total_ms += cost;
            self.counted += 1;
        }
        self.open = false;
        self.closing = false;
    }
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return 0.0;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic step-time noise in [-1, 1).
    fn noise(state: &mut u64) -> f64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        (*state % 2000) as f64 / 1000.0 - 1.0
    }

    #[test]
    fn a_sampled_steps_cost_is_its_excess_over_the_baseline() {
        let mut s = Slowdown::default();
        let mut rng = 0x9e37_79b9_7f4a_7c15;
        for step in 0..2000u64 {
            let sampled = step % 10 == 0;
            // 20 ms ± 1 ms a step; a sampled step 5 ms more, the step after it 1 ms
            // more (its work still in flight at the sampled step's end).
            let extra = if sampled {
                5.0
            } else if step % 10 == 1 {
                1.0
            } else {
                0.0
            };
            let excess = s.step(20.0 + noise(&mut rng) + extra, sampled, sampled);
            match step % 10 {
                // A span: the sampled step, the one after it (work in flight), and
                // one more.
                0..=2 if step >= 20 => assert!(excess.is_some(), "step {step}"),
                3..=9 => assert!(excess.is_none(), "step {step}"),
                _ => {}
            }
        }
        let per_sample = s.per_sample_ms().unwrap();
        assert!((per_sample - 6.0).abs() < 1.5, "{per_sample}");
        let (total, counted) = s.total();
        assert_eq!(counted, 198);
        assert!((total / counted as f64 - 6.0).abs() < 0.5, "{total}");
    }

    #[test]
    fn without_a_cost_the_estimate_is_near_zero() {
        let mut s = Slowdown::default();
        let mut rng = 0x2545_f491_4f6c_dd1d;
        for step in 0..3000u64 {
            // Right-skewed noise: mostly 10 ms, sometimes much more.
            let n = noise(&mut rng);
            let ms = 10.0 + if n > 0.9 { 30.0 * (n - 0.9) * 10.0 } else { n };
            s.step(ms, step % 10 == 0, false);
        }
        let per_sample = s.per_sample_ms().unwrap();
        assert!(per_sample < 1.0, "{per_sample}");
    }

    #[test]
    fn a_span_lasts_while_work_is_in_flight() {
        let mut s = Slowdown::default();
        for _ in 0..MIN_BASELINE {
            assert_eq!(s.step(10.0, false, false), None);
        }
        // Sampled, then 3 steps with work in flight, then one more: 5 steps.
        assert_eq!(s.step(14.0, true, true), Some(4.0));
        for _ in 0..3 {
            assert_eq!(s.step(11.0, false, true), Some(1.0));
        }
        assert_eq!(s.step(10.0, false, false), Some(0.0));
        assert_eq!(s.step(10.0, false, false), Some(0.0));
        assert_eq!(s.step(10.0, false, false), None);
        assert_eq!(s.per_sample_ms(), Some(7.0));
    }

    #[test]
    fn no_excess_before_the_baseline_has_enough_steps() {
        let mut s = Slowdown::default();
        assert_eq!(s.step(100.0, true, false), None);
        assert_eq!(s.step(10.0, false, false), None);
        assert_eq!(s.per_sample_ms(), None);
        assert_eq!(s.step(f64::NAN, false, false), None);
        assert_eq!(s.step(-1.0, false, false), None);
    }
}
