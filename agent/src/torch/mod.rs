//! The tch adapter (the `torch` feature): what a Rust training program on libtorch
//! calls, reduced to what the core takes. It only turns tch tensors into host
//! buffers, shapes and parameter sizes; every metric is the core's
//! ([`crate::sampling`]).
//!
//! - [`Agent::tap`] / [`Tap`]: a module wrapper whose output is observed (tch has no
//!   forward hooks); [`Agent::observe`] for any tensor;
//! - a tensor in host memory is read by the core where it lies ([`host_activation`]);
//!   a tensor on a GPU is reshaped, row-sampled and cast to float32 there on the
//!   training thread (a copy of the agent's own, on the training thread's stream: tch
//!   has no stream API), and copied to the host on the metrics thread;
//! - [`Agent::profile_model`]: the model profile from a VarStore;
//! - [`LibtorchMemory`]: libtorch's allocator bytes (a C++ shim, `device_stats.cpp`),
//!   which [`Agent::use_libtorch_memory`] sets for the step rows.
//!
//! Nothing in the core imports this module.

use std::time::Instant;

use tch::{Device, Kind, Tensor};

use crate::sampling::worker::{DeferredSample, JobInput};
use crate::sampling::{
    ConvLayout, ElementType, HostActivation, HostSample, LayerMetrics, MatrixOptions, MatrixPlan,
    SampleError, SampleMatrix, choose_rows,
};
use crate::training::profile::{Optimizer, Parameter};
use crate::training::recorder::PendingSample;
use crate::{Agent, DeviceBytes, DeviceMemory};
use rankscope_proto::v1::ModelRow;

mod tap;

pub use tap::Tap;

unsafe extern "C" {
    fn rankscope_device_stats(device_index: i32, out: *mut i64) -> i32;
}

/// libtorch's allocator bytes of one CUDA device (the C++ shim over
/// `at::accelerator::getDeviceStats`).
#[derive(Debug, Clone, Copy)]
pub struct LibtorchMemory {
    pub device_index: i32,
}

impl DeviceMemory for LibtorchMemory {
    fn read(&self) -> Option<DeviceBytes> {
        let mut out = [0i64; 3];
        // SAFETY: the shim writes exactly three i64 into `out` and catches every C++
        // exception; it returns non-zero when there is no accelerator.
        let rc = unsafe { rankscope_device_stats(self.device_index, out.as_mut_ptr()) };
        (rc == 0).then(|| DeviceBytes {
            allocated: out[0].max(0) as u64,
            reserved: out[1].max(0) as u64,
            peak: out[2].max(0) as u64,
        })
    }
}

/// The host view of a CPU tensor, for the core to read; an error for what it cannot
/// read (its element type, its device, a sparse layout).
pub fn host_activation<'a>(
    tensor: &Tensor,
    shape: &'a [i64],
    strides: &'a [i64],
) -> Result<HostActivation<'a>, SampleError> {
    if tensor.device() != Device::Cpu {
        return Err(SampleError::Device(format!("{:?}", tensor.device())));
    }
    if tensor.is_sparse() {
        return Err(SampleError::Layout("a sparse tensor".into()));
    }
    let element = element_type(tensor.kind())?;
    // SAFETY: a defined, dense CPU tensor's data pointer addresses every element its
    // sizes and strides describe; the caller holds the tensor while the view is read.
    unsafe { HostActivation::new(tensor.data_ptr() as *const u8, element, shape, strides) }
}

fn element_type(kind: Kind) -> Result<ElementType, SampleError> {
    match kind {
        Kind::Float => Ok(ElementType::F32),
        Kind::Double => Ok(ElementType::F64),
        Kind::Half => Ok(ElementType::F16),
        Kind::BFloat16 => Ok(ElementType::BF16),
        other => Err(SampleError::ElementType(format!("{other:?}"))),
    }
}

/// The metrics of a whole tensor, on the host (a device tensor is copied there
/// first): for the `spectrum` command, the benchmarks and the tests.
pub fn compute(tensor: &Tensor, options: &MatrixOptions, seed: u64) -> LayerMetrics {
    let _guard = tch::no_grad_guard();
    let tensor = if tensor.defined() {
        tensor.to_device(Device::Cpu)
    } else {
        Tensor::zeros([0, 0], (Kind::Float, Device::Cpu))
    };
    let (shape, strides) = (tensor.size(), tensor.stride());
    match host_activation(&tensor, &shape, &strides) {
        Ok(activation) => crate::sampling::compute(&activation, options, seed),
        Err(error) => {
            tracing::warn!(%error, "activation metrics failed");
            LayerMetrics {
                centered: options.centered,
                ..LayerMetrics::default()
            }
        }
    }
}

/// A host copy of a 2-D tensor as a sample of the core's, measured as it is (no row
/// cap): for the sketch's tests and `rankscope bench --spectrum`.
pub fn host_sample(matrix: &Tensor, seed: u64) -> Result<HostSample, tch::TchError> {
    let (rows, cols) = matrix.size2()?;
    let values = Vec::<f32>::try_from(
        &matrix
            .f_to_device(Device::Cpu)?
            .f_to_kind(Kind::Float)?
            .f_reshape([-1])?,
    )?;
    Ok(HostSample::matrix(
        SampleMatrix {
            values,
            rows: rows as usize,
            cols: cols as usize,
        },
        "",
        seed,
    ))
}

/// The matrix of `tensor` (the core's table, [`MatrixPlan`]) with its rows drawn down
/// to `max_rows` by `seed`, as a float32 copy of the agent's own on the tensor's device.
pub fn device_sample(
    tensor: &Tensor,
    layout: ConvLayout,
    max_rows: usize,
    seed: u64,
) -> Result<(Tensor, &'static str), tch::TchError> {
    let shape = tensor.size();
    let plan = MatrixPlan::new(&shape, layout);
    let order: Vec<i64> = plan
        .row_axes
        .iter()
        .chain(&plan.col_axes)
        .map(|&a| a as i64)
        .collect();
    let matrix = tensor
        .f_permute(order.as_slice())?
        .f_reshape([plan.rows as i64, plan.cols as i64])?;
    let matrix = if max_rows > 0 && plan.rows > max_rows {
        let rows = choose_rows(plan.rows as u64, max_rows as u64, seed);
        let index = Tensor::f_from_slice(&rows)?.f_to_device(tensor.device())?;
        matrix.f_index_select(0, &index)?
    } else {
        matrix
    };
    // `to_kind` of a float32 matrix is the matrix itself: copy always.
    Ok((
        matrix.f_to_kind(Kind::Float)?.f_detach_copy()?,
        plan.conv_layout,
    ))
}

/// A float32 sample on a device, brought to the host on the metrics thread.
struct DeviceSample {
    matrix: Tensor,
    conv_layout: &'static str,
    seed: u64,
}

impl DeferredSample for DeviceSample {
    fn read(self: Box<Self>, mut buffer: Vec<f32>) -> Result<HostSample, String> {
        let _guard = tch::no_grad_guard();
        let host = self
            .matrix
            .f_to_device(Device::Cpu)
            .map_err(|e| e.to_string())?;
        let (rows, cols) = match host.size().as_slice() {
            &[r, c] => (r as usize, c as usize),
            other => return Err(format!("a device sample of shape {other:?}")),
        };
        buffer.clear();
        buffer.resize(rows * cols, 0.0);
        host.f_copy_data(&mut buffer, rows * cols)
            .map_err(|e| e.to_string())?;
        Ok(HostSample::matrix(
            SampleMatrix {
                values: buffer,
                rows,
                cols,
            },
            self.conv_layout,
            self.seed,
        ))
    }

    fn bytes(&self) -> u64 {
        (self.matrix.numel() * size_of::<f32>()) as u64
    }
}

impl Agent {
    /// Wraps `module` so its output is observed under `name`. The wrapper is
    /// always the same; whether a step samples the layer is decided at each
    /// forward ([`Agent::wants_layer`]: never for layers the filter excludes, in
    /// `steps` mode, or on an inactive agent).
    pub fn tap<M: tch::nn::Module>(&self, name: &str, module: M) -> Tap<M> {
        Tap::new(self.clone(), name, module, None)
    }

    /// [`Agent::tap`] for a self-attention module, so the profile counts its FLOPs.
    pub fn tap_attention<M: tch::nn::Module>(&self, name: &str, module: M) -> Tap<M> {
        Tap::new(self.clone(), name, module, Some("attention"))
    }

    /// Observes an activation of layer `name`. On a step that is not sampled this
    /// costs one atomic load.
    pub fn observe(&self, name: &str, activation: &Tensor) {
        self.observe_kind(name, None, activation)
    }

    /// [`Agent::observe`] for a layer of a known kind (`attention`, so the profile
    /// counts its FLOPs).
    pub fn observe_kind(&self, name: &str, kind: Option<&'static str>, activation: &Tensor) {
        observe_tensor(self, name, kind, activation, Instant::now());
    }

    /// Sets libtorch's allocator bytes of this rank's CUDA device (its local rank's)
    /// as the step rows' device memory; nothing on a host without CUDA.
    pub fn use_libtorch_memory(&self) {
        if !tch::Cuda::is_available() {
            return;
        }
        if let Some(config) = self.config() {
            let count = tch::Cuda::device_count().max(1);
            let device_index = (i64::from(config.local_rank) % count) as i32;
            self.set_device_memory(Box::new(LibtorchMemory { device_index }));
        }
    }

    /// Runs `forward` once (no gradients) to see layer shapes, then sends one `model`
    /// row per layer. Returns the rows (also for inert agents, so callers can print).
    pub fn profile_model(
        &self,
        vs: &tch::nn::VarStore,
        optimizer: Optimizer,
        forward: impl FnOnce(),
    ) -> Vec<ModelRow> {
        let parameters = vs
            .variables()
            .into_iter()
            .map(|(path, tensor)| parameter(path, &tensor, None));
        self.profile_parameters(parameters, optimizer, || {
            let _guard = tch::no_grad_guard();
            forward();
        })
    }
}

/// A tch tensor's parameter sizes.
pub fn parameter(path: String, tensor: &Tensor, whole_shape: Option<Vec<i64>>) -> Parameter {
    Parameter {
        path,
        shape: tensor.size(),
        element_bytes: tensor.kind().elt_size_in_bytes() as u64,
        requires_grad: tensor.requires_grad(),
        whole_shape,
    }
}

/// Observes `activation` as layer `name`, the caller's work for it counted from `since`.
fn observe_tensor(
    agent: &Agent,
    name: &str,
    kind: Option<&'static str>,
    activation: &Tensor,
    since: Instant,
) {
    let Some(recorder) = agent.recorder() else {
        return;
    };
    let shape = if activation.defined() {
        activation.size()
    } else {
        vec![0, 0]
    };
    let Some(pending) = recorder.begin_sample(name, kind, &shape) else {
        return;
    };
    let _guard = tch::no_grad_guard();
    let input = sample_input(recorder, &pending, activation, &shape);
    recorder.hand_over(pending, input);
    recorder.add_sampling_overhead(since);
}

fn sample_input(
    recorder: &crate::training::recorder::Recorder,
    pending: &PendingSample,
    activation: &Tensor,
    shape: &[i64],
) -> Result<JobInput, String> {
    if !activation.defined() {
        let empty = HostSample::matrix(SampleMatrix::default(), "", pending.seed);
        return Ok(JobInput::Ready(empty));
    }
    if activation.device() == Device::Cpu {
        let strides = activation.stride();
        let host = host_activation(activation, shape, &strides).map_err(|e| e.to_string())?;
        return Ok(JobInput::Ready(recorder.read_host(pending, &host)));
    }
    element_type(activation.kind()).map_err(|e| e.to_string())?;
    let options = recorder.options;
    let (matrix, conv_layout) = device_sample(
        &activation.detach(),
        options.conv_layout,
        options.max_rows,
        pending.seed,
    )
    .map_err(|e| e.to_string())?;
    Ok(JobInput::Deferred(Box::new(DeviceSample {
        matrix,
        conv_layout,
        seed: pending.seed,
    })))
}
