//! `rankscope._native`: the pyo3 bindings the `rankscope` Python package is built
//! on. Everything that measures, batches, spills or sends is `rankscope-agent`;
//! this crate only converts between Python and Rust values.
//!
//! Layout:
//! - [`NativeAgent`] (here): one rank's agent (`rankscope.init()` wraps it);
//! - `step`: [`NativeStep`] and [`NativePhase`], the step and phase context managers;
//! - `hooks`: [`NativeHook`], the forward hook of a watched module, which a sampled
//!   step's [`NativeStep`] puts in place and takes out, and how an output becomes a
//!   sample (host memory: read here; a GPU: the package's device side reduces it);
//! - `dlpack`: tensors crossing through DLPack;
//! - `report`: [`Report`], what `finish()` returns;
//! - `keywords`: the checks of `init`'s keywords, and the configuration they make.
//!
//! The agent's time on the training thread (the `steps.overhead_ms` column and the
//! overhead budget) includes this crate's own work: the hooks (installing, calling,
//! removing them), converting values, and the Python layer's timed work handed over
//! with `add_overhead_since`. docs/columns.md says what is left out, and its bound.
//!
//! The `rankscope` command is not here: it is the native binary installed beside
//! the package (`python -m rankscope` runs it), so the extension carries no query
//! engine and the command starts without loading libtorch.
//!
//! Tensors cross through DLPack (dlpark), never through numpy, and the extension
//! links no libtorch: one abi3 wheel serves every supported torch.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};
use rankscope_agent::config::{AgentConfigBuilder, OnConfigError};
use rankscope_agent::sampling::worker::JobInput;
use rankscope_agent::sampling::{
    HealthSums, HostSample, KrylovSummary, Reduced, SKETCH_BLOCK, SKETCH_PROBES, SKETCH_SCHEDULE,
    SampleData, Sketched,
};
use rankscope_agent::{Agent, DeviceBytes, DeviceMemory, Optimizer, Parameter};

mod dlpack;
mod hooks;
mod keywords;
mod report;
mod step;

use hooks::{HookSlot, NativeHook, NativePending, TorchSide, layer_kind};
use report::{Report, empty_report};
use step::{NativePhase, NativeStep, comm_kind, step_number};

pyo3::create_exception!(
    rankscope,
    ConfigError,
    pyo3::exceptions::PyValueError,
    "A wrong rankscope setting: the message names the variable or keyword and the fix."
);

/// One rank's agent. Inert (every call returns at once) where the agent is off.
#[pyclass(module = "rankscope._native", frozen)]
struct NativeAgent {
    agent: Agent,
    /// Whether a communication hook records `comm_ms` (then every step has it).
    comm: AtomicBool,
    /// Nanoseconds of all-reduce time recorded since the last step row took it.
    comm_ns: AtomicU64,
    /// The hooks of watched modules, put in place for sampled steps only.
    hooks: Mutex<Vec<HookSlot>>,
    /// `torch.Tensor` and the device side, which the hooks share.
    torch: Py<TorchSide>,
    /// Bytes of device reductions in pinned host memory that the metrics thread holds.
    pinned_held: Arc<AtomicU64>,
}

/// The step rows' device memory, read by a Python callable (the package's, over
/// `torch.cuda`'s counters) that returns `(allocated, reserved, peak)` or `None`.
#[derive(Debug)]
struct PythonDeviceMemory(Py<PyAny>);

impl DeviceMemory for PythonDeviceMemory {
    fn read(&self) -> Option<DeviceBytes> {
        Python::attach(|py| {
            let (allocated, reserved, peak): (u64, u64, u64) =
                self.0.bind(py).call0().ok()?.extract().ok()?;
            Some(DeviceBytes {
                allocated,
                reserved,
                peak,
            })
        })
    }
}

impl NativeAgent {
    /// Hands over the device side's reduction of `token`'s sample (once; a token handed
    /// over already is left alone): `data` makes what it holds from the order of its
    /// Gram matrix (the smaller side), or says why it cannot (then it counts as dropped).
    fn hand_over_device(
        &self,
        token: &Bound<'_, NativePending>,
        data: impl FnOnce(usize) -> Result<SampleData, String>,
    ) {
        let token = token.get();
        let Some(pending) = token.pending.lock().ok().and_then(|mut p| p.take()) else {
            return;
        };
        let sample = data(token.rows.min(token.cols)).map(|data| {
            JobInput::Ready(HostSample {
                rows: token.rows,
                cols: token.cols,
                conv_layout: token.conv_layout,
                seed: pending.seed,
                data,
            })
        });
        self.agent.hand_over(pending, sample);
    }
}

#[pymethods]
impl NativeAgent {
    /// Whether this rank records anything.
    #[getter]
    fn active(&self) -> bool {
        self.agent.is_active()
    }

    #[getter]
    fn rank(&self) -> Option<u32> {
        self.agent.config().map(|c| c.rank)
    }

    #[getter]
    fn run_id(&self) -> Option<String> {
        self.agent.config().map(|c| c.run_id.clone())
    }

    #[getter]
    fn mode(&self) -> Option<&'static str> {
        self.agent.config().map(|c| c.mode.label())
    }

    #[getter]
    fn sample_every(&self) -> Option<u64> {
        self.agent.config().map(|c| c.sample_every)
    }

    /// Whether activations of layer `name` are sampled at all.
    fn wants_layer(&self, name: &str) -> bool {
        self.agent.wants_layer(name)
    }

    /// Begins step `step`: a context manager that records the `steps` row on exit.
    /// A sampled step puts the watched modules' hooks in place (its exit, or `stop`,
    /// takes them away again).
    fn step(slf: &Bound<'_, Self>, step: &Bound<'_, PyAny>) -> PyResult<NativeStep> {
        let step = step_number(step)?;
        let this = slf.get();
        let guard = this.agent.step(step);
        let hooked = guard.sampled() && this.set_hooks(slf.py(), true);
        Ok(NativeStep {
            guard: Some(guard),
            agent: slf.clone().unbind(),
            hooked,
            phase_started: None,
        })
    }

    /// A forward hook observing its module's output as layer `name`
    /// (`hook(module, inputs, output)`, as `register_forward_hook` calls it).
    #[pyo3(signature = (name, kind = None))]
    fn hook(&self, py: Python<'_>, name: &str, kind: Option<&str>) -> NativeHook {
        NativeHook {
            agent: self.agent.clone(),
            torch: self.torch.clone_ref(py),
            name: name.to_string(),
            kind: layer_kind(kind),
            observed: AtomicU64::new(0),
        }
    }

    /// Keeps `hook` for sampled steps: each puts it in `hooks` (a module's
    /// `_forward_hooks`) under `key` (the id `register_forward_hook` gave it) and
    /// takes it out at its end.
    fn watch_hook(&self, hooks: Py<PyAny>, key: Py<PyAny>, hook: Bound<'_, NativeHook>) {
        let slot = HookSlot {
            hooks,
            key,
            hook: hook.into_any().unbind(),
        };
        self.hooks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(slot);
    }

    /// Observes an activation of layer `name` (a no-op unless this step is sampled).
    #[pyo3(signature = (name, tensor, kind = None))]
    fn observe(
        &self,
        py: Python<'_>,
        name: &str,
        tensor: &Bound<'_, PyAny>,
        kind: Option<&str>,
    ) -> PyResult<()> {
        let since = Instant::now();
        let torch = self.torch.bind(py).get();
        if !tensor.is_instance(torch.tensor_type.bind(py))? {
            return Err(PyTypeError::new_err(format!(
                "observe({name:?}, ...): expected a torch.Tensor, got {}",
                tensor.get_type()
            )));
        }
        hooks::observe(&self.agent, torch, name, layer_kind(kind), tensor, since);
        Ok(())
    }

    /// Sets the device side (`rankscope._device.DeviceSide`) that reduces samples on a
    /// GPU. Once.
    fn _set_device_side(&self, py: Python<'_>, device_side: Py<PyAny>) -> PyResult<()> {
        self.torch
            .bind(py)
            .get()
            .device_side
            .set(device_side)
            .map_err(|_| PyRuntimeError::new_err("the device side is set already"))
    }

    /// Tests only: `True` sends host tensors to the device side as well (its
    /// reduction runs there without a stream), to check its numbers without a GPU.
    fn _host_to_device_side(&self, py: Python<'_>, on: bool) {
        self.torch
            .bind(py)
            .get()
            .host_to_device_side
            .store(on, Ordering::Relaxed);
    }

    /// Sets what reads the device memory of every step row: a callable returning
    /// `(allocated, reserved, peak)` bytes or `None`, called at the end of each step.
    fn _set_device_memory(&self, read: Py<PyAny>) {
        self.agent
            .set_device_memory(Box::new(PythonDeviceMemory(read)));
    }

    /// Hands over a sample the device side reduced (its event has completed): the
    /// health sums over its finite elements and its Gram matrix (a contiguous float32
    /// host tensor, `None` when an element is not finite).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (token, finite, nonfinite, sum, sum_sq, zeros, gram))]
    fn hand_over_reduced(
        &self,
        token: &Bound<'_, NativePending>,
        finite: u64,
        nonfinite: u64,
        sum: f64,
        sum_sq: f64,
        zeros: u64,
        gram: Option<&Bound<'_, PyAny>>,
    ) {
        let health = HealthSums {
            finite,
            nonfinite,
            sum,
            sum_sq,
            zeros,
        };
        self.hand_over_device(token, |side| {
            let gram = match gram {
                Some(g) => Some(
                    Box::new(dlpack::Pinned::gram(g, side, self.pinned_held.clone())?)
                        as Box<dyn rankscope_agent::sampling::F32Buffer>,
                ),
                None => None,
            };
            Ok(SampleData::Reduced(Reduced { health, gram, side }))
        });
    }

    /// Hands over a sample the device side reduced for the sketch (its event has
    /// completed): the health sums, Σλ, and its Krylov process packed into one
    /// contiguous float64 host tensor (`None` when an element is not finite); the
    /// packed order is `KrylovSummary::from_packed`'s.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (token, finite, nonfinite, sum, sum_sq, zeros, trace, packed))]
    fn hand_over_sketched(
        &self,
        token: &Bound<'_, NativePending>,
        finite: u64,
        nonfinite: u64,
        sum: f64,
        sum_sq: f64,
        zeros: u64,
        trace: f64,
        packed: Option<&Bound<'_, PyAny>>,
    ) {
        let health = HealthSums {
            finite,
            nonfinite,
            sum,
            sum_sq,
            zeros,
        };
        self.hand_over_device(token, |_side| {
            let packed = match packed {
                Some(p) => Some(
                    Box::new(dlpack::Pinned::summary(p, self.pinned_held.clone())?)
                        as Box<dyn rankscope_agent::sampling::F64Buffer>,
                ),
                None => None,
            };
            Ok(SampleData::Sketched(Sketched {
                health,
                trace,
                packed,
            }))
        });
    }

    /// Hands over a sample the device side could not reduce (or skipped: its
    /// pinned-memory pool was full), counted as dropped with `why` in an event.
    fn hand_over_failed(&self, token: &Bound<'_, NativePending>, why: &str) {
        if let Some(pending) = token.get().pending.lock().ok().and_then(|mut p| p.take()) {
            self.agent.hand_over(pending, Err(why.to_string()));
        }
    }

    /// Adds `ns` of device time spent on `samples` samples' side-stream work (read
    /// from its events once they completed): the next step row's
    /// `overhead_device_ms`, and the budget's device share.
    fn add_device_ns(&self, ns: u64, samples: u64) {
        self.agent.add_device_ns(ns, samples);
    }

    /// Adds `ns` of CPU time of the device side's own thread (`rankscope._device`),
    /// which the overhead budget counts as the agent's.
    fn add_thread_ns(&self, ns: u64) {
        self.agent.add_device_thread_ns(ns);
    }

    /// Sleeps `ms` at the end of every sampled step from now on, unseen by the agent's
    /// clocks: a cost only the observed slowdown finds (tests only:
    /// python/tests/test_budget.py).
    fn _inject_sampled_step_delay(&self, ms: f64) -> PyResult<()> {
        if !(ms.is_finite() && (0.0..=60_000.0).contains(&ms)) {
            return Err(PyValueError::new_err(format!(
                "delay {ms} ms is not between 0 and 60000"
            )));
        }
        self.agent
            .inject_sampled_step_delay(std::time::Duration::from_secs_f64(ms / 1e3));
        Ok(())
    }

    /// Bytes of device reductions in pinned host memory that the metrics thread holds.
    fn pinned_bytes_held(&self) -> u64 {
        self.pinned_held.load(Ordering::Relaxed)
    }

    /// `False`: samples are copied into new allocations, as before the agent reused
    /// their buffers (benchmarks only: python/benches/ddp_ab.py).
    fn _reuse_sample_buffers(&self, reuse: bool) {
        self.agent.reuse_sample_buffers(reuse);
    }

    /// `True`: samples wait on the training side until `_hold_samples(False)` hands
    /// them to the metrics thread (measurements only: python/tests/test_api.py).
    fn _hold_samples(&self, hold: bool) {
        self.agent.hold_samples(hold);
    }

    /// Drops the held samples (counted as dropped); returns how many (measurements
    /// only: python/tests/test_api.py).
    fn _discard_held_samples(&self) -> usize {
        self.agent.discard_held_samples()
    }

    /// Counts the time since `since_ns` (`time.perf_counter_ns()`) as the agent's on
    /// the training thread, this call included: for the Python layer's own work.
    /// `sampling`: it was spent because the step is sampled.
    #[pyo3(signature = (since_ns, sampling = false))]
    fn add_overhead_since(&self, since_ns: u64, sampling: bool) {
        self.agent
            .add_overhead_since_monotonic_ns(since_ns, sampling);
    }

    /// Turns on `comm_ms` in every later step row.
    fn enable_comm(&self) {
        self.comm.store(true, Ordering::Relaxed);
    }

    /// Adds one bucket's all-reduce time (launch to completion) to the current step.
    fn add_comm_ms(&self, ms: f64) {
        if ms.is_finite() && ms >= 0.0 {
            self.comm_ns.fetch_add((ms * 1e6) as u64, Ordering::Relaxed);
        }
    }

    /// Adds `count` collectives of `kind` (`all_reduce`, `all_gather`,
    /// `reduce_scatter`, `broadcast` or `other`), `nbytes` and `ms` (launch to
    /// completion) in all, to the `comm` rows of the running step (between steps:
    /// rows without a step). Callable from any thread.
    fn add_comm(&self, kind: &str, count: u64, nbytes: u64, ms: f64) -> PyResult<()> {
        self.agent.add_comm(comm_kind(kind)?, count, nbytes, ms);
        Ok(())
    }

    /// Records an event row.
    #[pyo3(signature = (kind, message, value = None))]
    fn event(&self, kind: &Bound<'_, PyString>, message: &Bound<'_, PyString>, value: Option<i64>) {
        // Text that is not valid Unicode (a lone surrogate) is kept, with U+FFFD there.
        self.agent
            .event(&kind.to_string_lossy(), &message.to_string_lossy(), value);
    }

    /// Runs `forward()` once (which turns gradients off) to see layer shapes, then
    /// records one `model` row per layer from `parameters`: `(name, shape,
    /// element_bytes, requires_grad, whole_shape)` of this rank's tensor, where
    /// `whole_shape` is the whole parameter's shape if the tensor is a shard of it
    /// (else `None`). Returns the rows as dicts.
    #[allow(clippy::type_complexity)]
    fn profile<'py>(
        &self,
        py: Python<'py>,
        parameters: Vec<(String, Vec<i64>, u64, bool, Option<Vec<i64>>)>,
        optimizer: &str,
        forward: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let optimizer = match optimizer {
            "adam" => Optimizer::Adam,
            "sgd_momentum" => Optimizer::SgdMomentum,
            "sgd" => Optimizer::Sgd,
            other => {
                return Err(PyValueError::new_err(format!(
                    "optimizer kind {other:?}: use adam, sgd_momentum or sgd"
                )));
            }
        };
        let mut failure = None;
        let rows = self.agent.profile_parameters(
            parameters.into_iter().map(
                |(path, shape, element_bytes, requires_grad, whole_shape)| Parameter {
                    path,
                    shape,
                    element_bytes,
                    requires_grad,
                    whole_shape,
                },
            ),
            optimizer,
            || {
                if let Err(error) = forward.call0() {
                    failure = Some(error);
                }
            },
        );
        if let Some(error) = failure {
            return Err(error);
        }
        let list = PyList::empty(py);
        for row in rows {
            let d = PyDict::new(py);
            d.set_item("layer", row.layer)?;
            d.set_item("kind", row.kind)?;
            d.set_item("params", row.params)?;
            d.set_item("param_bytes", row.param_bytes)?;
            d.set_item("grad_bytes", row.grad_bytes)?;
            d.set_item("optimizer_bytes", row.optimizer_bytes)?;
            d.set_item("forward_flops", row.forward_flops)?;
            d.set_item("output_shape", row.output_shape)?;
            list.append(d)?;
        }
        Ok(list)
    }

    /// `(activations sampled, of which dropped, planned but skipped)` so far.
    fn samples(&self) -> (u64, u64, u64) {
        let samples = self.agent.activation_samples();
        (samples.taken, samples.dropped, samples.skipped)
    }

    /// What the agent has cost so far, by share of the overhead budget (see
    /// `Agent.overhead` in Python); `None` for an inert agent.
    fn overhead<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(o) = self.agent.overhead() else {
            return Ok(None);
        };
        let samples = self.agent.activation_samples();
        let d = PyDict::new(py);
        d.set_item("budget", o.budget.fraction())?;
        d.set_item("cpu_share", o.share())?;
        d.set_item("agent_cpu_ms", o.agent_ns as f64 / 1e6)?;
        d.set_item("training_thread_ms", o.training_ns as f64 / 1e6)?;
        d.set_item("metrics_thread_ms", o.metrics_ns as f64 / 1e6)?;
        d.set_item("transport_thread_ms", o.transport_ns as f64 / 1e6)?;
        d.set_item("device_thread_ms", o.device_thread_ns as f64 / 1e6)?;
        d.set_item("process_cpu_ms", o.process_ns as f64 / 1e6)?;
        d.set_item("device_ms", o.device_ns as f64 / 1e6)?;
        d.set_item("device_samples", o.device_samples)?;
        d.set_item("observed_ms", o.observed_ms)?;
        d.set_item("observed_steps", o.observed_steps)?;
        d.set_item("observed_per_step_ms", o.observed_per_step_ms)?;
        d.set_item("skipped_cpu", samples.skipped_cpu)?;
        d.set_item("skipped_device", samples.skipped_device)?;
        d.set_item("skipped_observed", samples.skipped_observed)?;
        d.set_item("skipped_queue_full", samples.skipped_queue_full)?;
        d.set_item("steps_floor", samples.steps_floor)?;
        Ok(Some(d))
    }

    /// Samples handed to the metrics thread and not yet measured.
    fn queued_samples(&self) -> u64 {
        self.agent.queued_samples()
    }

    /// Flushes everything and waits (at most the finish timeout) for the collector to
    /// acknowledge it, without holding the GIL. Callable more than once.
    fn finish(&self, py: Python<'_>) -> Report {
        let agent = self.agent.clone();
        Report::from(py.detach(move || agent.finish()))
    }
}

/// Starts the agent of this rank. Keywords override `RANKSCOPE_*` variables, which
/// override defaults. A wrong setting raises `ConfigError`, or with
/// `RANKSCOPE_ON_CONFIG_ERROR=disable` warns once and returns an inert agent.
#[pyfunction]
#[pyo3(signature = (*, collector = None, run_id = None, mode = None, sample_every = None, layers = None, max_rows = None, workload = None, overhead_budget = None, metrics_threads = None))]
#[allow(clippy::too_many_arguments)]
fn init(
    py: Python<'_>,
    collector: Option<Bound<'_, PyAny>>,
    run_id: Option<Bound<'_, PyAny>>,
    mode: Option<Bound<'_, PyAny>>,
    sample_every: Option<Bound<'_, PyAny>>,
    layers: Option<Bound<'_, PyAny>>,
    max_rows: Option<Bound<'_, PyAny>>,
    workload: Option<Bound<'_, PyAny>>,
    overhead_budget: Option<Bound<'_, PyAny>>,
    metrics_threads: Option<Bound<'_, PyAny>>,
) -> PyResult<NativeAgent> {
    init_logging();
    let keywords = keywords::Keywords {
        collector: collector.as_ref(),
        run_id: run_id.as_ref(),
        mode: mode.as_ref(),
        sample_every: sample_every.as_ref(),
        layers: layers.as_ref(),
        max_rows: max_rows.as_ref(),
        workload: workload.as_ref(),
        overhead_budget: overhead_budget.as_ref(),
        metrics_threads: metrics_threads.as_ref(),
    };
    // A keyword of the wrong type is a TypeError, always raised; a wrong value (a
    // ConfigError) or a wrong variable is subject to RANKSCOPE_ON_CONFIG_ERROR.
    let config = match keywords.builder() {
        Ok(builder) => builder.build().map_err(|e| e.to_string()),
        Err(error) if error.is_instance_of::<ConfigError>(py) => Err(error.value(py).to_string()),
        Err(error) => return Err(error),
    };
    let agent = match config {
        Ok(config) => py.detach(|| Agent::new(config)),
        Err(error) => match AgentConfigBuilder::default().on_error() {
            Ok(OnConfigError::Disable) => {
                let warning = py.get_type::<pyo3::exceptions::PyRuntimeWarning>();
                PyErr::warn(
                    py,
                    &warning,
                    &std::ffi::CString::new(format!(
                        "rankscope disabled by RANKSCOPE_ON_CONFIG_ERROR=disable: {error}"
                    ))
                    .unwrap_or_default(),
                    1,
                )?;
                Agent::disabled()
            }
            Ok(OnConfigError::Fail) => return Err(ConfigError::new_err(error)),
            Err(on_error) => return Err(ConfigError::new_err(on_error.to_string())),
        },
    };
    let tensor_type = py.import("torch")?.getattr("Tensor")?.unbind();
    let torch = Py::new(
        py,
        TorchSide {
            tensor_type,
            device_side: OnceLock::new(),
            host_to_device_side: AtomicBool::new(false),
        },
    )?;
    Ok(NativeAgent {
        agent,
        comm: AtomicBool::new(false),
        comm_ns: AtomicU64::new(0),
        hooks: Mutex::new(Vec::new()),
        torch,
        pinned_held: Arc::new(AtomicU64::new(0)),
    })
}

/// Logs go to stderr, filtered by `RANKSCOPE_LOG` (default: warnings and errors).
fn init_logging() {
    static ONCE: Mutex<bool> = Mutex::new(false);
    let mut done = ONCE.lock().unwrap_or_else(|e| e.into_inner());
    if !*done {
        *done = true;
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_env("RANKSCOPE_LOG")
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            )
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init();
    }
}

/// The rows of `rows` that a sample capped at `keep` rows draws from `seed`, sorted, as
/// little-endian int64 bytes: the core's `choose_rows`, which the host path draws too,
/// computed without holding the interpreter (the device side's thread calls it).
#[pyfunction]
fn choose_rows(py: Python<'_>, rows: u64, keep: u64, seed: u64) -> Bound<'_, PyBytes> {
    let bytes: Vec<u8> = py.detach(|| {
        rankscope_agent::sampling::choose_rows(rows, keep, seed)
            .iter()
            .flat_map(|r| r.to_le_bytes())
            .collect()
    });
    PyBytes::new(py, &bytes)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    // The sketch's shape, for the device side's Krylov process (rankscope._device).
    m.add("SKETCH_BLOCK", SKETCH_BLOCK)?;
    m.add("SKETCH_PROBES", SKETCH_PROBES)?;
    m.add("SKETCH_SCHEDULE", SKETCH_SCHEDULE.to_vec())?;
    // A packed summary's length by the depths it holds (1 to the schedule's).
    m.add("SKETCH_PACKED_LENS", KrylovSummary::packed_lens().to_vec())?;
    m.add_class::<NativeAgent>()?;
    m.add_class::<NativeStep>()?;
    m.add_class::<NativePhase>()?;
    m.add_class::<NativeHook>()?;
    m.add_class::<NativePending>()?;
    m.add_class::<TorchSide>()?;
    m.add_class::<Report>()?;
    m.add_function(wrap_pyfunction!(init, m)?)?;
    m.add_function(wrap_pyfunction!(choose_rows, m)?)?;
    m.add_function(wrap_pyfunction!(empty_report, m)?)?;
    Ok(())
}
