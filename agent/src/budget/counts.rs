//! What the sampler reports of a running agent: its activation samples (taken,
//! dropped, skipped and why) and its cost (CPU and device time, the observed
//! slowdown), read by the agent's API, the step rows and the events at finish.

use super::controller::OverheadBudget;

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
    /// Of the skipped, those skipped to keep each share of the budget: the agent's
    /// CPU time, its device time, the observed slowdown (the share furthest over).
    pub skipped_cpu: u64,
    pub skipped_device: u64,
    pub skipped_observed: u64,
    /// Planned steps sampled by the floor although the budget had no room.
    pub steps_floor: u64,
    /// Planned steps not sampled (a step is sampled whole or not at all).
    pub steps_skipped: u64,
}

/// The agent's CPU time against the process's, since the agent started.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overhead {
    pub budget: OverheadBudget,
    /// The agent's CPU time: `training_ns + metrics_ns + transport_ns +
    /// device_thread_ns`.
    pub agent_ns: u64,
    /// The agent's time on the training thread (the steps' `overhead_ms`).
    pub training_ns: u64,
    /// Of `training_ns`, the time spent taking activation samples.
    pub training_sample_ns: u64,
    /// The metrics thread's CPU time.
    pub metrics_ns: u64,
    /// The transport thread's CPU time.
    pub transport_ns: u64,
    /// The CPU time of an adapter's thread that issues the device side's work (the
    /// Python package's on a GPU); 0 where there is none.
    pub device_thread_ns: u64,
    /// The whole process's CPU time since the agent started.
    pub process_ns: u64,
    /// The device time of the agent's sample work (an adapter's side stream), and
    /// the samples it covers; 0 where there is no device side.
    pub device_ns: u64,
    pub device_samples: u64,
    /// What the sampled steps slowed training by, added up (ms, signed), over how
    /// many sampled steps, and the median of the recent ones (ms).
    pub observed_ms: f64,
    pub observed_steps: u64,
    pub observed_per_step_ms: Option<f64>,
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
