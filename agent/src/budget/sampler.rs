//! Which planned activation samples are taken: the overhead budget applied to a
//! running agent. The [`Sampler`] holds the sample counters, the agent's CPU time
//! (its time on the training thread, the metrics thread's self-reported CPU time,
//! the transport thread's CPU clock) and the [`BudgetController`].
//!
//! A planned sample (a step where `step % RANKSCOPE_SAMPLE_EVERY == 0`) is decided
//! when its step begins, before any work, for the whole step: every layer of it is
//! taken, or none. The step is skipped, and counted, when the metrics thread's
//! queue has no room for a whole step's samples (see [`Sampler::decide`] and
//! [`SECOND_STEP_BYTES`]), or to stay within the overhead budget. A skipped step counts as one skipped step and as many skipped samples as
//! the last sampled step took. Drops are what is left: a sample an adapter could not
//! read, or one still queued when `finish` stopped waiting.
//!
//! The budget holds three shares, and a step is sampled only when each has room:
//! - `cpu`: the agent's CPU time against the process's ([`BudgetController`]);
//! - `device`: the device time of a sampled step's work (an adapter's side stream,
//!   timed with its events) against the wall time since the last sampled step;
//! - `observed`: what a sampled step slows the training by, read off the step times
//!   ([`Slowdown`]), against the same wall time.
//!
//! The last two are a rate: a sampled step costing `c` of either is taken once
//! `c / budget` of wall time has passed since the last one. The share furthest over
//! its room is named when a step is skipped.
//!
//! The floor: a planned step is sampled whatever the budget says once no step was
//! for [`FLOOR_STEPS`] steps, unless that would put a share over [`FLOOR_SLACK`]
//! times its room; a series with one point says nothing.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use std::time::Duration;

use super::controller::{BudgetController, CpuTimes, OverheadBudget, SampleCost};
use super::counts::{ActivationSamples, Overhead};
use super::cpu_clock::{self, ThreadClock, TickClocks};
use super::observed::Slowdown;

/// A planned step is sampled, whatever the budget, once no step was for this many
/// steps (within [`FLOOR_SLACK`]).
pub const FLOOR_STEPS: u64 = 100;

/// The floor's sample is skipped after all where a share would be over this many
/// times its room.
pub const FLOOR_SLACK: f64 = 2.5;

/// The metrics queue takes a second step's samples behind those of one still queued
/// (twice its count: `2 × max(capacity, layers per step)`) only while the samples
/// queued and the step's, at the bytes a sample has held so far, come to at most
/// this. A device's reductions are small (a sketch's summary is 1 MiB, the Gram
/// matrix of a side below 1,024 at most 4 MiB), so a metrics thread a little slower
/// than the planned steps measures most of them rather than every other one; a
/// step of host copies as large as a GPT's (about 1.7 GB at the default row cap)
/// still waits for an empty queue.
pub const SECOND_STEP_BYTES: u64 = 256 << 20;

/// One of the budget's shares (see the module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Share {
    Cpu,
    Device,
    Observed,
}

impl Share {
    /// `cpu`, `device` or `observed`: the share's name in events.
    pub fn label(self) -> &'static str {
        match self {
            Share::Cpu => "cpu",
            Share::Device => "device",
            Share::Observed => "observed",
        }
    }
}

/// The budget's decision on a planned step.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Decision {
    pub take: bool,
    /// A skip limited by another share than the last skip's, or the first skip, or
    /// the first missed floor: what its `budget_limited` event says.
    pub newly_limited: Option<Limited>,
}

/// What a `budget_limited` event says.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Limited {
    pub share: Share,
    /// Planned samples skipped so far.
    pub skipped: u64,
    pub message: String,
}

/// One share's demand on a planned step: what the next sampled step would take
/// against its room (above 1: over the budget), and what it costs (ms).
#[derive(Debug, Clone, Copy)]
struct Demand {
    share: Share,
    ratio: f64,
    cost_ms: f64,
}

/// The three shares' demands, and the wall time the rate shares are held against.
#[derive(Debug, Clone, Copy)]
struct Demands {
    shares: [Demand; 3],
    /// Since the last sampled step, and the budget's part of it (ms).
    since_ms: f64,
    room_ms: f64,
}

impl Demands {
    /// A sentence on `d`, for a `budget_limited` event (made only then: the
    /// decision itself formats nothing).
    fn detail(&self, d: &Demand) -> String {
        let (since, room, cost) = (self.since_ms, self.room_ms, d.cost_ms);
        match d.share {
            Share::Cpu => format!(
                "a sampled step costs the agent {cost:.1} ms of CPU time; the share is held over a window of at least {} s",
                super::controller::WINDOW.as_secs()
            ),
            Share::Device => format!(
                "a sampled step's device work takes {cost:.2} ms; {room:.2} ms fit in the {since:.0} ms since the last sampled step"
            ),
            Share::Observed => format!(
                "a sampled step's slowdown of training is {cost:.2} ms; {room:.2} ms fit in the {since:.0} ms since the last sampled step"
            ),
        }
    }
}

/// Counters shared with the metrics thread.
#[derive(Debug, Default)]
pub(crate) struct WorkerCounters {
    /// Samples the worker is done with (measured or skipped at finish), and the
    /// host memory they held ([`crate::sampling::worker::JobInput::bytes`]).
    pub done: AtomicU64,
    pub done_bytes: AtomicU64,
    /// The metrics threads' CPU time, as each last read its own clock, less their
    /// warm-ups.
    pub cpu_ns: AtomicU64,
    /// The metrics threads' CPU time up to the end of their warm-ups (their starts
    /// included): one-time set-up at `init`, left out of the budget on both sides.
    pub warm_up_ns: AtomicU64,
    /// Its CPU time at the end of its first sample (its start included).
    pub first_ns: AtomicU64,
    /// Samples dropped (queued when finish stopped waiting).
    pub dropped: AtomicU64,
}

impl WorkerCounters {
    /// The worker is done with one more sample, which held `bytes`; returns how many
    /// it was done with before.
    pub fn done_with(&self, bytes: u64) -> u64 {
        self.done_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.done.fetch_add(1, Ordering::Relaxed)
    }
}

#[derive(Debug)]
struct Gate {
    controller: BudgetController,
    /// Samples one sampled step takes (the last sampled step's count).
    per_step: u64,
    /// `taken` when the last planned sample was taken.
    seen_at_take: u64,
    last_taken: bool,
    /// The last sampled step's index and start (wall time since the sampler
    /// started); `None` before the first.
    last_sampled: Option<(u64, Duration)>,
    /// The share that limited the last skip.
    last_limit: Option<Share>,
    /// Whether an event said that the floor was not met.
    floor_missed: bool,
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
    /// Samples taken on the training thread, and handed to the metrics thread (and
    /// the host memory those held).
    taken: AtomicU64,
    handed: AtomicU64,
    handed_bytes: AtomicU64,
    /// Samples libtorch failed to prepare, or the queue refused.
    dropped: AtomicU64,
    skipped_cpu: AtomicU64,
    skipped_device: AtomicU64,
    skipped_observed: AtomicU64,
    skipped_queue_full: AtomicU64,
    steps_skipped: AtomicU64,
    steps_floor: AtomicU64,
    /// The device time of sample work (an adapter's), all of it and since the last
    /// step row took it, and the samples it covers (none: no device side).
    device_ns: AtomicU64,
    /// An adapter's device-side thread's CPU time (see [`Overhead::device_thread_ns`]).
    device_thread_ns: AtomicU64,
    device_row_ns: AtomicU64,
    device_samples: AtomicU64,
    slowdown: Mutex<Slowdown>,
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
                last_sampled: None,
                last_limit: None,
                floor_missed: false,
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
            handed_bytes: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            skipped_cpu: AtomicU64::new(0),
            skipped_device: AtomicU64::new(0),
            skipped_observed: AtomicU64::new(0),
            skipped_queue_full: AtomicU64::new(0),
            steps_skipped: AtomicU64::new(0),
            steps_floor: AtomicU64::new(0),
            device_ns: AtomicU64::new(0),
            device_thread_ns: AtomicU64::new(0),
            device_row_ns: AtomicU64::new(0),
            device_samples: AtomicU64::new(0),
            slowdown: Mutex::default(),
            training_sample_ns: AtomicU64::new(0),
            first_sample_ns: AtomicU64::new(0),
            training_ns: AtomicU64::new(0),
        }
    }

    /// At the start of planned step `step`: whether it is sampled, whole. It is when
    /// the metrics thread's queue has room for all of the step's samples (as many as
    /// the last sampled step took; the queue holds `capacity`, or one step's samples
    /// where a step takes more, and twice that within [`SECOND_STEP_BYTES`]) and each
    /// share of the budget has room for them, or the floor asks for it (see the
    /// module).
    pub fn decide(&self, step: u64, capacity: usize) -> Decision {
        self.decide_at(step, capacity, self.started.elapsed())
    }

    /// [`Sampler::decide`] at wall time `at` since the sampler started.
    fn decide_at(&self, step: u64, capacity: usize, at: Duration) -> Decision {
        let mut gate = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        let seen = self.taken.load(Ordering::Relaxed);
        if gate.last_taken {
            gate.per_step = seen.saturating_sub(gate.seen_at_take);
        }
        let queued = self.queued();
        if !self.queue_has_room(queued, gate.per_step, capacity) {
            self.skipped_queue_full
                .fetch_add(gate.per_step, Ordering::Relaxed);
            self.steps_skipped.fetch_add(1, Ordering::Relaxed);
            gate.last_taken = false;
            return Decision {
                take: false,
                newly_limited: None,
            };
        }
        let demands = self.demands(&mut gate, at, queued);
        let limit = demands
            .shares
            .iter()
            .max_by(|a, b| a.ratio.total_cmp(&b.ratio))
            .copied()
            .expect("three shares");
        let worst = limit.ratio;
        let floor = gate
            .last_sampled
            .is_none_or(|(last, _)| step.saturating_sub(last) >= FLOOR_STEPS);
        let take = worst <= 1.0 || (floor && worst <= FLOOR_SLACK);
        let mut newly_limited = None;
        if take {
            if worst > 1.0 {
                self.steps_floor.fetch_add(1, Ordering::Relaxed);
            }
            gate.seen_at_take = seen;
            gate.last_sampled = Some((step, at));
        } else {
            let counter = match limit.share {
                Share::Cpu => &self.skipped_cpu,
                Share::Device => &self.skipped_device,
                Share::Observed => &self.skipped_observed,
            };
            counter.fetch_add(gate.per_step, Ordering::Relaxed);
            self.steps_skipped.fetch_add(1, Ordering::Relaxed);
            let floor_missed = floor && !gate.floor_missed;
            if gate.last_limit != Some(limit.share) || floor_missed {
                gate.last_limit = Some(limit.share);
                gate.floor_missed |= floor_missed;
                let budget = gate.controller.budget();
                let skipped = self.samples().skipped;
                let why = demands.detail(&limit);
                let floor_note = if floor_missed {
                    format!(
                        "; no step was sampled in the last {FLOOR_STEPS} steps, and the floor samples one only within {FLOOR_SLACK} times the room"
                    )
                } else {
                    String::new()
                };
                newly_limited = Some(Limited {
                    share: limit.share,
                    skipped,
                    message: format!(
                        "planned samples skipped from step {step} to stay within RANKSCOPE_OVERHEAD_BUDGET={budget}: the {} share is {worst:.1} times its room ({why}){floor_note}",
                        limit.share.label()
                    ),
                });
            }
        }
        gate.last_taken = take;
        Decision {
            take,
            newly_limited,
        }
    }

    /// Whether the metrics queue, holding `queued` samples, has room for a step of
    /// `per_step` more: within `max(capacity, per_step)`, or within twice that where
    /// the bytes stay within [`SECOND_STEP_BYTES`] (see there).
    fn queue_has_room(&self, queued: u64, per_step: u64, capacity: usize) -> bool {
        let room = (capacity as u64).max(per_step);
        if queued + per_step <= room {
            return true;
        }
        if queued + per_step > 2 * room {
            return false;
        }
        let handed = self.handed.load(Ordering::Relaxed).max(1);
        let step_bytes = self.handed_bytes.load(Ordering::Relaxed) / handed * per_step;
        self.queued_bytes() + step_bytes <= SECOND_STEP_BYTES
    }

    /// Each share's demand at wall time `at` (see [`Demand`]).
    fn demands(&self, gate: &mut Gate, at: Duration, queued: u64) -> Demands {
        let budget = gate.controller.budget();
        let cost = SampleCost {
            taken: self.taken.load(Ordering::Relaxed),
            training_ns: self.training_sample_ns.load(Ordering::Relaxed),
            first_training_ns: self.first_sample_ns.load(Ordering::Relaxed),
            measured: self.worker.done.load(Ordering::Relaxed),
            worker_ns: self.worker.cpu_ns.load(Ordering::Relaxed),
            first_worker_ns: self.worker.first_ns.load(Ordering::Relaxed),
        };
        let expected = cost.expected_ns(queued, gate.per_step);
        let cpu = Demand {
            share: Share::Cpu,
            ratio: match self.cpu_times(Clocks::LastTick) {
                Some(now) => gate.controller.demand(at, now, expected),
                // No process clock: nothing to hold a budget against.
                None => 0.0,
            },
            cost_ms: expected.unwrap_or(0) as f64 / 1e6,
        };
        // The rate shares: a sampled step's cost against the budget's part of the
        // wall time since the last sampled step.
        let since_ms = gate
            .last_sampled
            .map_or(at, |(_, last)| at.saturating_sub(last))
            .as_secs_f64()
            * 1e3;
        let room_ms = budget.fraction() * since_ms;
        let rate = |share: Share, cost_ms: f64| Demand {
            share,
            ratio: if budget.is_unlimited() || cost_ms <= 0.0 {
                0.0
            } else if room_ms > 0.0 {
                cost_ms / room_ms
            } else {
                f64::INFINITY
            },
            cost_ms,
        };
        let device_samples = self.device_samples.load(Ordering::Relaxed);
        let device_ms = if device_samples > 0 {
            self.device_ns.load(Ordering::Relaxed) as f64 / 1e6 / device_samples as f64
                * gate.per_step.max(1) as f64
        } else {
            0.0
        };
        let observed_ms = self
            .slowdown
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .per_sample_ms()
            .unwrap_or(0.0);
        Demands {
            shares: [
                cpu,
                rate(Share::Device, device_ms),
                rate(Share::Observed, observed_ms),
            ],
            since_ms,
            room_ms,
        }
    }

    /// A step ended after `step_ms`, `sampled` or not: its observed slowdown (ms;
    /// see [`Slowdown`]) and the device time read since the last step ended (ms;
    /// `None` where no device time was ever reported).
    pub fn step_ended(&self, step_ms: f64, sampled: bool) -> (Option<f64>, Option<f64>) {
        let in_flight = self.in_flight() > 0;
        let observed = self
            .slowdown
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .step(step_ms, sampled, in_flight);
        let device = (self.device_samples.load(Ordering::Relaxed) > 0)
            .then(|| self.device_row_ns.swap(0, Ordering::Relaxed) as f64 / 1e6);
        (observed, device)
    }

    /// `ns` of device time spent on `samples` samples (an adapter's side stream).
    pub fn add_device_ns(&self, ns: u64, samples: u64) {
        self.device_ns.fetch_add(ns, Ordering::Relaxed);
        self.device_row_ns.fetch_add(ns, Ordering::Relaxed);
        self.device_samples.fetch_add(samples, Ordering::Relaxed);
    }

    /// Adds CPU time of an adapter's thread that issues the device side's work: the
    /// agent's, off the training thread.
    pub fn add_device_thread_ns(&self, ns: u64) {
        self.device_thread_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Samples taken and not yet done with: being read or reduced by an adapter,
    /// queued for the metrics thread, or being measured.
    pub fn in_flight(&self) -> u64 {
        self.taken
            .load(Ordering::Relaxed)
            .saturating_sub(self.dropped.load(Ordering::Relaxed))
            .saturating_sub(self.worker.done.load(Ordering::Relaxed))
    }

    /// Samples handed to the metrics thread and not yet done.
    pub fn queued(&self) -> u64 {
        self.handed
            .load(Ordering::Relaxed)
            .saturating_sub(self.worker.done.load(Ordering::Relaxed))
    }

    /// The host memory the samples [`Sampler::queued`] counts hold.
    pub fn queued_bytes(&self) -> u64 {
        self.handed_bytes
            .load(Ordering::Relaxed)
            .saturating_sub(self.worker.done_bytes.load(Ordering::Relaxed))
    }

    /// A sample is being taken.
    pub fn taken(&self) {
        self.taken.fetch_add(1, Ordering::Relaxed);
    }

    /// The sample just taken went to the metrics thread holding `bytes` of host
    /// memory, or was dropped.
    pub fn handed(&self, sent: bool, bytes: u64) {
        if sent {
            self.handed.fetch_add(1, Ordering::Relaxed);
            self.handed_bytes.fetch_add(bytes, Ordering::Relaxed);
        } else {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A sample counted as handed over (holding `bytes`) was dropped after all (the
    /// metrics thread's queue refused it).
    pub fn handed_then_dropped(&self, bytes: u64) {
        self.handed.fetch_sub(1, Ordering::Relaxed);
        self.handed_bytes.fetch_sub(bytes, Ordering::Relaxed);
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
        let skipped_cpu = self.skipped_cpu.load(Ordering::Relaxed);
        let skipped_device = self.skipped_device.load(Ordering::Relaxed);
        let skipped_observed = self.skipped_observed.load(Ordering::Relaxed);
        ActivationSamples {
            taken: self.taken.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed)
                + self.worker.dropped.load(Ordering::Relaxed),
            skipped: skipped_cpu + skipped_device + skipped_observed + skipped_queue_full,
            skipped_queue_full,
            skipped_cpu,
            skipped_device,
            skipped_observed,
            steps_skipped: self.steps_skipped.load(Ordering::Relaxed),
            steps_floor: self.steps_floor.load(Ordering::Relaxed),
        }
    }

    pub fn overhead(&self) -> Overhead {
        let now = self.cpu_times(Clocks::Now).unwrap_or_default();
        let slowdown = self.slowdown.lock().unwrap_or_else(|e| e.into_inner());
        let (observed_ms, observed_steps) = slowdown.total();
        Overhead {
            device_ns: self.device_ns.load(Ordering::Relaxed),
            device_samples: self.device_samples.load(Ordering::Relaxed),
            observed_ms,
            observed_steps,
            observed_per_step_ms: slowdown.per_sample_ms(),
            budget: self.budget(),
            agent_ns: now.agent_ns,
            training_ns: self.training_ns.load(Ordering::Relaxed),
            training_sample_ns: self.training_sample_ns.load(Ordering::Relaxed),
            metrics_ns: self.worker.cpu_ns.load(Ordering::Relaxed),
            device_thread_ns: self.device_thread_ns.load(Ordering::Relaxed),
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
            + self.device_thread_ns.load(Ordering::Relaxed)
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
    /// Whatever the layers per step, the bytes a sample holds and the worker's pace,
    /// the queue never holds more than `max(capacity, layers per step)` samples, or
    /// twice that within [`SECOND_STEP_BYTES`], and a step is refused only when the
    /// whole step would fit neither way.
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
        let mut second_steps = 0;
        for _case in 0..200 {
            let sampler = Sampler::new(
                OverheadBudget::from_percent(100.0).unwrap(),
                None,
                Arc::default(),
                Arc::default(),
            );
            let layers = 1 + next(40);
            // From a sketch's summary to a host copy at the default row cap.
            let bytes = [1 << 20, 4 << 20, 16 << 20, 64 << 20][next(4) as usize];
            let room = CAPACITY.max(layers as usize) as u64;
            let (mut admitted, mut refused) = (0, 0);
            for step in 0..300 {
                let (before, before_bytes) = (sampler.queued(), sampler.queued_bytes());
                if sampler.decide(step, CAPACITY).take {
                    admitted += 1;
                    for _ in 0..layers {
                        sampler.taken();
                        sampler.handed(true, bytes);
                    }
                } else {
                    refused += 1;
                    let one = before + layers <= room;
                    let two = before + layers <= 2 * room
                        && (step == 0 || before_bytes + layers * bytes <= SECOND_STEP_BYTES);
                    assert!(
                        !one && !two,
                        "a step was refused with room for it ({before} queued, {layers} layers of {bytes} bytes)"
                    );
                }
                let queued = sampler.queued();
                assert!(queued <= 2 * room, "{queued} queued, {layers} layers");
                if queued > room {
                    second_steps += 1;
                    assert!(sampler.queued_bytes() <= SECOND_STEP_BYTES);
                }
                assert_eq!(sampler.queued_bytes(), queued * bytes);
                // The worker finishes a random number of the queued samples.
                for _ in 0..next(queued + 1) {
                    sampler.worker.done_with(bytes);
                }
            }
            let samples = sampler.samples();
            assert_eq!(samples.taken, admitted * layers);
            assert_eq!(samples.steps_skipped, refused);
            assert!(admitted > 0);
        }
        assert!(second_steps > 0, "no case queued a second step");
    }

    /// Planned steps of 51 samples against a metrics thread that takes 1.1 times
    /// the time between them for one step's samples: with a device's small
    /// reductions a second step queues behind the first, and about 1 / 1.1 of the
    /// planned steps are measured; with host copies too large for that, every other.
    #[test]
    fn a_metrics_thread_a_little_slower_than_the_steps_measures_most_of_them() {
        let share_sampled = |bytes: u64| {
            let sampler = Sampler::new(
                OverheadBudget::from_percent(100.0).unwrap(),
                None,
                Arc::default(),
                Arc::default(),
            );
            let (layers, planned) = (51, 1000);
            // Time in planned steps: each sample takes 1.1 / 51 of one.
            let per_sample = 1.1 / layers as f64;
            let (mut sampled, mut free_at) = (0, 0.0_f64);
            let mut finishing = std::collections::VecDeque::new();
            for step in 0..planned {
                let now = step as f64;
                while finishing.front().is_some_and(|&t| t <= now) {
                    finishing.pop_front();
                    sampler.worker.done_with(bytes);
                }
                if sampler.decide(step, 16).take {
                    sampled += 1;
                    for _ in 0..layers {
                        sampler.taken();
                        sampler.handed(true, bytes);
                        free_at = free_at.max(now) + per_sample;
                        finishing.push_back(free_at);
                    }
                }
            }
            sampled as f64 / planned as f64
        };
        let small = share_sampled(1 << 20);
        assert!((0.88..=0.92).contains(&small), "{small}");
        let large = share_sampled(32 << 20);
        assert!((0.49..=0.51).contains(&large), "{large}");
    }

    /// A run on synthetic wall time: 10 ms a step, a planned sample every 10 steps
    /// of 4 layers, each sample's device work `device_ms`, measured at once. Returns
    /// the sampled steps and the sampler.
    fn run_with_device_cost(budget: &str, device_ms: f64, steps: u64) -> (Vec<u64>, Sampler) {
        let sampler = Sampler::new(
            OverheadBudget::parse(budget).unwrap(),
            None,
            Arc::default(),
            Arc::default(),
        );
        let mut sampled = Vec::new();
        let mut limits = Vec::new();
        for step in (0..steps).step_by(10) {
            let at = Duration::from_millis(10 * step);
            let decision = sampler.decide_at(step, 16, at);
            if let Some(limited) = &decision.newly_limited {
                assert!(
                    limited.message.contains(limited.share.label()),
                    "{limited:?}"
                );
                limits.push(limited.share);
            }
            if decision.take {
                sampled.push(step);
                for _ in 0..4 {
                    sampler.taken();
                    sampler.handed(true, 0);
                }
                sampler.add_device_ns((device_ms * 4e6) as u64, 4);
                sampler.worker.done.fetch_add(4, Ordering::Relaxed);
            }
        }
        // One event when the device share first limits, and one when the floor is
        // first missed; none after.
        assert!(limits.len() <= 2 && limits.iter().all(|&s| s == Share::Device));
        (sampled, sampler)
    }

    #[test]
    fn the_device_share_holds_a_sampled_steps_device_time_to_the_budget() {
        // 4 × 0.5 ms a sampled step, against 2 % of 100 ms: every one fits.
        let (sampled, _) = run_with_device_cost("2%", 0.5, 1000);
        assert_eq!(sampled.len(), 100);
        // 4 × 1.5 ms = 6 ms: 300 ms of steps pay for one, so every third.
        let (sampled, s) = run_with_device_cost("2%", 1.5, 3000);
        assert!(sampled.windows(2).all(|w| w[1] - w[0] == 30), "{sampled:?}");
        let samples = s.samples();
        assert_eq!(samples.skipped, samples.skipped_device);
        assert_eq!(samples.skipped_device, 4 * 2 * 99 + 4 * 2);
        assert_eq!(samples.steps_floor, 0);
    }

    #[test]
    fn the_floor_samples_every_hundred_steps_within_five_times_the_budget() {
        // 4 × 10 ms = 40 ms: the budget alone would take one every 200 steps; the
        // floor takes one every 100 (twice the budget's room, within 2.5 times).
        let (sampled, s) = run_with_device_cost("2%", 10.0, 2000);
        assert!(
            sampled.windows(2).all(|w| w[1] - w[0] == FLOOR_STEPS),
            "{sampled:?}"
        );
        assert_eq!(s.samples().steps_floor, 19);
        // 4 × 50 ms = 200 ms: ten times the room at 100 steps, over the slack; one
        // every 400 steps, where 2.5 times the room pays for it (the budget alone:
        // one every 1,000).
        let (sampled, s) = run_with_device_cost("2%", 50.0, 2000);
        assert_eq!(sampled, vec![0, 400, 800, 1200, 1600]);
        assert_eq!(s.samples().steps_floor, 4);
    }

    #[test]
    fn the_observed_share_skips_samples_and_says_so() {
        let sampler = Sampler::new(
            OverheadBudget::DEFAULT,
            None,
            Arc::default(),
            Arc::default(),
        );
        let mut limited = None;
        let mut sampled = 0;
        for step in 0..1000u64 {
            let at = Duration::from_millis(10 * step);
            let take = step % 10 == 0 && {
                let d = sampler.decide_at(step, 16, at);
                limited = limited.or(d.newly_limited);
                d.take
            };
            if take {
                sampled += 1;
                sampler.taken();
                sampler.handed(true, 0);
                sampler.worker.done.fetch_add(1, Ordering::Relaxed);
            }
            // A sampled step takes 10 ms more than the 10 ms of the others: 10 %
            // of the time at every 10 steps, five times the budget.
            let (observed, device) = sampler.step_ended(if take { 20.0 } else { 10.0 }, take);
            assert_eq!(device, None);
            if take && step >= 100 {
                assert_eq!(observed, Some(10.0));
            }
        }
        let limited = limited.expect("a budget_limited event");
        assert_eq!(limited.share, Share::Observed);
        assert!(
            limited.skipped >= 1 && limited.message.contains("the observed share"),
            "{limited:?}"
        );
        // 10 ms a sampled step fits in 500 ms of steps at 2 %: one every 50.
        assert!((18..=24).contains(&sampled), "{sampled}");
        let o = sampler.overhead();
        assert_eq!(o.observed_per_step_ms, Some(10.0));
        assert!(sampler.samples().skipped_observed > 0);
    }
}
