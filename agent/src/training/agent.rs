//! The handle training code holds: [`Agent`]. What it takes from training code is
//! framework-free (host activations, a device's reductions, parameter shapes); the
//! adapters add their own methods (with the `torch` feature, [`crate::torch`]:
//! `tap`, `observe`, `profile_model` over tch tensors).
//!
//! ```no_run
//! use rankscope_agent::{Agent, Phase};
//! use tch::nn::{self, Module};
//!
//! let agent = Agent::from_env().expect("rankscope configuration");
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! let model = nn::seq()
//!     .add(agent.tap("fc1", nn::linear(vs.root() / "fc1", 5, 64, Default::default())))
//!     .add_fn(|x| x.silu());
//! for step in 0..100 {
//!     let s = agent.step(step);
//!     let x = { let _p = s.phase(Phase::Data); tch::Tensor::randn([32, 5], tch::kind::FLOAT_CPU) };
//!     let y = { let _p = s.phase(Phase::Forward); model.forward(&x) };
//!     s.loss(y.mean(tch::Kind::Float).double_value(&[]));
//! }
//! agent.finish();
//! ```
//!
//! An inert agent (mode `off`, or `rank0` on another rank) holds nothing: no thread,
//! no connection, and every call returns at once.

use std::sync::Arc;
use std::time::Instant;

use rankscope_proto::v1::ModelRow;

use super::comm::CommKind;
use super::memory::DeviceMemory;
use super::profile::{self, Optimizer, Parameter};
pub use super::recorder::PendingSample;
use super::recorder::Recorder;
use super::step::StepGuard;
pub use crate::budget::counts::{ActivationSamples, Overhead};
use crate::config::{AgentConfig, AgentConfigBuilder, ConfigError, OnConfigError};
use crate::sampling::worker::JobInput;
use crate::sampling::{HostActivation, HostSample, MatrixOptions};
use crate::transport::report::FinishReport;

/// The agent of one rank. Cheap to clone (an `Arc`); `Send + Sync`.
#[derive(Clone, Debug, Default)]
pub struct Agent {
    recorder: Option<Arc<Recorder>>,
}

impl Agent {
    /// Configures from the environment (see [`crate::config`]). With
    /// `RANKSCOPE_ON_CONFIG_ERROR=disable`, a wrong configuration logs the error and
    /// returns a disabled agent instead of failing.
    pub fn from_env() -> Result<Agent, ConfigError> {
        Agent::from_builder(AgentConfig::builder())
    }

    /// Configures from code overrides, then the environment.
    pub fn from_builder(builder: AgentConfigBuilder) -> Result<Agent, ConfigError> {
        match builder.build() {
            Ok(config) => Ok(Agent::new(config)),
            Err(error) => match builder.on_error() {
                Ok(OnConfigError::Disable) => {
                    tracing::error!(%error, "rankscope disabled by RANKSCOPE_ON_CONFIG_ERROR=disable");
                    Ok(Agent::disabled())
                }
                _ => Err(error),
            },
        }
    }

    /// An agent that records nothing.
    pub fn disabled() -> Agent {
        Agent { recorder: None }
    }

    /// Starts the agent for `config`. Inert ranks start nothing.
    pub fn new(config: AgentConfig) -> Agent {
        if !config.active() {
            return Agent::disabled();
        }
        match Recorder::start(config) {
            Ok(recorder) => Agent {
                recorder: Some(Arc::new(recorder)),
            },
            Err(error) => {
                tracing::error!(%error, "cannot start the rankscope agent; telemetry is off");
                Agent::disabled()
            }
        }
    }

    /// The running agent, for the adapters' own methods.
    #[cfg(feature = "torch")]
    pub(crate) fn recorder(&self) -> Option<&Arc<Recorder>> {
        self.recorder.as_ref()
    }

    /// Whether this agent records anything.
    pub fn is_active(&self) -> bool {
        self.recorder.is_some()
    }

    pub fn config(&self) -> Option<&AgentConfig> {
        self.recorder.as_deref().map(|r| &r.config)
    }

    /// Whether activations of `name` are sampled at all. Names the collector would
    /// refuse (over [`rankscope_proto::MAX_LABEL_BYTES`], control characters) never are.
    pub fn wants_layer(&self, name: &str) -> bool {
        self.recorder.as_ref().is_some_and(|r| r.wants_layer(name))
    }

    /// Begins step `step`; the guard records the step row when dropped.
    pub fn step(&self, step: u64) -> StepGuard {
        StepGuard::begin(self.recorder.clone(), step)
    }

    /// Observes an activation of layer `name` in host memory (an adapter's view of its
    /// tensor): on a sampled step its sample is read into a buffer of the agent's and
    /// handed to the metrics thread. On a step that is not sampled this costs one
    /// atomic load. `since`: where a binding's own work for this activation (a hook's
    /// call, reading the tensor) began, so that time is the agent's too.
    pub fn observe_host(
        &self,
        name: &str,
        kind: Option<&'static str>,
        activation: &HostActivation<'_>,
        since: Option<Instant>,
    ) {
        if let Some(recorder) = &self.recorder {
            recorder.observe_host(name, kind, activation, since);
        }
    }

    /// For an adapter that prepares a sample itself (on a device): whether layer
    /// `name`, whose output has `shape`, is sampled now, and if so the sample's
    /// identity (its seed draws the rows), counted as taken. It must then be handed
    /// over with [`Agent::hand_over`], once, even if it fails. `None` costs one atomic
    /// load on a step that is not sampled.
    pub fn begin_sample(
        &self,
        name: &str,
        kind: Option<&'static str>,
        shape: &[i64],
    ) -> Option<PendingSample> {
        self.recorder.as_ref()?.begin_sample(name, kind, shape)
    }

    /// Hands a sample [`Agent::begin_sample`] took to the metrics thread: what the
    /// adapter made of it, or why it could not (an `events` row says so, and the
    /// sample counts as dropped). Callable from any thread.
    pub fn hand_over(&self, pending: PendingSample, input: Result<JobInput, String>) {
        if let Some(recorder) = &self.recorder {
            recorder.hand_over(pending, input);
        }
    }

    /// Reads a sample [`Agent::begin_sample`] took of an activation in host memory into
    /// a reused buffer (on the training thread), for [`Agent::hand_over`]; `None` on an
    /// inert agent.
    pub fn read_host(
        &self,
        pending: &PendingSample,
        activation: &HostActivation<'_>,
    ) -> Option<HostSample> {
        Some(self.recorder.as_ref()?.read_host(pending, activation))
    }

    /// Whether an observed activation matters now: on a sampled step, or while the
    /// model profile's forward pass records shapes. One atomic load or two.
    pub fn observing(&self) -> bool {
        self.recorder.as_ref().is_some_and(|r| {
            r.sampling.load(std::sync::atomic::Ordering::Relaxed)
                || r.profiling.load(std::sync::atomic::Ordering::Relaxed)
        })
    }

    /// For an adapter whose device runs the sketch's Krylov process: how many depths of
    /// [`crate::sampling::SKETCH_SCHEDULE`] to run for a sample of layer `name`, learnt
    /// from its earlier samples ([`crate::sampling::depths`]); all of them on an inert
    /// agent.
    pub fn sketch_depths(&self, name: &str) -> usize {
        self.recorder
            .as_ref()
            .map_or(crate::sampling::SKETCH_SCHEDULE.len(), |r| {
                r.sketch_depths.to_run(name)
            })
    }

    /// How this rank's samples are made (row cap, centring, conv layout, spectrum).
    pub fn matrix_options(&self) -> Option<MatrixOptions> {
        self.recorder.as_ref().map(|r| r.options)
    }

    /// Sets what reads the accelerator allocator's bytes for every step row (the
    /// adapter's: torch's counters for the Python package, libtorch's for a tch
    /// program). Without one the columns are null.
    pub fn set_device_memory(&self, reader: Box<dyn DeviceMemory>) {
        if let Some(recorder) = &self.recorder {
            *recorder
                .device_memory
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some(reader);
        }
    }

    /// Counts the time from `since` to now as the agent's on the training thread: in
    /// the current step's `overhead_ms` (or the next step's, once this one's row has
    /// taken its figure) and in the overhead budget. For bindings, whose own work on
    /// the training thread (installing hooks, converting values) is the agent's cost
    /// too. `sampling`: the time was spent because the step is sampled (it then
    /// teaches the budget what a sampled step costs).
    pub fn add_overhead(&self, since: Instant, sampling: bool) {
        if let Some(recorder) = &self.recorder {
            let ns = since.elapsed().as_nanos() as u64;
            recorder.add_overhead_ns(ns, sampling);
        }
    }

    /// [`Agent::add_overhead`] from a reading of the monotonic clock in nanoseconds
    /// (`CLOCK_MONOTONIC`, which Python's `time.perf_counter_ns()` reads on Linux), for
    /// a binding that times its own work in its language: the time up to this call's
    /// own clock reading is counted, the hand-over included. A reading in the future
    /// or over a minute old counts nothing.
    pub fn add_overhead_since_monotonic_ns(&self, since_ns: u64, sampling: bool) {
        if let Some(recorder) = &self.recorder
            && let Some(now) = monotonic_ns()
        {
            let ns = now.wrapping_sub(since_ns);
            if now >= since_ns && ns < 60_000_000_000 {
                recorder.add_overhead_ns(ns, sampling);
            }
        }
    }

    /// Whether the training thread copies samples into buffers reused from one
    /// sampled step to the next (the default), or each into a new allocation, as
    /// before buffers were reused (for benchmarks that show the difference:
    /// BENCHMARKS.md, "`overhead_ms` told truly").
    pub fn reuse_sample_buffers(&self, reuse: bool) {
        if let Some(recorder) = &self.recorder {
            recorder.buffers.set_reuse(reuse);
        }
    }

    /// `true`: samples taken from now on wait on the training side instead of going
    /// to the metrics thread at once; `false`: those waiting go now, and later ones at
    /// once again. For measurements of the training thread's own cost that keep the
    /// metrics thread's work (and what it does to shared caches) out of the steps
    /// they time. Held samples count as queued ([`Agent::queued_samples`]), so the
    /// metrics queue's bound holds: a planned step with no room is skipped.
    pub fn hold_samples(&self, hold: bool) {
        if let Some(recorder) = &self.recorder {
            recorder.hold_samples(hold);
        }
    }

    /// Drops the samples [`Agent::hold_samples`] holds (counted as dropped): for
    /// measurements of the training thread with no metrics work at all. Returns
    /// how many.
    pub fn discard_held_samples(&self) -> usize {
        self.recorder
            .as_ref()
            .map_or(0, |r| r.discard_held_samples())
    }

    /// The index of the running step if it samples activations, else `None`: for
    /// hooks that sample a layer once per step (a forward recomputed under
    /// activation checkpointing runs the layer's hook twice).
    pub fn sampling_step(&self) -> Option<u64> {
        let recorder = self.recorder.as_ref()?;
        recorder
            .sampling
            .load(std::sync::atomic::Ordering::Relaxed)
            .then(|| recorder.step.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Adds `count` collectives of `kind`, with `bytes` and `ms` (launch to
    /// completion) in all, to the `comm` rows of the step whose clock is running
    /// (or, between steps, to rows without a step). Callable from any thread.
    pub fn add_comm(&self, kind: CommKind, count: u64, bytes: u64, ms: f64) {
        if let Some(recorder) = &self.recorder {
            recorder.comm.add(kind, count, bytes, ms);
        }
    }

    /// Records an event row (`kind`, a message, an optional value).
    /// `kind` and `message` are cut to the collector's limits
    /// ([`rankscope_proto::MAX_LABEL_BYTES`] and [`rankscope_proto::MAX_EVENT_MESSAGE_BYTES`])
    /// and control characters replaced, so an event can never be refused.
    pub fn event(&self, kind: &str, message: &str, value: Option<i64>) {
        if let Some(recorder) = &self.recorder {
            recorder.event(kind, message, value);
        }
    }

    /// Activation samples so far (not training examples, which the `samples`
    /// column of `steps` counts): taken, of those dropped, and skipped (not taken,
    /// to stay within the overhead budget or because the metrics queue was full).
    /// At finish they are also reported as `samples_dropped` and `samples_skipped`
    /// events.
    pub fn activation_samples(&self) -> ActivationSamples {
        self.recorder
            .as_ref()
            .map_or(ActivationSamples::default(), |r| r.sampler.samples())
    }

    /// Adds `ns` of device time spent on `samples` samples' work (an adapter's side
    /// stream, timed with its events once they completed): in the next step row's
    /// `overhead_device_ms` and in the budget's device share. Callable from any
    /// thread.
    pub fn add_device_ns(&self, ns: u64, samples: u64) {
        if let Some(recorder) = &self.recorder {
            recorder.sampler.add_device_ns(ns, samples);
        }
    }

    /// Adds CPU time of an adapter's thread that issues the device side's work (the
    /// overhead budget's CPU share counts it as the agent's).
    pub fn add_device_thread_ns(&self, ns: u64) {
        if let Some(recorder) = &self.recorder {
            recorder.sampler.add_device_thread_ns(ns);
        }
    }

    /// Adds `delay` to every sampled step from now on, as a sleep at its end that the
    /// agent's clocks do not see: a cost only the observed slowdown can find. For
    /// tests of the budget and its reports; never set in training.
    pub fn inject_sampled_step_delay(&self, delay: std::time::Duration) {
        if let Some(recorder) = &self.recorder {
            let ns = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
            recorder
                .injected_delay_ns
                .store(ns, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Samples handed to the metrics thread and not yet measured.
    pub fn queued_samples(&self) -> u64 {
        self.recorder.as_ref().map_or(0, |r| r.sampler.queued())
    }

    /// The agent's CPU time against the process's since the agent started, and
    /// the budget it is held to (`RANKSCOPE_OVERHEAD_BUDGET`); `None` when inactive.
    pub fn overhead(&self) -> Option<Overhead> {
        self.recorder.as_ref().map(|r| r.sampler.overhead())
    }

    /// Flushes everything and waits (at most the configured `finish_timeout`) for
    /// the collector to acknowledge it. Callable more than once.
    pub fn finish(&self) -> FinishReport {
        match &self.recorder {
            Some(recorder) => recorder.finish(),
            None => FinishReport::default(),
        }
    }

    /// Runs `forward` once to see layer shapes (the caller turns gradients off), then
    /// sends one `model` row per layer of `parameters`. Returns the rows (also for
    /// inert agents, so callers can print). A sharded parameter (FSDP) has its whole
    /// shape in [`Parameter::whole_shape`]: `params` and the FLOPs count whole
    /// parameters, the byte columns this rank's shards.
    pub fn profile_parameters(
        &self,
        parameters: impl IntoIterator<Item = Parameter>,
        optimizer: Optimizer,
        forward: impl FnOnce(),
    ) -> Vec<ModelRow> {
        profile::record(self.recorder.as_deref(), parameters, optimizer, forward)
    }
}
/// `CLOCK_MONOTONIC` in nanoseconds.
fn monotonic_ns() -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}
