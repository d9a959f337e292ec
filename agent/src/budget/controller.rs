//! The overhead budget (`RANKSCOPE_OVERHEAD_BUDGET`): the share of the process's
//! CPU time the agent may use, and the controller that keeps it there by taking
//! fewer activation samples.
//!
//! The agent's CPU time is measured, not estimated: the CPU clocks of its metrics
//! and transport threads ([`super::cpu_clock`]) plus its time on the training
//! thread (the `overhead_ms` of the step rows). The process's CPU time is
//! `CLOCK_PROCESS_CPUTIME_ID`. The one-time set-up of the agent's threads at `init`
//! (the metrics thread's warm-up, the transport thread's start and first
//! connection) is left out of both (`budget::sampler`). Both are read at each planned sample (every
//! `RANKSCOPE_SAMPLE_EVERY` steps), never on other steps: the process's and the
//! transport thread's clocks as the transport thread last read them (every 100 ms),
//! since reading them from the training thread can take milliseconds on a loaded
//! machine ([`super::cpu_clock::TickClocks`]).
//!
//! At a planned sample the [`BudgetController`] looks at a sliding window: the
//! agent's and the process's CPU time since a mark about [`WINDOW`] ago. The sample
//! is taken when the agent's time in the window, plus what the sample is expected
//! to cost (learned from the samples so far, [`SampleCost`]) and what the metrics
//! thread still has queued, stays within the budget's share of the process's time;
//! otherwise it is skipped before any work is done. When one sample costs more
//! than the budget of a whole window, the window widens until it holds
//! [`WIDEN`] such samples, so an expensive sample is taken less often rather than
//! never. The first planned sample is always taken: it tells what a sample costs.
//!
//! The controller is plain arithmetic on the times it is given, so the tests feed
//! it synthetic CPU times.

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

/// The sliding window's length (wall time), unless one sample needs a longer one.
pub const WINDOW: Duration = Duration::from_secs(30);

/// A window holds the budget of at least this many samples.
pub const WIDEN: u64 = 8;

/// Marks kept per window: a new mark is set at most every `WINDOW / MARKS`, so
/// the window's start is exact to about 1/`MARKS` of its length.
const MARKS: u32 = 64;

/// Marks kept at most, however wide the window grows.
const MAX_MARKS: usize = 4096;

/// The agent's share of the process's CPU time, as a percentage (`2%`).
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct OverheadBudget {
    percent: f64,
}

impl Default for OverheadBudget {
    fn default() -> Self {
        OverheadBudget::DEFAULT
    }
}

impl OverheadBudget {
    /// `2%`.
    pub const DEFAULT: OverheadBudget = OverheadBudget { percent: 2.0 };

    /// A budget of `percent` % (above 0, at most 100).
    pub fn from_percent(percent: f64) -> Option<OverheadBudget> {
        (percent > 0.0 && percent <= 100.0).then_some(OverheadBudget { percent })
    }

    /// A budget of `fraction` of the process's CPU time (above 0, at most 1): `0.02`
    /// is 2 %, the form the `runs` table stores. The percentage is rounded to 10⁻⁹ %,
    /// so that `0.05` is 5 % exactly, as `"5%"` is, and gives back the fraction 0.05.
    pub fn from_fraction(fraction: f64) -> Option<OverheadBudget> {
        let percent = (fraction * 100.0 * 1e9).round() / 1e9;
        (fraction > 0.0 && percent.is_finite())
            .then(|| OverheadBudget::from_percent(percent))
            .flatten()
    }

    /// Parses `2%`, `0.5 %` or `100%`; the `%` sign is required, so `0.02` is not
    /// mistaken for 2 %.
    pub fn parse(text: &str) -> Option<OverheadBudget> {
        let number = text.trim().strip_suffix('%')?.trim();
        let percent = number.parse::<f64>().ok().filter(|p| p.is_finite())?;
        OverheadBudget::from_percent(percent)
    }

    pub fn percent(self) -> f64 {
        self.percent
    }

    /// The budget as a fraction of the process's CPU time (0.02 for 2 %).
    pub fn fraction(self) -> f64 {
        self.percent / 100.0
    }

    /// `100%`: every planned sample is taken, whatever it costs.
    pub fn is_unlimited(self) -> bool {
        self.percent >= 100.0
    }
}

impl fmt::Display for OverheadBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}%", self.percent)
    }
}

/// Cumulative CPU times in nanoseconds: the whole process's and the agent's part of it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuTimes {
    pub process_ns: u64,
    pub agent_ns: u64,
}

impl CpuTimes {
    /// The agent's share of the process's time from `earlier` to `self`.
    pub fn share_since(self, earlier: CpuTimes) -> Option<f64> {
        let process = self.process_ns.saturating_sub(earlier.process_ns);
        let agent = self.agent_ns.saturating_sub(earlier.agent_ns);
        (process > 0).then(|| agent as f64 / process as f64)
    }
}

/// What one activation sample costs the agent, learned from the samples so far:
/// the training thread's time to prepare it plus the metrics thread's CPU time to
/// measure it.
///
/// The first sample also pays for one-time work (libtorch's first calls on each
/// thread, the metrics thread's start): once a second sample is in, the estimate
/// leaves the first one out, so a cheap sample is not taken for an expensive one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SampleCost {
    /// Samples handed to the metrics thread, and the training thread's time on
    /// them (on the first of them alone).
    pub taken: u64,
    pub training_ns: u64,
    pub first_training_ns: u64,
    /// Samples the metrics thread has finished, and its CPU time so far (up to the
    /// end of its first sample, its start included).
    pub measured: u64,
    pub worker_ns: u64,
    pub first_worker_ns: u64,
}

/// `total` spread over `count` samples, leaving out the first (`first`) once there
/// are others.
fn per_sample(total: u64, first: u64, count: u64) -> u64 {
    if count >= 2 {
        total.saturating_sub(first) / (count - 1)
    } else {
        total / count.max(1)
    }
}

impl SampleCost {
    /// Nanoseconds per sample; `None` before the first sample.
    pub fn per_sample_ns(&self) -> Option<u64> {
        if self.taken == 0 {
            return None;
        }
        Some(
            per_sample(self.training_ns, self.first_training_ns, self.taken)
                + self.worker_ns_per_sample(),
        )
    }

    /// The metrics thread's CPU time per sample (its time so far while it has not
    /// finished one: a lower bound).
    pub fn worker_ns_per_sample(&self) -> u64 {
        per_sample(self.worker_ns, self.first_worker_ns, self.measured)
    }

    /// The agent's time still to come for `queued` samples waiting for the metrics
    /// thread, plus `next` samples about to be taken; `None` before the first sample.
    pub fn expected_ns(&self, queued: u64, next: u64) -> Option<u64> {
        let per_sample = self.per_sample_ns()?;
        Some(
            queued
                .saturating_mul(self.worker_ns_per_sample())
                .saturating_add(next.saturating_mul(per_sample)),
        )
    }
}

#[derive(Debug, Clone, Copy)]
struct Mark {
    /// Wall time since the controller started.
    at: Duration,
    cpu: CpuTimes,
}

/// Decides, at each planned sample, whether the budget has room for it.
#[derive(Debug, Clone)]
pub struct BudgetController {
    budget: OverheadBudget,
    window: Duration,
    /// Oldest first; the front is the window's start.
    marks: VecDeque<Mark>,
}

impl BudgetController {
    /// A controller whose times start at zero, with the default [`WINDOW`].
    pub fn new(budget: OverheadBudget) -> BudgetController {
        BudgetController::with_window(budget, WINDOW)
    }

    pub fn with_window(budget: OverheadBudget, window: Duration) -> BudgetController {
        BudgetController {
            budget,
            window,
            marks: VecDeque::from([Mark {
                at: Duration::ZERO,
                cpu: CpuTimes::default(),
            }]),
        }
    }

    pub fn budget(&self) -> OverheadBudget {
        self.budget
    }

    /// Whether a planned sample is taken, at wall time `at` (since the controller
    /// started) with the cumulative CPU times `now`. `expected_ns` is what the
    /// sample and the work still queued will cost the agent; `None` when the cost
    /// is not known yet (no sample taken so far): the sample is taken to learn it.
    /// The sampler reads [`BudgetController::demand`]; the tests ask this.
    #[cfg(test)]
    pub fn allows(&mut self, at: Duration, now: CpuTimes, expected_ns: Option<u64>) -> bool {
        self.demand(at, now, expected_ns) <= 1.0
    }

    /// Whether a sample is allowed, as a number: the agent's time in the window plus
    /// `expected_ns`, against the budget's share of the process's time in it (at most
    /// 1: allowed). 0 when the cost is not known yet or the budget is unlimited.
    pub fn demand(&mut self, at: Duration, now: CpuTimes, expected_ns: Option<u64>) -> f64 {
        let expected = expected_ns.unwrap_or(0);
        self.mark(at, now, expected);
        if self.budget.is_unlimited() || expected_ns.is_none() {
            return 0.0;
        }
        let start = self.window_start();
        let process = now.process_ns.saturating_sub(start.process_ns);
        let agent = now.agent_ns.saturating_sub(start.agent_ns);
        let need = agent.saturating_add(expected) as f64;
        let room = self.budget.fraction() * process as f64;
        if room > 0.0 {
            need / room
        } else if need > 0.0 {
            f64::INFINITY
        } else {
            0.0
        }
    }

    /// The agent's share of the process's CPU time over the current window.
    pub fn share(&self, now: CpuTimes) -> Option<f64> {
        now.share_since(self.window_start())
    }

    fn window_start(&self) -> CpuTimes {
        self.marks.front().map_or(CpuTimes::default(), |m| m.cpu)
    }

    /// Sets a mark (at most every `window / MARKS`) and moves the window's start
    /// up to about `window` ago, keeping room for [`WIDEN`] samples of `expected_ns`.
    fn mark(&mut self, at: Duration, now: CpuTimes, expected_ns: u64) {
        let spacing = self.window / MARKS;
        if self
            .marks
            .back()
            .is_none_or(|last| at.saturating_sub(last.at) >= spacing)
        {
            self.marks.push_back(Mark { at, cpu: now });
        }
        let room = WIDEN.saturating_mul(expected_ns) as f64;
        while self.marks.len() > 1 {
            let next = self.marks[1];
            let too_many = self.marks.len() > MAX_MARKS;
            let old = at.saturating_sub(next.at) >= self.window;
            let still_wide = self.budget.fraction()
                * now.process_ns.saturating_sub(next.cpu.process_ns) as f64
                >= room;
            if too_many || (old && still_wide) {
                self.marks.pop_front();
            } else {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn budgets_parse_with_a_percent_sign_only() {
        assert_eq!(OverheadBudget::parse("2%").map(|b| b.percent()), Some(2.0));
        assert_eq!(
            OverheadBudget::parse(" 0.5 % ").map(|b| b.fraction()),
            Some(0.005)
        );
        assert!(OverheadBudget::parse("100%").unwrap().is_unlimited());
        for bad in [
            "2", "0.02", "0%", "-1%", "101%", "NaN%", "inf%", "%", "two%",
        ] {
            assert_eq!(OverheadBudget::parse(bad), None, "{bad}");
        }
        assert_eq!(OverheadBudget::default().to_string(), "2%");
    }

    #[test]
    fn budgets_from_a_fraction_are_the_percentages_they_name() {
        for (fraction, text) in [(0.05, "5%"), (0.02, "2%"), (0.005, "0.5%"), (1.0, "100%")] {
            let budget = OverheadBudget::from_fraction(fraction).unwrap();
            assert_eq!(Some(budget), OverheadBudget::parse(text), "{fraction}");
            assert_eq!(budget.fraction(), fraction);
        }
        for bad in [0.0, -0.05, 1.01, f64::NAN, f64::INFINITY, 5.0] {
            assert_eq!(OverheadBudget::from_fraction(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_first_sample_is_taken_to_learn_its_cost() {
        let mut c = BudgetController::new(OverheadBudget::DEFAULT);
        let now = CpuTimes {
            process_ns: 0,
            agent_ns: 5 * MS,
        };
        assert!(c.allows(Duration::ZERO, now, None));
        assert!(!c.allows(Duration::ZERO, now, Some(MS)));
    }

    /// A training loop on synthetic clocks: each step costs the process `step_ns`
    /// of CPU time plus whatever the agent spends; a sampled step costs the agent
    /// `sample_ns`. Returns (samples taken, the agent's share of the whole run).
    fn simulate(
        budget: &str,
        step_ns: u64,
        sample_ns: u64,
        steps: u64,
        sample_every: u64,
    ) -> (u64, f64) {
        let mut c = BudgetController::new(OverheadBudget::parse(budget).unwrap());
        let mut cpu = CpuTimes::default();
        let mut wall = Duration::ZERO;
        let mut cost = SampleCost::default();
        let mut taken = 0;
        for step in 0..steps {
            if step % sample_every == 0 && c.allows(wall, cpu, cost.expected_ns(0, 1)) {
                taken += 1;
                cost.taken += 1;
                cost.measured += 1;
                cost.worker_ns += sample_ns;
                cpu.agent_ns += sample_ns;
                cpu.process_ns += sample_ns;
            }
            cpu.process_ns += step_ns;
            // One core: wall time is CPU time.
            wall += Duration::from_nanos(step_ns);
        }
        (taken, cpu.agent_ns as f64 / cpu.process_ns as f64)
    }

    #[test]
    fn the_share_stays_within_the_budget_and_uses_most_of_it() {
        // (budget, step, sample cost, sample every): the sample would cost 10 %,
        // 100 %, 1000 % and 0.1 % of the process's time if always taken.
        let cases = [
            ("2%", 10 * MS, MS, 1),
            ("2%", 10 * MS, 10 * MS, 1),
            ("2%", 10 * MS, 100 * MS, 10),
            ("0.5%", 50 * MS, 5 * MS, 1),
        ];
        for (budget, step_ns, sample_ns, every) in cases {
            let fraction = OverheadBudget::parse(budget).unwrap().fraction();
            let (taken, share) = simulate(budget, step_ns, sample_ns, 60_000, every);
            assert!(
                share <= fraction * 1.01,
                "{budget} {step_ns} {sample_ns}: share {share} over the budget"
            );
            assert!(
                share >= fraction * 0.8,
                "{budget} {step_ns} {sample_ns}: share {share}, only {taken} samples"
            );
        }
    }

    #[test]
    fn a_cheap_sample_is_always_taken() {
        // 0.1 % of the process's time per sample: well within 2 %.
        let (taken, share) = simulate("2%", 10 * MS, 10_000, 5_000, 1);
        assert_eq!(taken, 5_000);
        assert!(share < 0.002);
    }

    #[test]
    fn an_unlimited_budget_takes_every_planned_sample() {
        let (taken, _) = simulate("100%", MS, 10 * MS, 1_000, 3);
        assert_eq!(taken, 334);
    }

    #[test]
    fn the_first_samples_one_time_cost_leaves_the_estimate_once_others_are_in() {
        // The first sample: 1 ms on the training thread, 9 ms on the metrics
        // thread (its start and libtorch's first calls); then 0.1 ms + 0.5 ms each.
        let first = SampleCost {
            taken: 1,
            training_ns: MS,
            first_training_ns: MS,
            measured: 1,
            worker_ns: 9 * MS,
            first_worker_ns: 9 * MS,
        };
        assert_eq!(first.per_sample_ns(), Some(10 * MS));
        let later = SampleCost {
            taken: 5,
            training_ns: MS + 4 * MS / 10,
            measured: 5,
            worker_ns: 9 * MS + 4 * MS / 2,
            ..first
        };
        assert_eq!(later.per_sample_ns(), Some(MS / 10 + MS / 2));
        assert_eq!(later.expected_ns(2, 4), Some(MS + 4 * (MS / 10 + MS / 2)));
        // Taken but not yet measured: the metrics thread's figure is its first.
        let pending = SampleCost {
            measured: 1,
            worker_ns: 9 * MS,
            ..later
        };
        assert_eq!(pending.worker_ns_per_sample(), 9 * MS);
    }

    #[test]
    fn queued_work_counts_against_the_budget() {
        let mut c = BudgetController::new(OverheadBudget::DEFAULT);
        let now = CpuTimes {
            process_ns: 1_000 * MS,
            agent_ns: 10 * MS,
        };
        // 20 ms allowed, 10 ms used: room for 8 ms more, not for 4 queued samples.
        let cost = SampleCost {
            taken: 10,
            training_ns: 10 * MS,
            first_training_ns: MS,
            measured: 10,
            worker_ns: 10 * MS,
            first_worker_ns: MS,
        };
        assert_eq!(cost.per_sample_ns(), Some(2 * MS));
        assert!(c.allows(Duration::from_secs(1), now, cost.expected_ns(0, 4)));
        assert!(!c.allows(Duration::from_secs(1), now, cost.expected_ns(4, 4)));
    }

    #[test]
    fn the_window_forgets_old_spending() {
        let mut c = BudgetController::new(OverheadBudget::DEFAULT);
        // A burst of agent time early on (the whole first second)...
        let burst = CpuTimes {
            process_ns: 1_000 * MS,
            agent_ns: 1_000 * MS,
        };
        let mut at = Duration::from_secs(1);
        assert!(!c.allows(at, burst, Some(MS)));
        // ... is out of the window once it is WINDOW old, not before.
        let mut cpu = burst;
        let allowed_at = loop {
            at += Duration::from_millis(100);
            cpu.process_ns += 100 * MS;
            if c.allows(at, cpu, Some(MS)) {
                break at;
            }
        };
        assert!(allowed_at >= WINDOW, "{allowed_at:?}");
        assert!(
            allowed_at <= WINDOW + Duration::from_secs(2),
            "{allowed_at:?}"
        );
        assert_eq!(c.share(cpu), Some(0.0));
        assert!(c.marks.len() <= MARKS as usize + 2);
    }
}
