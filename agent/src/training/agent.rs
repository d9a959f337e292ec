//! The handle training code holds: [`Agent`].
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
use tch::Tensor;
use tch::nn::VarStore;

use super::comm::CommKind;
use super::profile::{self, Optimizer};
use super::recorder::Recorder;
use super::step::StepGuard;
use super::tap::Tap;
pub use crate::budget::sampler::{ActivationSamples, Overhead};
use crate::config::{AgentConfig, AgentConfigBuilder, ConfigError, OnConfigError};
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

    /// Whether this agent records anything.
    pub fn is_active(&self) -> bool {
        self.recorder.is_some()
    }

    pub fn config(&self) -> Option<&AgentConfig> {
        self.recorder.as_deref().map(|r| &r.config)
    }

    /// Wraps `module` so its output is observed under `name`. The wrapper is
    /// always the same; whether a step samples the layer is decided at each
    /// forward ([`Agent::wants_layer`]: never for layers the filter excludes, in
    /// `steps` mode, or on an inactive agent).
    pub fn tap<M: tch::nn::Module>(&self, name: &str, module: M) -> Tap<M> {
        Tap::new(self.recorder.clone(), name, module, None)
    }

    /// [`Agent::tap`] for a self-attention module, so the profile counts its FLOPs.
    pub fn tap_attention<M: tch::nn::Module>(&self, name: &str, module: M) -> Tap<M> {
        Tap::new(self.recorder.clone(), name, module, Some("attention"))
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

    /// Observes an activation of layer `name`. On a step that is not sampled this
    /// costs one atomic load.
    pub fn observe(&self, name: &str, activation: &Tensor) {
        self.observe_kind(name, None, activation)
    }

    /// [`Agent::observe`] for a layer of a known kind (`attention`, so the profile
    /// counts its FLOPs).
    pub fn observe_kind(&self, name: &str, kind: Option<&'static str>, activation: &Tensor) {
        if let Some(recorder) = &self.recorder {
            recorder.observe(name, kind, activation);
        }
    }

    /// [`Agent::observe_kind`] for a binding whose own work for this activation (a
    /// hook's call, converting the tensor) began at `since`: on a sampled step that
    /// time is the agent's too, and is counted with the sample in the step's
    /// `overhead_ms` and in the overhead budget. On a step that is not sampled nothing
    /// is counted, as [`Agent::observe`] costs one atomic load there.
    pub fn observe_since(
        &self,
        name: &str,
        kind: Option<&'static str>,
        activation: &Tensor,
        since: Instant,
    ) {
        if let Some(recorder) = &self.recorder {
            recorder.observe_since(name, kind, activation, Some(since));
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

    /// Runs `forward` once (no gradients) to see layer shapes, then sends one `model`
    /// row per layer. Returns the rows (also for inert agents, so callers can print).
    pub fn profile_model(
        &self,
        vs: &VarStore,
        optimizer: Optimizer,
        forward: impl FnOnce(),
    ) -> Vec<ModelRow> {
        self.profile_parameters(vs.variables(), optimizer, forward)
    }

    /// [`Agent::profile_model`] for parameters given by name (`layer.weight`), as a
    /// PyTorch module's `named_parameters()` lists them.
    pub fn profile_parameters(
        &self,
        parameters: impl IntoIterator<Item = (String, tch::Tensor)>,
        optimizer: Optimizer,
        forward: impl FnOnce(),
    ) -> Vec<ModelRow> {
        let parameters = parameters
            .into_iter()
            .map(|(path, tensor)| profile::Parameter::whole(path, tensor));
        profile::record(self.recorder.as_deref(), parameters, optimizer, forward)
    }

    /// [`Agent::profile_parameters`] for parameters of which this rank may hold a
    /// shard (FSDP): `params` and the FLOPs count whole parameters, the byte
    /// columns this rank's shards.
    pub fn profile_sharded(
        &self,
        parameters: impl IntoIterator<Item = profile::Parameter>,
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
