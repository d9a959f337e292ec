//! Which planned activation samples are taken: the overhead budget applied to a
//! running agent. The [`Sampler`] holds the sample counters, the agent's CPU time
//! (its time on the training thread, the metrics thread's self-reported CPU time,
//! the transport thread's CPU clock) and the [`BudgetController`].
//!
//! A planned sample (a step where `step % RANKSCOPE_SAMPLE_EVERY == 0`) is decided
//! when its step begins, before any work: taken, or skipped and counted. A skipped
//! step counts as many skipped samples as the last sampled step took. A sample is
//! also skipped, before any work, when the metrics thread's queue is full, so no
//! sample is taken only to be dropped. Drops are what is left: a sample libtorch
//! failed to prepare, or one still queued when `finish` stopped waiting.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use super::controller::{BudgetController, CpuTimes, OverheadBudget, SampleCost};
use super::cpu_clock::{self, ThreadClock};

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
    /// The worker thread's CPU time, as it last read its own clock.
    pub cpu_ns: AtomicU64,
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
    /// `taken + skipped_queue_full` when the last planned sample was taken.
    seen_at_take: u64,
    last_taken: bool,
}

#[derive(Debug)]
pub(crate) struct Sampler {
    gate: Mutex<Gate>,
    started: Instant,
    process_at_start: Option<u64>,
    transport_clock: Option<ThreadClock>,
    /// The transport thread's CPU time at its last read; frozen at finish.
    transport_ns: AtomicU64,
    frozen: AtomicBool,
    pub worker: Arc<WorkerCounters>,
    /// Samples taken on the training thread, and handed to the metrics thread.
    taken: AtomicU64,
    handed: AtomicU64,
    /// Samples libtorch failed to prepare, or the queue refused.
    dropped: AtomicU64,
    skipped_budget: AtomicU64,
    skipped_queue_full: AtomicU64,
    /// The training thread's time preparing samples (the first alone), and all
    /// its time in the agent.
    training_sample_ns: AtomicU64,
    first_sample_ns: AtomicU64,
    training_ns: AtomicU64,
}

impl Sampler {
    pub fn new(budget: OverheadBudget, transport_clock: Option<ThreadClock>) -> Sampler {
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
            frozen: AtomicBool::new(false),
            worker: Arc::default(),
            taken: AtomicU64::new(0),
            handed: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            skipped_budget: AtomicU64::new(0),
            skipped_queue_full: AtomicU64::new(0),
            training_sample_ns: AtomicU64::new(0),
            first_sample_ns: AtomicU64::new(0),
            training_ns: AtomicU64::new(0),
        }
    }

    /// At the start of a step with a planned sample: whether it is taken.
    pub fn decide(&self) -> bool {
        let mut gate = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        let seen =
            self.taken.load(Ordering::Relaxed) + self.skipped_queue_full.load(Ordering::Relaxed);
        if gate.last_taken {
            gate.per_step = seen.saturating_sub(gate.seen_at_take);
        }
        let cost = SampleCost {
            taken: self.taken.load(Ordering::Relaxed),
            training_ns: self.training_sample_ns.load(Ordering::Relaxed),
            first_training_ns: self.first_sample_ns.load(Ordering::Relaxed),
            measured: self.worker.done.load(Ordering::Relaxed),
            worker_ns: self.worker.cpu_ns.load(Ordering::Relaxed),
            first_worker_ns: self.worker.first_ns.load(Ordering::Relaxed),
        };
        let queued = self.queued();
        let take = match self.cpu_times() {
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

    /// Whether the metrics thread's queue (of `capacity`) has room for one more
    /// sample; if not, the sample is counted as skipped.
    pub fn room_for_one(&self, capacity: usize) -> bool {
        let room = self.queued() < capacity as u64;
        if !room {
            self.skipped_queue_full.fetch_add(1, Ordering::Relaxed);
        }
        room
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

    /// Adds the training thread's time in the agent; `sampling` when it was spent
    /// taking a sample.
    pub fn add_training_ns(&self, ns: u64, sampling: bool) {
        self.training_ns.fetch_add(ns, Ordering::Relaxed);
        if sampling && self.training_sample_ns.fetch_add(ns, Ordering::Relaxed) == 0 {
            self.first_sample_ns.store(ns, Ordering::Relaxed);
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
        }
    }

    pub fn overhead(&self) -> Overhead {
        let now = self.cpu_times().unwrap_or_default();
        Overhead {
            budget: self.budget(),
            agent_ns: now.agent_ns,
            training_ns: self.training_ns.load(Ordering::Relaxed),
            training_sample_ns: self.training_sample_ns.load(Ordering::Relaxed),
            metrics_ns: self.worker.cpu_ns.load(Ordering::Relaxed),
            transport_ns: self.transport_ns.load(Ordering::Relaxed),
            process_ns: now.process_ns,
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

    /// The process's and the agent's CPU time since the agent started.
    fn cpu_times(&self) -> Option<CpuTimes> {
        let process_ns = cpu_clock::process_ns()?.saturating_sub(self.process_at_start?);
        let agent_ns = self.training_ns.load(Ordering::Relaxed)
            + self.worker.cpu_ns.load(Ordering::Relaxed)
            + self.transport_cpu_ns();
        Some(CpuTimes {
            process_ns,
            agent_ns,
        })
    }
}
