//! The forward hooks of watched modules: [`NativeHook`], registered once per module
//! and put in place only for sampled steps ([`HookSlot`]), and how a module's output
//! becomes a sample ([`observe`]): in host memory, read by the core through DLPack;
//! on a GPU, reduced there by the package's device side (`rankscope._device`, the
//! user's torch on a side stream) and handed over when its event completes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use rankscope_agent::sampling::MatrixPlan;
use rankscope_agent::training::agent::PendingSample;
use rankscope_agent::{Agent, sampling};

use crate::NativeAgent;
use crate::dlpack;

/// Where a watched module's [`NativeHook`] goes on a sampled step: the module's
/// `_forward_hooks` dict, under the id torch gave it when it was registered once.
/// Setting and deleting that entry is what `register_forward_hook` and its handle's
/// `remove()` do, at a fraction of the cost and with no handle to allocate.
pub(crate) struct HookSlot {
    pub(crate) hooks: Py<PyAny>,
    pub(crate) key: Py<PyAny>,
    pub(crate) hook: Py<PyAny>,
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
    /// The device side and `torch.Tensor`, shared with the agent.
    pub(crate) torch: Py<TorchSide>,
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
        py: Python<'_>,
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
        let torch = self.torch.bind(py).get();
        match first_tensor(torch, output) {
            Some(tensor) => observe(&self.agent, torch, &self.name, self.kind, &tensor, since),
            None => {
                // Counted, and an `events` row says why, rather than a layer that
                // `watch` listed and never sampled.
                if self.agent.sampling_step().is_some()
                    && let Some(pending) = self.agent.begin_sample(&self.name, self.kind, &[])
                {
                    let kind = output
                        .get_type()
                        .name()
                        .map_or_else(|_| "?".to_string(), |n| n.to_string());
                    self.agent.hand_over(
                        pending,
                        Err(format!(
                            "the layer's output, a {kind}, holds no tensor where the hook looks \
                             (the output, or the first tensor of a tuple, list or dict): \
                             observe one with agent.observe(name, tensor)"
                        )),
                    );
                    self.agent.add_overhead(since, true);
                }
            }
        }
    }

    fn __repr__(&self) -> String {
        format!("rankscope hook of layer {:?}", self.name)
    }

    /// A copy of a model made during a sampled step (`copy.deepcopy`, or
    /// `torch.save` of the whole model) holds an inert hook in this one's place: a
    /// hook belongs to this process's agent and to the module it watches.
    fn __reduce__<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let inert = py.import("rankscope._modules")?.getattr("inert_hook")?;
        Ok((inert, PyTuple::empty(py)))
    }
}

/// The kinds a layer may be given; anything else is none.
pub(crate) fn layer_kind(kind: Option<&str>) -> Option<&'static str> {
    match kind {
        Some("attention") => Some("attention"),
        _ => None,
    }
}

/// What the hooks need of torch: `torch.Tensor`, to find a module's output tensor,
/// and the device side (`rankscope._device.DeviceSide`) for outputs on a GPU, where
/// there is one.
#[pyclass(module = "rankscope._native", frozen)]
pub(crate) struct TorchSide {
    pub(crate) tensor_type: Py<PyAny>,
    pub(crate) device_side: std::sync::OnceLock<Py<PyAny>>,
    /// Tests only: host tensors go to the device side too (its reduction, run
    /// without a stream), so its numbers can be checked on a machine without a GPU.
    pub(crate) host_to_device_side: std::sync::atomic::AtomicBool,
}

/// A module's output as a tensor: itself, or the first tensor of a tuple, a list or
/// a dict's values (a Hugging Face `ModelOutput` is one).
fn first_tensor<'py>(torch: &TorchSide, output: &Bound<'py, PyAny>) -> Option<Bound<'py, PyAny>> {
    let tensor_type = torch.tensor_type.bind(output.py());
    let is_tensor = |obj: &Bound<'py, PyAny>| obj.is_instance(tensor_type).unwrap_or(false);
    if is_tensor(output) {
        return Some(output.clone());
    }
    if let Ok(tuple) = output.cast::<PyTuple>() {
        return tuple.iter().find(is_tensor);
    }
    if let Ok(list) = output.cast::<PyList>() {
        return list.iter().find(is_tensor);
    }
    if let Ok(dict) = output.cast::<PyDict>() {
        return dict.values().iter().find(is_tensor);
    }
    None
}

/// A sample taken on the training thread and being reduced on a GPU: what the device
/// side hands back with its result (`NativeAgent.hand_over_reduced`).
#[pyclass(module = "rankscope._native", frozen)]
pub(crate) struct NativePending {
    pub(crate) pending: std::sync::Mutex<Option<PendingSample>>,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) conv_layout: &'static str,
}

/// Observes `tensor` as layer `name`: on a sampled step (or while profiling, for its
/// shape) the sample is taken, its time counted from `since`. Never raises: what
/// cannot be read is an `events` row (`sample_unreadable`) and a dropped sample.
pub(crate) fn observe(
    agent: &Agent,
    torch: &TorchSide,
    name: &str,
    kind: Option<&'static str>,
    tensor: &Bound<'_, PyAny>,
    since: Instant,
) {
    if !agent.observing() {
        return;
    }
    let shape: Vec<i64> = tensor
        .getattr("shape")
        .and_then(|s| s.extract())
        .unwrap_or_default();
    let Some(pending) = agent.begin_sample(name, kind, &shape) else {
        return;
    };
    let outcome = take(agent, torch, pending.clone(), tensor, &shape);
    if let Err(why) = outcome {
        agent.hand_over(pending, Err(why));
    }
    agent.add_overhead(since, true);
}

/// Reads or submits a taken sample; the error is why it could not be (then the caller
/// hands it over as failed). A sample submitted to the device side is its to hand over.
fn take(
    agent: &Agent,
    torch: &TorchSide,
    pending: PendingSample,
    tensor: &Bound<'_, PyAny>,
    shape: &[i64],
) -> Result<(), String> {
    let py = tensor.py();
    let (device_type, _): (u32, i32) = tensor
        .call_method0("__dlpack_device__")
        .and_then(|d| d.extract())
        .map_err(|e| format!("not a DLPack tensor: {e}"))?;
    let host_to_device_side = torch.host_to_device_side.load(Ordering::Relaxed);
    match device_type {
        // CPU and CUDA-pinned host memory: the core reads it where it lies.
        1 | 3 if !host_to_device_side => {
            let imported = dlpack::import(tensor)?;
            let sample = dlpack::read_host(&imported, |activation| {
                agent.read_host(&pending, activation)
            })
            .map_err(|e| e.to_string())?
            .ok_or("the agent finished")?;
            agent.hand_over(pending, Ok(sampling::worker::JobInput::Ready(sample)));
            Ok(())
        }
        // CUDA (2) and ROCm (10): the device side reduces it on a side stream.
        1 | 2 | 3 | 10 => {
            let device_side = torch
                .device_side
                .get()
                .ok_or("no device side for a GPU tensor (torch.cuda is not available)")?;
            let options = agent.matrix_options().ok_or("the agent finished")?;
            let plan = MatrixPlan::new(shape, options.conv_layout);
            let order: Vec<usize> = plan
                .row_axes
                .iter()
                .chain(&plan.col_axes)
                .copied()
                .collect();
            // The rows are drawn on the device side's thread (`choose_rows`), not here.
            let keep =
                (options.max_rows > 0 && plan.rows > options.max_rows).then_some(options.max_rows);
            let kept = keep.unwrap_or(plan.rows);
            // Where the sketch measures it, the device runs the Krylov process too, and
            // hands over a few hundred KiB instead of the Gram matrix.
            let sketch = options
                .spectrum
                .method_on_device(kept as i64, plan.cols as i64)
                == sampling::Method::Sketch;
            let seed = pending.seed;
            // How far its Krylov process runs: as deep as this layer's last sample needed.
            let depths = sketch.then(|| agent.sketch_depths(&pending.layer));
            let token = Py::new(
                py,
                NativePending {
                    pending: std::sync::Mutex::new(Some(pending)),
                    rows: kept,
                    cols: plan.cols,
                    conv_layout: plan.conv_layout,
                },
            )
            .map_err(|e| e.to_string())?;
            let submitted = device_side.bind(py).call_method1(
                "submit",
                (
                    tensor,
                    token.clone_ref(py),
                    order,
                    plan.rows,
                    plan.cols,
                    keep,
                    options.centered,
                    sketch,
                    seed,
                    depths,
                ),
            );
            if let Err(error) = submitted {
                // The device side could not take it: hand it over as failed here,
                // unless it did already.
                if let Some(pending) = token.get().pending.lock().ok().and_then(|mut p| p.take()) {
                    agent.hand_over(
                        pending,
                        Err(format!(
                            "the device side failed: {}",
                            dlpack::first_line(&error.to_string())
                        )),
                    );
                }
            }
            Ok(())
        }
        other => Err(format!(
            "a tensor on DLPack device type {other}, which has no reduction here"
        )),
    }
}
