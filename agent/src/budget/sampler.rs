//! Which planned activation samples are taken: the overhead budget applied to a
//! running agent. The [`Sampler`] holds the sample counters, the agent's CPU time
//! (its time on the training thread, the metrics thread's self-reported CPU time,
//! the transport thread's CPU clock) and the [`BudgetController`].
//!
//! A planned sample (a step where `step % RANKSCOPE_SAMPLE_EVERY == 0`) is decided
//! when its step begins, before any work, for the whole step: every layer of it is
//! taken, or none. The step is skipped, and counted, when the metrics thread's
//! queue has no room for a whole step's samples, or to stay within the overhead
//! budget. A skipped step counts as one skipped step and as many skipped samples as
//! the last sampled step took. Drops are what is left: a sample libtorch failed to
//! prepare, or one still queued when `finish` stopped waiting.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use super::controller::{BudgetController, CpuTimes, OverheadBudget, SampleCost};
use super::cpu_clock::{self, ThreadClock, TickClocks};

/// Activation samples of one agent (see [`crate::Agent::activation_samples`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ActivationSamples {
    /// Activations sampled on the training thread.
    pub taken: u64,
    /// Of those, not measured: libtorch failed to prepare the sample, or it was
    /// still queued when `finish` stopped waiting for the metrics thread.
    pub dropped: u64,
    /// Planned samples not taken, decided before any work: to stay within the
    /// overhead budget, or because the metrics thread's queue was full.
    pub skipped: u64,
    /// Of the skipped, those skipped because the queue was full.
    pub skipped_queue_full: u64,
    /// Planned steps not sampled (a step is sampled whole or not at all).
    pub steps_skipped: u64,
}

/// The agent's CPU time against the process's, since the agent started.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overhead {
    pub budget: OverheadBudget,
    /// The agent's CPU time: `training_ns + metrics_ns + transport_ns`.
    pub agent_ns: u64,
    /// The agent's time on the training thread (the steps' `overhead_ms`).
    pub training_ns: u64,
    /// Of `training_ns`, the time spent taking activation samples.
    pub training_sample_ns: u64,
    /// The metrics thread's CPU time.
    pub metrics_ns: u64,
    /// The transport thread's CPU time.
    pub transport_ns: u64,
    /// The whole process's CPU time since the agent started.
    pub process_ns: u64,
    /// The one-time set-up of the agent's threads at `init`, left out of
    /// `agent_ns`, `metrics_ns`, `transport_ns` and `process_ns`: the metrics
    /// thread's warm-up (its start included) and the transport thread's start and
    /// first connection.
    pub set_up_ns: u64,
}

impl Overhead {
    /// The agent's share of the process's CPU time (0.02 for 2 %).
    pub fn share(&self) -> Option<f64> {
        (self.process_ns > 0).then(|| self.agent_ns as f64 / self.process_ns as f64)
    }
}

/// Counters shared with the metrics thread.
#[derive(Debug, Default)]
pub(crate) struct WorkerCounters {
    /// Samples the worker is done with (measured or skipped at finish).
    pub done: AtomicU64,
    /// The worker thread's CPU time, as it last read its own clock, less its
    /// warm-up.
    pub cpu_ns: AtomicU64,
    /// The worker thread's CPU time up to the end of its warm-up (its start
    /// included): one-time set-up at `init`, left out of the budget on both sides.
    pub warm_up_ns: AtomicU64,
    /// Its CPU time at the end of its first sample (its start included).
    pub first_ns: AtomicU64,
    /// Samples dropped (queued when finish stopped waiting).
    pub dropped: AtomicU64,
}

#[derive(Debug)]
struct Gate {
    controller: BudgetController,
    /// Samples one sampled step takes (the last sampled step's count).
    per_step: u64,
    /// `taken` when the last planned sample was taken.
    seen_at_take: u64,
    last_taken: bool,
}

/// Which readings of the process's and the transport thread's clocks
/// [`Sampler::cpu_times`] uses.
#[derive(Debug, Clone, Copy)]
enum Clocks {
    /// The transport thread's, from its last tick: a budget decision's.
    LastTick,
    /// Read now, on the calling thread: the report at finish.
    Now,
}

#[derive(Debug)]
pub(crate) struct Sampler {
    gate: Mutex<Gate>,
    started: Instant,
    process_at_start: Option<u64>,
    transport_clock: Option<ThreadClock>,
    /// The transport thread's CPU time at its last read; frozen at finish.
    transport_ns: AtomicU64,
    /// The transport thread's one-time set-up (its start and first connection),
    /// left out like the metrics thread's warm-up.
    transport_set_up_ns: Arc<AtomicU64>,
    /// The process's and the transport thread's CPU time as the transport thread
    /// last read them: what a decision reads (see [`TickClocks`]).
    tick_clocks: Arc<TickClocks>,
    frozen: AtomicBool,
    pub worker: Arc<WorkerCounters>,
    /// Samples taken on the training thread, and handed to the metrics thread.
    taken: AtomicU64,
    handed: AtomicU64,
    /// Samples libtorch failed to prepare, or the queue refused.
    dropped: AtomicU64,
    skipped_budget: AtomicU64,
    skipped_queue_full: AtomicU64,
    steps_skipped: AtomicU64,
    /// The training thread's time on sampled steps' samples (and up to the end of
    /// the first sample alone), and all its time in the agent.
    training_sample_ns: AtomicU64,
    first_sample_ns: AtomicU64,
    training_ns: AtomicU64,
}

impl Sampler {
    /// A sampler holding the agent to `budget`, reading the transport thread's clock
    /// (`None`: not counted) and leaving out its set-up time, `transport_set_up_ns`.
    pub fn new(
        budget: OverheadBudget,
        transport_clock: Option<ThreadClock>,
        transport_set_up_ns: Arc<AtomicU64>,
        tick_clocks: Arc<TickClocks>,
    ) -> Sampler {
        Sampler {
            gate: Mutex::new(Gate {
                controller: BudgetController::new(budget),
                per_step: 0,
                seen_at_take: 0,
                last_taken: false,
            }),
            started: Instant::now(),
            process_at_start: cpu_clock::process_ns(),
            transport_clock,
            transport_ns: AtomicU64::new(0),
            transport_set_up_ns,
            tick_clocks,
            frozen: AtomicBool::new(false),
            worker: Arc::default(),
            taken: AtomicU64::new(0),
            handed: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            skipped_budget: AtomicU64::new(0),
            skipped_queue_full: AtomicU64::new(0),
            steps_skipped: AtomicU64::new(0),
            training_sample_ns: AtomicU64::new(0),
            first_sample_ns: AtomicU64::new(0),
            training_ns: AtomicU64::new(0),
        }
    }

    /// At the start of a step with a planned sample: whether it is taken, whole.
    /// It is when the metrics thread's queue has room for all of the step's samples
    /// (as many as the last sampled step took; the queue holds `capacity`, or one
    /// step's samples where a step takes more) and the overhead budget allows them.
    pub fn decide(&self, capacity: usize) -> bool {
        let mut gate = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        let seen = self.taken.load(Ordering::Relaxed);
        if gate.last_taken {
            gate.per_step = seen.saturating_sub(gate.seen_at_take);
        }
        let queued = self.queued();
        if queued + gate.per_step > (capacity as u64).max(gate.per_step) {
            self.skipped_queue_full
                .fetch_add(gate.per_step, Ordering::Relaxed);
            self.steps_skipped.fetch_add(1, Ordering::Relaxed);
            gate.last_taken = false;
            return false;
        }
        let cost = SampleCost {
            taken: self.taken.load(Ordering::Relaxed),
            training_ns: self.training_sample_ns.load(Ordering::Relaxed),
            first_training_ns: self.first_sample_ns.load(Ordering::Relaxed),
            measured: self.worker.done.load(Ordering::Relaxed),
            worker_ns: self.worker.cpu_ns.load(Ordering::Relaxed),
            first_worker_ns: self.worker.first_ns.load(Ordering::Relaxed),
        };
        let take = match self.cpu_times(Clocks::LastTick) {
            Some(now) => {
                let expected = cost.expected_ns(queued, gate.per_step);
                gate.controller
                    .allows(self.started.elapsed(), now, expected)
            }
            // No process clock: nothing to hold a budget against.
            None => true,
        };
        if take {
            gate.seen_at_take = seen;
        } else {
            let skipped = gate.per_step;
            self.skipped_budget.fetch_add(skipped, Ordering::Relaxed);
            self.steps_skipped.fetch_add(1, Ordering::Relaxed);
        }
        gate.last_taken = take;
        take
    }

    /// Samples handed to the metrics thread and not yet done.
    pub fn queued(&self) -> u64 {
        self.handed
            .load(Ordering::Relaxed)
            .saturating_sub(self.worker.done.load(Ordering::Relaxed))
    }

    /// A sample is being taken.
    pub fn taken(&self) {
        self.taken.fetch_add(1, Ordering::Relaxed);
    }

    /// The sample just taken went to the metrics thread, or was dropped.
    pub fn handed(&self, sent: bool) {
        if sent {
            self.handed.fetch_add(1, Ordering::Relaxed);
        } else {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A sample counted as handed over was dropped after all (the metrics thread's
    /// queue refused it).
    pub fn handed_then_dropped(&self) {
        self.handed.fetch_sub(1, Ordering::Relaxed);
        self.dropped.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds the training thread's time in the agent; `sampling` when it was spent
    /// because a step is sampled (taking a sample, or a binding's hooks for it).
    /// Until the first sample is taken, that time counts as the first sample's.
    pub fn add_training_ns(&self, ns: u64, sampling: bool) {
        self.training_ns.fetch_add(ns, Ordering::Relaxed);
        if sampling {
            let total = self.training_sample_ns.fetch_add(ns, Ordering::Relaxed) + ns;
            if self.taken.load(Ordering::Relaxed) <= 1 {
                self.first_sample_ns.store(total, Ordering::Relaxed);
            }
        }
    }

    pub fn samples(&self) -> ActivationSamples {
        let skipped_queue_full = self.skipped_queue_full.load(Ordering::Relaxed);
        ActivationSamples {
            taken: self.taken.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed)
                + self.worker.dropped.load(Ordering::Relaxed),
            skipped: self.skipped_budget.load(Ordering::Relaxed) + skipped_queue_full,
            skipped_queue_full,
            steps_skipped: self.steps_skipped.load(Ordering::Relaxed),
        }
    }

    pub fn overhead(&self) -> Overhead {
        let now = self.cpu_times(Clocks::Now).unwrap_or_default();
        Overhead {
            budget: self.budget(),
            agent_ns: now.agent_ns,
            training_ns: self.training_ns.load(Ordering::Relaxed),
            training_sample_ns: self.training_sample_ns.load(Ordering::Relaxed),
            metrics_ns: self.worker.cpu_ns.load(Ordering::Relaxed),
            transport_ns: self
                .transport_ns
                .load(Ordering::Relaxed)
                .saturating_sub(self.transport_set_up()),
            process_ns: now.process_ns,
            set_up_ns: self.set_up(),
        }
    }

    pub fn budget(&self) -> OverheadBudget {
        self.gate
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .controller
            .budget()
    }

    /// Stops reading the transport thread's clock (before it is joined).
    pub fn freeze(&self) {
        self.transport_cpu_ns();
        self.frozen.store(true, Ordering::Relaxed);
    }

    fn transport_cpu_ns(&self) -> u64 {
        if !self.frozen.load(Ordering::Relaxed)
            && let Some(ns) = self.transport_clock.and_then(ThreadClock::read_ns)
        {
            self.transport_ns.fetch_max(ns, Ordering::Relaxed);
        }
        self.transport_ns.load(Ordering::Relaxed)
    }

    /// The transport thread's set-up time (0 until it is known).
    fn transport_set_up(&self) -> u64 {
        self.transport_set_up_ns.load(Ordering::Relaxed)
    }

    /// The agent's threads' one-time set-up at `init` (see [`Overhead::set_up_ns`]).
    fn set_up(&self) -> u64 {
        self.worker.warm_up_ns.load(Ordering::Relaxed) + self.transport_set_up()
    }

    /// The process's and the agent's CPU time since the agent started, both without
    /// the set-up of the agent's threads at `init` (not a sample's cost).
    fn cpu_times(&self, clocks: Clocks) -> Option<CpuTimes> {
        let (process_ns, transport_ns) = match clocks {
            // As last read off this thread (a read can take milliseconds on a
            // loaded machine); read here only before the first tick.
            Clocks::LastTick => (
                self.tick_clocks.process_ns().or_else(cpu_clock::process_ns),
                match self.tick_clocks.transport_ns() {
                    Some(ns) => self.transport_ns.load(Ordering::Relaxed).max(ns),
                    None => self.transport_cpu_ns(),
                },
            ),
            Clocks::Now => (cpu_clock::process_ns(), self.transport_cpu_ns()),
        };
        let process_ns = process_ns?
            .saturating_sub(self.process_at_start?)
            .saturating_sub(self.set_up());
        let agent_ns = self.training_ns.load(Ordering::Relaxed)
            + self.worker.cpu_ns.load(Ordering::Relaxed)
            + transport_ns.saturating_sub(self.transport_set_up());
        Some(CpuTimes {
            process_ns,
            agent_ns,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The training side's protocol against a metrics thread that falls behind by
    /// random amounts: a step is decided once, then takes all its layers or none.
    /// Whatever the layers per step and the worker's pace, the queue never holds
    /// more than `max(capacity, layers per step)` samples, and a step is refused
    /// only when the whole step would not fit.
    #[test]
    fn steps_are_admitted_whole_and_the_queue_stays_bounded() {
        const CAPACITY: usize = 16;
        let mut rng = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = |bound: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % bound
        };
        for _case in 0..200 {
            let sampler = Sampler::new(
                OverheadBudget::from_percent(100.0).unwrap(),
                None,
                Arc::default(),
                Arc::default(),
            );
            let layers = 1 + next(40);
            let (mut admitted, mut refused) = (0, 0);
            for _step in 0..300 {
                let before = sampler.queued();
                if sampler.decide(CAPACITY) {
                    admitted += 1;
                    for _ in 0..layers {
                        sampler.taken();
                        sampler.handed(true);
                    }
                } else {
                    refused += 1;
                    assert!(
                        before + layers > CAPACITY.max(layers as usize) as u64,
                        "a step was refused with room for it ({before} queued, {layers} layers)"
                    );
                }
                assert!(sampler.queued() <= CAPACITY.max(layers as usize) as u64);
                // The worker finishes a random number of the queued samples.
                let done = next(sampler.queued() + 1);
                sampler.worker.done.fetch_add(done, Ordering::Relaxed);
            }
            let samples = sampler.samples();
            assert_eq!(samples.taken, admitted * layers);
            assert_eq!(samples.steps_skipped, refused);
            assert!(admitted > 0);
        }
    }
}
