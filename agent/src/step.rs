//! Step timing: a step guard and phase guards for data, forward, backward and
//! optimizer. The guard's drop sends the `steps` row; its `overhead_ms` is the time
//! the agent spent on the training thread during the step, this row's own
//! bookkeeping included. Queuing the row happens after its `overhead_ms` is taken,
//! so that time is counted in the next step's.

use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::time::Instant;

use rankscope_proto::v1::StepRow;

use crate::agent::Agent;
use crate::{Row, now_us};

/// A part of a training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Data,
    Forward,
    Backward,
    Optimizer,
}

/// One training step; records its row when dropped.
#[derive(Debug)]
pub struct StepGuard<'a> {
    agent: &'a Agent,
    step: u64,
    started: Instant,
    phases: Cell<[Option<f64>; 4]>,
    loss: Cell<Option<f64>>,
    grad_norm: Cell<Option<f64>>,
    lr: Cell<Option<f64>>,
    samples: Cell<Option<u64>>,
}

impl<'a> StepGuard<'a> {
    pub(crate) fn begin(agent: &'a Agent, step: u64) -> StepGuard<'a> {
        let started = Instant::now();
        if let Some(inner) = agent.inner() {
            inner.step.store(step, Ordering::Relaxed);
            let sampled =
                inner.config.samples_layers() && step.is_multiple_of(inner.config.sample_every);
            inner.sampling.store(sampled, Ordering::Relaxed);
        }
        StepGuard {
            agent,
            step,
            started,
            phases: Cell::new([None; 4]),
            loss: Cell::new(None),
            grad_norm: Cell::new(None),
            lr: Cell::new(None),
            samples: Cell::new(None),
        }
    }

    /// The step index.
    pub fn index(&self) -> u64 {
        self.step
    }

    /// Times a phase until the returned guard is dropped. A phase entered twice
    /// in one step adds up.
    pub fn phase(&self, phase: Phase) -> PhaseGuard<'_, 'a> {
        PhaseGuard {
            step: self,
            phase,
            started: Instant::now(),
        }
    }

    pub fn loss(&self, value: f64) {
        self.loss.set(Some(value));
    }

    /// The global L2 norm of all gradients.
    pub fn grad_norm(&self, value: f64) {
        self.grad_norm.set(Some(value));
    }

    pub fn lr(&self, value: f64) {
        self.lr.set(Some(value));
    }

    /// Rows (examples) this rank processed in the step.
    pub fn samples(&self, value: u64) {
        self.samples.set(Some(value));
    }
}

impl Drop for StepGuard<'_> {
    fn drop(&mut self) {
        let Some(inner) = self.agent.inner() else {
            return;
        };
        let step_ms = self.started.elapsed().as_secs_f64() * 1e3;
        let own = Instant::now();
        inner.sampling.store(false, Ordering::Relaxed);
        let (rss, device) = inner.memory();
        let [data_ms, forward_ms, backward_ms, optimizer_ms] = self.phases.get();
        let mut row = StepRow {
            step: self.step,
            time: now_us(),
            step_ms,
            data_ms,
            forward_ms,
            backward_ms,
            optimizer_ms,
            loss: self.loss.get(),
            grad_norm: self.grad_norm.get(),
            lr: self.lr.get(),
            samples: self.samples.get(),
            overhead_ms: 0.0,
            rss_bytes: rss,
            device_allocated_bytes: device.map(|d| d.allocated),
            device_reserved_bytes: device.map(|d| d.reserved),
            device_peak_bytes: device.map(|d| d.peak),
        };
        inner.add_overhead(own);
        row.overhead_ms = inner.overhead_ns.swap(0, Ordering::Relaxed) as f64 / 1e6;
        let queuing = Instant::now();
        inner.transport.send(Row::Step(row));
        inner.add_overhead(queuing);
    }
}

/// Times one phase of a step.
#[derive(Debug)]
pub struct PhaseGuard<'s, 'a> {
    step: &'s StepGuard<'a>,
    phase: Phase,
    started: Instant,
}

impl Drop for PhaseGuard<'_, '_> {
    fn drop(&mut self) {
        let ms = self.started.elapsed().as_secs_f64() * 1e3;
        let mut phases = self.step.phases.get();
        let slot = &mut phases[self.phase as usize];
        *slot = Some(slot.unwrap_or(0.0) + ms);
        self.step.phases.set(phases);
    }
}
