//! Step timing: a step guard and phase guards for data, forward, backward and
//! optimizer. A step with a planned activation sample asks the overhead budget
//! whether it is taken (`budget::sampler`) when it begins.
//! The guard's drop sends the `steps` row; its `overhead_ms` is the time
//! the agent spent on the training thread during the step, this row's own
//! bookkeeping included. Queuing the row happens after its `overhead_ms` is taken,
//! so that time is counted in the next step's.
//!
//! [`StepGuard::stop`] ends the step's clock without sending the row, for a caller
//! that fills in values later (the Python package does, for loss and communication
//! times that are still being computed on an accelerator); dropping the guard then
//! sends the row with the values known by then.

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use rankscope_proto::v1::StepRow;

use super::comm::{self, CommKind, CommStep};

use super::recorder::{Recorder, WORKER_QUEUE};
use crate::rows::now_us;
use rankscope_proto::Row;

/// A part of a training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Data,
    Forward,
    Backward,
    Optimizer,
}

impl Phase {
    /// Every phase, in the order of a training step.
    pub const ALL: [Phase; 4] = [
        Phase::Data,
        Phase::Forward,
        Phase::Backward,
        Phase::Optimizer,
    ];

    /// The phase's name, as in the `steps` columns (`data` for `data_ms`).
    pub fn label(self) -> &'static str {
        match self {
            Phase::Data => "data",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
        }
    }

    /// The phase named `name` (see [`Phase::label`]).
    pub fn parse(name: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.label() == name)
    }
}

/// One training step; records its row when dropped. It holds its own reference to
/// the agent's recorder, so it may outlive the agent it was made from.
#[derive(Debug)]
pub struct StepGuard {
    /// `None` for an inert agent.
    recorder: Option<Arc<Recorder>>,
    started: Instant,
    /// The row as far as it is known; `step_ms` is set by [`StepGuard::stop`].
    row: RefCell<StepRow>,
    /// The step's collectives by kind (its `comm` rows), taken from the recorder's
    /// tally at [`StepGuard::stop`] and added to by [`StepGuard::add_comm`].
    comm: RefCell<CommStep>,
    stopped: Cell<bool>,
}

impl StepGuard {
    pub(crate) fn begin(recorder: Option<Arc<Recorder>>, step: u64) -> StepGuard {
        let started = Instant::now();
        if let Some(inner) = &recorder {
            // What completed since the last step stopped belongs to no step.
            let between = inner.comm.take();
            let rows = comm::rows(None, &between);
            if !rows.is_empty() {
                let queuing = Instant::now();
                for row in rows {
                    inner.transport.send(row);
                }
                inner.add_overhead(queuing);
            }
            inner.step.store(step, Ordering::Relaxed);
            let planned =
                inner.config.samples_layers() && step.is_multiple_of(inner.config.sample_every);
            // A planned sample is taken only if the overhead budget has room for it.
            let sampled = planned && {
                let deciding = Instant::now();
                let decision = inner.sampler.decide(step, WORKER_QUEUE);
                if let Some(limited) = decision.newly_limited {
                    let value = i64::try_from(limited.skipped).unwrap_or(i64::MAX);
                    let kind = crate::rows::event_kind::BUDGET_LIMITED;
                    inner.event(kind, &limited.message, Some(value));
                }
                inner.add_overhead(deciding);
                decision.take
            };
            inner.sampling.store(sampled, Ordering::Relaxed);
        }
        StepGuard {
            recorder,
            started,
            row: RefCell::new(StepRow {
                step,
                ..StepRow::default()
            }),
            comm: RefCell::new(CommStep::default()),
            stopped: Cell::new(false),
        }
    }

    /// The step index.
    pub fn index(&self) -> u64 {
        self.row.borrow().step
    }

    /// Whether layer activations are sampled in this step.
    pub fn sampled(&self) -> bool {
        self.recorder
            .as_ref()
            .is_some_and(|i| !self.stopped.get() && i.sampling.load(Ordering::Relaxed))
    }

    /// Times a phase until the returned guard is dropped. A phase entered twice
    /// in one step adds up.
    pub fn phase(&self, phase: Phase) -> PhaseGuard<'_> {
        PhaseGuard {
            step: self,
            phase,
            started: Instant::now(),
        }
    }

    /// Adds `ms` to a phase's time (for callers that time phases themselves).
    pub fn add_phase_ms(&self, phase: Phase, ms: f64) {
        let mut row = self.row.borrow_mut();
        let slot = match phase {
            Phase::Data => &mut row.data_ms,
            Phase::Forward => &mut row.forward_ms,
            Phase::Backward => &mut row.backward_ms,
            Phase::Optimizer => &mut row.optimizer_ms,
        };
        *slot = Some(slot.unwrap_or(0.0) + ms);
    }

    pub fn loss(&self, value: f64) {
        self.row.borrow_mut().loss = Some(value);
    }

    /// The global L2 norm of all gradients.
    pub fn grad_norm(&self, value: f64) {
        self.row.borrow_mut().grad_norm = Some(value);
    }

    pub fn lr(&self, value: f64) {
        self.row.borrow_mut().lr = Some(value);
    }

    /// Training examples this rank processed in the step.
    pub fn samples(&self, value: u64) {
        self.row.borrow_mut().samples = Some(value);
    }

    /// Time from launch to completion of the step's gradient collectives, summed
    /// over buckets. In data-parallel training the rank that waits least is the
    /// one the others wait for.
    pub fn comm_ms(&self, value: f64) {
        self.row.borrow_mut().comm_ms = Some(value);
    }

    /// Adds `count` collectives of `kind` (`bytes` and `ms` in all) to this step's
    /// `comm` rows, for callers that read their times after the step's clock
    /// stopped (CUDA events). Collectives timed as they complete go to
    /// [`crate::Agent::add_comm`] instead.
    pub fn add_comm(&self, kind: CommKind, count: u64, bytes: u64, ms: f64) {
        comm::add_to(&mut self.comm.borrow_mut(), kind, count, bytes, ms);
    }

    /// Ends the step's clock and reads memory, without sending the row yet.
    /// Callable more than once; only the first call counts.
    pub fn stop(&self) {
        if self.stopped.replace(true) {
            return;
        }
        let Some(inner) = &self.recorder else {
            return;
        };
        let sampled = inner.sampling.load(Ordering::Relaxed);
        let delay = inner.injected_delay_ns.load(Ordering::Relaxed);
        if sampled && delay > 0 {
            // A cost the agent's clocks do not see (tests of the observed slowdown).
            std::thread::sleep(std::time::Duration::from_nanos(delay));
        }
        let mut row = self.row.borrow_mut();
        row.step_ms = self.started.elapsed().as_secs_f64() * 1e3;
        let own = Instant::now();
        comm::merge(&mut self.comm.borrow_mut(), &inner.comm.take());
        inner.sampling.store(false, Ordering::Relaxed);
        (row.overhead_observed_ms, row.overhead_device_ms) =
            inner.sampler.step_ended(row.step_ms, sampled);
        let (rss, device) = inner.memory();
        row.time = now_us();
        row.rss_bytes = rss;
        row.device_allocated_bytes = device.map(|d| d.allocated);
        row.device_reserved_bytes = device.map(|d| d.reserved);
        row.device_peak_bytes = device.map(|d| d.peak);
        inner.add_overhead(own);
        row.overhead_ms = inner.overhead_ns.swap(0, Ordering::Relaxed) as f64 / 1e6;
    }
}

impl Drop for StepGuard {
    fn drop(&mut self) {
        self.stop();
        let Some(inner) = &self.recorder else {
            return;
        };
        let queuing = Instant::now();
        let row = self.row.take();
        let step = row.step;
        inner.transport.send(Row::Step(row));
        for row in comm::rows(Some(step), &self.comm.borrow()) {
            inner.transport.send(row);
        }
        inner.add_overhead(queuing);
    }
}

/// Times one phase of a step.
#[derive(Debug)]
pub struct PhaseGuard<'s> {
    step: &'s StepGuard,
    phase: Phase,
    started: Instant,
}

impl Drop for PhaseGuard<'_> {
    fn drop(&mut self) {
        let ms = self.started.elapsed().as_secs_f64() * 1e3;
        self.step.add_phase_ms(self.phase, ms);
    }
}
