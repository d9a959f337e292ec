//! The forward hooks of watched modules: [`NativeHook`], registered once per module
//! and put in place only for sampled steps ([`HookSlot`]), and how a module's output
//! becomes the tensor observed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use rankscope_agent::Agent;
use tch::Tensor;

use crate::NativeAgent;

/// Where a watched module's [`NativeHook`] goes on a sampled step: the module's
/// `_forward_hooks` dict, under the id torch gave it when it was registered once.
/// Setting and deleting that entry is what `register_forward_hook` and its handle's
/// `remove()` do, at a fraction of the cost and with no handle to allocate.
pub(crate) struct HookSlot {
    pub(crate) hooks: PyObject,
    pub(crate) key: PyObject,
    pub(crate) hook: PyObject,
}

impl NativeAgent {
    /// Puts every watched module's hook in place (`on`) or takes it out, counting
    /// the time as the sampled step's. Returns whether there were hooks.
    pub(crate) fn set_hooks(&self, py: Python<'_>, on: bool) -> bool {
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
pub(crate) struct NativeHook {
    pub(crate) agent: Agent,
    pub(crate) name: String,
    pub(crate) kind: Option<&'static str>,
    /// One more than the sampled step this hook last observed (0: none), so a
    /// layer is sampled once per step: activation checkpointing runs the forward
    /// again in backward, and that recomputed output is not sampled again.
    pub(crate) observed: AtomicU64,
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
pub(crate) fn layer_kind(kind: Option<&str>) -> Option<&'static str> {
    match kind {
        Some("attention") => Some("attention"),
        _ => None,
    }
}

/// The tensor `obj` is (a reference to the same tensor), or `None`, without raising.
pub(crate) fn tensor_of(obj: &Bound<'_, PyAny>) -> Option<Tensor> {
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
