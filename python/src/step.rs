//! [`NativeStep`] and [`NativePhase`]: the step and phase context managers, and the
//! conversion of the values a step records.

use std::sync::atomic::Ordering;
use std::time::Instant;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyFloat, PyInt};
use rankscope_agent::{CommKind, Phase, StepGuard};

use crate::NativeAgent;

/// One training step. `with agent.step(i) as s:` records the `steps` row on exit.
#[pyclass(module = "rankscope._native", unsendable)]
pub(crate) struct NativeStep {
    pub(crate) guard: Option<StepGuard>,
    pub(crate) agent: Py<NativeAgent>,
    /// Whether this (sampled) step put the watched modules' hooks in place.
    pub(crate) hooked: bool,
    /// The phase being timed, by [`NativeStep::phase`]'s context manager.
    pub(crate) phase_started: Option<(Phase, Instant)>,
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
        _exc_type: Py<PyAny>,
        _exc: Py<PyAny>,
        _tb: Py<PyAny>,
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
            // u64::MAX as a float rounds up to 2^64, which is out of range.
            if !(n >= 0.0 && n < u64::MAX as f64 && n.fract() == 0.0) {
                return Err(PyValueError::new_err(format!(
                    "samples={n}: give the number of training examples in the step, a whole number (0 or more)"
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
            Python::attach(|py| self.end(py));
        }
    }
}

/// `with s.phase("forward"):` times one phase of a step.
#[pyclass(module = "rankscope._native", unsendable)]
pub(crate) struct NativePhase {
    step: Py<NativeStep>,
    phase: Phase,
}

#[pymethods]
impl NativePhase {
    fn __enter__(slf: PyRef<'_, Self>, py: Python<'_>) -> PyResult<()> {
        slf.step.borrow_mut(py).phase_begin(slf.phase)
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Py<PyAny>,
        _exc: Py<PyAny>,
        _tb: Py<PyAny>,
    ) -> bool {
        self.step.borrow_mut(py).phase_end();
        false
    }
}

/// The collective kind a `comm.kind` label names, or a `ValueError` listing them.
pub(crate) fn comm_kind(label: &str) -> PyResult<CommKind> {
    CommKind::parse(label).ok_or_else(|| {
        PyValueError::new_err(format!(
            "comm kind {label:?} is not a kind: use all_reduce, all_gather, reduce_scatter, \
             broadcast or other"
        ))
    })
}

/// A float from a Python number or a 0-d CPU tensor.
pub(crate) fn number(field: &str, value: &Bound<'_, PyAny>) -> PyResult<f64> {
    // Plain numbers first; a tensor is read through `detach().item()`, never
    // `__float__` (which warns on tensors that require grad).
    if value.is_instance_of::<PyFloat>() || value.is_instance_of::<PyInt>() {
        return value.extract::<f64>().map_err(|_| {
            PyValueError::new_err(format!(
                "{field}={value}: too large for a float64; give a finite number"
            ))
        });
    }
    let numel = value
        .call_method0("numel")
        .and_then(|n| n.extract::<i64>())
        .map_err(|_| {
            PyTypeError::new_err(format!(
                "{field}: expected a float, an int or a 0-d tensor, got {}",
                value.get_type()
            ))
        })?;
    if numel != 1 {
        let shape = value
            .getattr("shape")
            .map(|s| s.to_string())
            .unwrap_or_default();
        return Err(PyValueError::new_err(format!(
            "{field}: expected a 0-d tensor, got shape {shape}; pass a scalar such as loss.detach()"
        )));
    }
    value
        .call_method0("detach")
        .and_then(|t| t.call_method0("item"))
        .and_then(|v| v.extract::<f64>())
        .map_err(|e| PyValueError::new_err(format!("{field}: cannot read the tensor: {e}")))
}

/// A step's number from Python: a whole number from 0 to 2^64 − 1.
pub(crate) fn step_number(step: &Bound<'_, PyAny>) -> PyResult<u64> {
    if !step.is_instance_of::<PyInt>() {
        return Err(PyTypeError::new_err(format!(
            "step({}): the step's number is a whole number, e.g. agent.step(i)",
            step.repr().map_or_else(|_| "?".into(), |r| r.to_string())
        )));
    }
    step.extract::<u64>().map_err(|_| {
        PyValueError::new_err(format!(
            "step({step}): the step's number is 0 or more and below 2**64"
        ))
    })
}
