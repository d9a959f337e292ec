//! `rankscope._native`: the pyo3 bindings the `rankscope` Python package is built
//! on. Everything that measures, batches, spills or sends is `rankscope-agent`;
//! this crate only converts between Python and Rust values.
//!
//! Layout:
//! - [`NativeAgent`]: one rank's agent (`rankscope.init()` wraps it);
//! - [`NativeStep`] and [`NativePhase`]: the step and phase context managers;
//! - [`NativeHook`]: the forward hook of a watched module, which a sampled step's
//!   [`NativeStep`] installs and removes;
//! - [`Report`]: what `finish()` returns.
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
//! Tensors cross as the caller's `at::Tensor` (pyo3-tch), never through numpy.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyFloat, PyInt, PyList, PyTuple};
use pyo3_tch::PyTensor;
use rankscope_agent::Optimizer;
use rankscope_agent::config::{AgentConfigBuilder, OnConfigError};
use rankscope_agent::{Agent, CommKind, FinishReport, Mode};
use rankscope_agent::{Phase, StepGuard};
use tch::Tensor;

mod keywords;

pyo3::create_exception!(
    rankscope,
    ConfigError,
    pyo3::exceptions::PyValueError,
    "A wrong rankscope setting: the message names the variable or keyword and the fix."
);

/// The torch whose libtorch this extension links (`build.rs`; the package checks it
/// before loading the extension).
const BUILT_TORCH: &str = env!("RANKSCOPE_BUILT_TORCH");

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
}

/// Where a watched module's [`NativeHook`] goes on a sampled step: the module's
/// `_forward_hooks` dict, under the id torch gave it when it was registered once.
/// Setting and deleting that entry is what `register_forward_hook` and its handle's
/// `remove()` do, at a fraction of the cost and with no handle to allocate.
struct HookSlot {
    hooks: PyObject,
    key: PyObject,
    hook: PyObject,
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
    fn step(slf: &Bound<'_, Self>, step: u64) -> NativeStep {
        let this = slf.get();
        let guard = this.agent.step(step);
        let hooked = guard.sampled() && this.set_hooks(slf.py(), true);
        NativeStep {
            guard: Some(guard),
            agent: slf.clone().unbind(),
            hooked,
            phase_started: None,
        }
    }

    /// A forward hook observing its module's output as layer `name`
    /// (`hook(module, inputs, output)`, as `register_forward_hook` calls it).
    #[pyo3(signature = (name, kind = None))]
    fn hook(&self, name: &str, kind: Option<&str>) -> NativeHook {
        NativeHook {
            agent: self.agent.clone(),
            name: name.to_string(),
            kind: layer_kind(kind),
            observed: AtomicU64::new(0),
        }
    }

    /// Keeps `hook` for sampled steps: each puts it in `hooks` (a module's
    /// `_forward_hooks`) under `key` (the id `register_forward_hook` gave it) and
    /// takes it out at its end.
    fn watch_hook(&self, hooks: PyObject, key: PyObject, hook: Bound<'_, NativeHook>) {
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
    fn observe(&self, name: &str, tensor: &Bound<'_, PyAny>, kind: Option<&str>) -> PyResult<()> {
        let since = Instant::now();
        let Some(tensor) = tensor_of(tensor) else {
            return Err(PyTypeError::new_err(format!(
                "observe({name:?}, ...): expected a torch.Tensor, got {}",
                tensor.get_type()
            )));
        };
        self.agent
            .observe_since(name, layer_kind(kind), &tensor, since);
        Ok(())
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
    fn event(&self, kind: &str, message: &str, value: Option<i64>) {
        self.agent.event(kind, message, value);
    }

    /// Runs `forward()` once with gradients off to see layer shapes, then records one
    /// `model` row per layer from `parameters`: `(name, tensor, whole_shape)`, where
    /// `tensor` is this rank's and `whole_shape` the whole parameter's shape if
    /// `tensor` is a shard of it (else `None`). Returns the rows as dicts.
    fn profile<'py>(
        &self,
        py: Python<'py>,
        parameters: Vec<(String, PyTensor, Option<Vec<i64>>)>,
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
        let rows = self.agent.profile_sharded(
            parameters.into_iter().map(|(path, t, whole_shape)| {
                rankscope_agent::training::profile::Parameter {
                    path,
                    tensor: t.0,
                    whole_shape,
                }
            }),
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

    /// Samples handed to the metrics thread and not yet measured.
    fn queued_samples(&self) -> u64 {
        self.agent.queued_samples()
    }

    /// Flushes everything and waits (at most the finish timeout) for the collector to
    /// acknowledge it, without holding the GIL. Callable more than once.
    fn finish(&self, py: Python<'_>) -> Report {
        let agent = self.agent.clone();
        Report::from(py.allow_threads(move || agent.finish()))
    }
}

impl NativeAgent {
    /// Puts every watched module's hook in place (`on`) or takes it out, counting
    /// the time as the sampled step's. Returns whether there were hooks.
    fn set_hooks(&self, py: Python<'_>, on: bool) -> bool {
        let since = Instant::now();
        let slots = self.hooks.lock().unwrap_or_else(|e| e.into_inner());
        if slots.is_empty() {
            return false;
        }
        for slot in slots.iter() {
            let hooks = slot.hooks.bind(py);
            // A module whose hooks dict no longer takes ours loses its samples, not
            // the step; one already without it (removed by hand) is left as it is.
            let _ = if on {
                hooks.set_item(&slot.key, &slot.hook)
            } else {
                hooks.del_item(&slot.key)
            };
        }
        drop(slots);
        self.agent.add_overhead(since, true);
        true
    }
}

/// The forward hook of one watched module: observes the module's output (or the
/// first tensor of a tuple or list output) as its layer. A Rust object rather than
/// a Python function, so a call runs no Python frame and allocates nothing, and its
/// time from the call's start is the agent's (with the sample it takes).
#[pyclass(module = "rankscope._native", frozen)]
struct NativeHook {
    agent: Agent,
    name: String,
    kind: Option<&'static str>,
    /// One more than the sampled step this hook last observed (0: none), so a
    /// layer is sampled once per step: activation checkpointing runs the forward
    /// again in backward, and that recomputed output is not sampled again.
    observed: AtomicU64,
}

#[pymethods]
impl NativeHook {
    fn __call__(
        &self,
        _module: &Bound<'_, PyAny>,
        _inputs: &Bound<'_, PyAny>,
        output: &Bound<'_, PyAny>,
    ) {
        let since = Instant::now();
        if let Some(step) = self.agent.sampling_step()
            && self.observed.swap(step + 1, Ordering::Relaxed) == step + 1
        {
            self.agent.add_overhead(since, true);
            return;
        }
        if let Some(tensor) = first_tensor(output) {
            self.agent
                .observe_since(&self.name, self.kind, &tensor, since);
        }
    }

    fn __repr__(&self) -> String {
        format!("rankscope hook of layer {:?}", self.name)
    }
}

/// The kinds a layer may be given; anything else is none.
fn layer_kind(kind: Option<&str>) -> Option<&'static str> {
    match kind {
        Some("attention") => Some("attention"),
        _ => None,
    }
}

/// The tensor `obj` is (a reference to the same tensor), or `None`, without raising.
fn tensor_of(obj: &Bound<'_, PyAny>) -> Option<Tensor> {
    let ptr = obj.as_ptr() as *mut tch::python::CPyObject;
    // SAFETY: `ptr` is a live Python object; the GIL is held.
    unsafe { Tensor::pyobject_unpack(ptr) }.ok().flatten()
}

/// A module's output as a tensor: itself, or the first tensor of a tuple or list.
fn first_tensor(output: &Bound<'_, PyAny>) -> Option<Tensor> {
    if let Some(t) = tensor_of(output) {
        return Some(t);
    }
    if let Ok(tuple) = output.downcast::<PyTuple>() {
        return tuple.iter().find_map(|item| tensor_of(&item));
    }
    if let Ok(list) = output.downcast::<PyList>() {
        return list.iter().find_map(|item| tensor_of(&item));
    }
    None
}

/// One training step. `with agent.step(i) as s:` records the `steps` row on exit.
#[pyclass(module = "rankscope._native", unsendable)]
struct NativeStep {
    guard: Option<StepGuard>,
    agent: Py<NativeAgent>,
    /// Whether this (sampled) step put the watched modules' hooks in place.
    hooked: bool,
    /// The phase being timed, by [`NativeStep::phase`]'s context manager.
    phase_started: Option<(Phase, Instant)>,
}

#[pymethods]
impl NativeStep {
    /// The step index.
    #[getter]
    fn index(&self) -> Option<u64> {
        self.guard.as_ref().map(StepGuard::index)
    }

    /// Whether layer activations are sampled in this step.
    #[getter]
    fn sampled(&self) -> bool {
        self.guard.as_ref().is_some_and(StepGuard::sampled)
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __exit__(
        &mut self,
        py: Python<'_>,
        _exc_type: PyObject,
        _exc: PyObject,
        _tb: PyObject,
    ) -> PyResult<bool> {
        self.end(py);
        self.guard.take();
        Ok(false)
    }

    /// Ends the step's clock (and its hooks) without sending the row, for values
    /// still being computed on the device; [`NativeStep::send`] sends it.
    fn stop(&mut self, py: Python<'_>) {
        self.end(py);
    }

    /// Sends the row now (normally done on exit). Callable more than once.
    fn send(&mut self) {
        self.guard.take();
    }

    /// A context manager timing one phase: `data`, `forward`, `backward` or
    /// `optimizer`. Entering a phase twice in a step adds up.
    fn phase(slf: PyRefMut<'_, Self>, name: &str) -> PyResult<NativePhase> {
        let phase = Phase::parse(name).ok_or_else(|| {
            PyValueError::new_err(format!(
                "phase {name:?} is not a phase: use data, forward, backward or optimizer"
            ))
        })?;
        Ok(NativePhase {
            step: slf.into(),
            phase,
        })
    }

    /// Records the step's values: floats, ints or 0-d CPU tensors (a tensor on an
    /// accelerator is read by the Python layer without a device sync).
    #[pyo3(signature = (*, loss = None, lr = None, grad_norm = None, samples = None))]
    fn record(
        &self,
        py: Python<'_>,
        loss: Option<&Bound<'_, PyAny>>,
        lr: Option<&Bound<'_, PyAny>>,
        grad_norm: Option<&Bound<'_, PyAny>>,
        samples: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let since = Instant::now();
        let recorded = self.record_values(loss, lr, grad_norm, samples);
        self.agent.bind(py).get().agent.add_overhead(since, false);
        recorded
    }

    /// Adds collectives to this step's `comm` rows after its clock stopped (the
    /// Python layer does, from CUDA events); as `NativeAgent.add_comm`.
    fn add_comm(&self, kind: &str, count: u64, nbytes: u64, ms: f64) -> PyResult<()> {
        let kind = comm_kind(kind)?;
        if let Some(guard) = &self.guard {
            guard.add_comm(kind, count, nbytes, ms);
        }
        Ok(())
    }

    /// Sets the step's `comm_ms` (the Python layer does, from CUDA events).
    fn set_comm_ms(&self, ms: f64) {
        if let Some(guard) = &self.guard {
            guard.comm_ms(ms);
        }
    }
}

impl NativeStep {
    fn record_values(
        &self,
        loss: Option<&Bound<'_, PyAny>>,
        lr: Option<&Bound<'_, PyAny>>,
        grad_norm: Option<&Bound<'_, PyAny>>,
        samples: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let Some(guard) = &self.guard else {
            return Ok(());
        };
        if let Some(v) = loss {
            guard.loss(number("loss", v)?);
        }
        if let Some(v) = lr {
            guard.lr(number("lr", v)?);
        }
        if let Some(v) = grad_norm {
            guard.grad_norm(number("grad_norm", v)?);
        }
        if let Some(v) = samples {
            let n = number("samples", v)?;
            if !(n >= 0.0 && n.is_finite()) {
                return Err(PyValueError::new_err(format!(
                    "samples={n}: give the number of training examples in the step (0 or more)"
                )));
            }
            guard.samples(n as u64);
        }
        Ok(())
    }

    /// The step's end before its row: the all-reduce time into the row, the hooks
    /// out of the modules (this time counted in the step's own `overhead_ms`), and
    /// the step's clock stopped. Callable more than once.
    fn end(&mut self, py: Python<'_>) {
        let since = Instant::now();
        self.take_comm(py);
        let agent = self.agent.bind(py).get();
        let hooked = std::mem::take(&mut self.hooked);
        if hooked {
            agent.set_hooks(py, false);
        }
        agent.agent.add_overhead(since, false);
        if let Some(guard) = &self.guard {
            guard.stop();
        }
    }

    /// Moves the all-reduce time recorded during this step into its row.
    fn take_comm(&self, py: Python<'_>) {
        let agent = self.agent.bind(py).get();
        if !agent.comm.load(Ordering::Relaxed) {
            return;
        }
        let ns = agent.comm_ns.swap(0, Ordering::Relaxed);
        if let Some(guard) = &self.guard {
            guard.comm_ms(ns as f64 / 1e6);
        }
    }

    fn phase_begin(&mut self, phase: Phase) -> PyResult<()> {
        if let Some((open, _)) = self.phase_started {
            return Err(PyRuntimeError::new_err(format!(
                "phase {:?} entered inside phase {:?}: phases do not nest; end one before the next",
                phase.label(),
                open.label()
            )));
        }
        self.phase_started = Some((phase, Instant::now()));
        Ok(())
    }

    fn phase_end(&mut self) {
        if let Some((phase, started)) = self.phase_started.take()
            && let Some(guard) = &self.guard
        {
            guard.add_phase_ms(phase, started.elapsed().as_secs_f64() * 1e3);
        }
    }
}

impl Drop for NativeStep {
    /// A step left without `with` (or `stop`) still takes its hooks out.
    fn drop(&mut self) {
        if self.hooked {
            Python::with_gil(|py| self.end(py));
        }
    }
}

/// `with s.phase("forward"):` times one phase of a step.
#[pyclass(module = "rankscope._native", unsendable)]
struct NativePhase {
    step: Py<NativeStep>,
    phase: Phase,
}

#[pymethods]
impl NativePhase {
    fn __enter__(slf: PyRef<'_, Self>, py: Python<'_>) -> PyResult<()> {
        slf.step.borrow_mut(py).phase_begin(slf.phase)
    }

    fn __exit__(&self, py: Python<'_>, _exc_type: PyObject, _exc: PyObject, _tb: PyObject) -> bool {
        self.step.borrow_mut(py).phase_end();
        false
    }
}

/// The collective kind a `comm.kind` label names, or a `ValueError` listing them.
fn comm_kind(label: &str) -> PyResult<CommKind> {
    CommKind::parse(label).ok_or_else(|| {
        PyValueError::new_err(format!(
            "comm kind {label:?} is not a kind: use all_reduce, all_gather, reduce_scatter, \
             broadcast or other"
        ))
    })
}

/// A float from a Python number or a 0-d CPU tensor.
fn number(field: &str, value: &Bound<'_, PyAny>) -> PyResult<f64> {
    // Plain numbers first; a tensor goes through libtorch, never `__float__` (which
    // warns on tensors that require grad).
    if value.is_instance_of::<PyFloat>() || value.is_instance_of::<PyInt>() {
        return value.extract::<f64>();
    }
    let tensor = value.extract::<PyTensor>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{field}: expected a float, an int or a 0-d tensor, got {}",
            value.get_type()
        ))
    })?;
    if tensor.numel() != 1 {
        return Err(PyValueError::new_err(format!(
            "{field}: expected a 0-d tensor, got shape {:?}; pass a scalar such as loss.detach()",
            tensor.size()
        )));
    }
    tensor
        .f_double_value(&[])
        .or_else(|_| tensor.f_reshape([-1])?.f_double_value(&[0]))
        .map_err(|e| PyValueError::new_err(format!("{field}: cannot read the tensor: {e}")))
}

/// What `finish()` returns: rows sent, acknowledged, dropped and left unsent.
#[pyclass(module = "rankscope._native", frozen, get_all)]
#[derive(Clone)]
struct Report {
    /// Rows handed to the transport.
    rows_sent: u64,
    /// Rows the collector acknowledged as durable.
    rows_acked: u64,
    /// Rows dropped because a queue or the outbox was full (also an `events` row).
    rows_dropped: u64,
    /// Rows still unacknowledged at the deadline (collector unreachable).
    rows_unsent: u64,
    /// Of those, rows kept on disk for a later process or `rankscope replay`.
    rows_spilled: u64,
    /// The spill directory that holds them.
    spill_dir: Option<String>,
    /// Whether the collector was ever reached.
    connected: bool,
    /// Whether every row reached durable storage.
    complete: bool,
}

#[pymethods]
impl Report {
    fn __repr__(&self) -> String {
        format!(
            "Report(rows_sent={}, rows_acked={}, rows_dropped={}, rows_unsent={}, rows_spilled={}, spill_dir={:?}, connected={}, complete={})",
            self.rows_sent,
            self.rows_acked,
            self.rows_dropped,
            self.rows_unsent,
            self.rows_spilled,
            self.spill_dir,
            self.connected,
            self.complete
        )
    }
}

impl From<FinishReport> for Report {
    fn from(r: FinishReport) -> Report {
        Report {
            complete: r.complete(),
            rows_sent: r.rows_queued,
            rows_acked: r.rows_acked,
            rows_dropped: r.rows_dropped,
            rows_unsent: r.rows_unacked,
            rows_spilled: r.rows_spilled,
            spill_dir: r.rank_spill_dir.map(|d| d.display().to_string()),
            connected: r.connected,
        }
    }
}

/// Starts the agent of this rank. Keywords override `RANKSCOPE_*` variables, which
/// override defaults. A wrong setting raises `ConfigError`, or with
/// `RANKSCOPE_ON_CONFIG_ERROR=disable` warns once and returns an inert agent.
#[pyfunction]
#[pyo3(signature = (*, collector = None, run_id = None, mode = None, sample_every = None, layers = None, max_rows = None, workload = None, overhead_budget = None))]
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
) -> PyResult<NativeAgent> {
    init_logging();
    let collector = keywords::text("collector", collector.as_ref(), "\"10.0.0.1:50051\"")?;
    let run_id = keywords::text("run_id", run_id.as_ref(), "\"exp-42\"")?;
    let mode = keywords::text("mode", mode.as_ref(), "\"rank0\"")?;
    let sample_every = keywords::whole(
        "sample_every",
        sample_every.as_ref(),
        1,
        "the sampling interval in steps (RANKSCOPE_SAMPLE_EVERY)",
        "10",
    )?;
    let layers = keywords::text("layers", layers.as_ref(), "\"blocks.*.mlp\"")?;
    let max_rows = keywords::whole(
        "max_rows",
        max_rows.as_ref(),
        1,
        "the row cap of an activation matrix (RANKSCOPE_MAX_ROWS)",
        "4096",
    )?
    .map(|n| usize::try_from(n).unwrap_or(usize::MAX));
    let workload = keywords::text("workload", workload.as_ref(), "\"gpt-small\"")?;
    let overhead_budget = keywords::overhead_budget(overhead_budget.as_ref())?;
    let mut builder = AgentConfigBuilder {
        collector,
        run_id,
        sample_every,
        layer_filter: layers,
        max_rows,
        overhead_budget,
        workload: Some(workload.unwrap_or_else(|| "python".into())),
        ..Default::default()
    };
    let config = match mode.as_deref().map(|m| (m, Mode::parse(m))) {
        Some((text, None)) => {
            return Err(ConfigError::new_err(format!(
                "mode={text:?} is not a mode: use full, rank0, steps or off"
            )));
        }
        Some((_, Some(m))) => {
            builder.mode = Some(m);
            builder.build()
        }
        None => builder.build(),
    };
    let agent = match config {
        Ok(config) => py.allow_threads(|| Agent::new(config)),
        Err(error) => match builder.on_error() {
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
            Ok(OnConfigError::Fail) => return Err(ConfigError::new_err(error.to_string())),
            Err(on_error) => return Err(ConfigError::new_err(on_error.to_string())),
        },
    };
    Ok(NativeAgent {
        agent,
        comm: AtomicBool::new(false),
        comm_ns: AtomicU64::new(0),
        hooks: Mutex::new(Vec::new()),
    })
}

/// The report of an agent that recorded nothing.
#[pyfunction]
fn empty_report() -> Report {
    Report::from(FinishReport::default())
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

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("BUILT_TORCH", BUILT_TORCH)?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add_class::<NativeAgent>()?;
    m.add_class::<NativeStep>()?;
    m.add_class::<NativePhase>()?;
    m.add_class::<NativeHook>()?;
    m.add_class::<Report>()?;
    m.add_function(wrap_pyfunction!(init, m)?)?;
    m.add_function(wrap_pyfunction!(empty_report, m)?)?;
    Ok(())
}
