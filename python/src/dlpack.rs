//! Tensors crossing from Python into Rust through DLPack (dlpark): the versioned
//! capsule where torch has it, the legacy one otherwise. The extension links no
//! libtorch: what it reads is a host buffer with its element type, shape and strides.
//!
//! - [`read_host`]: an activation in host memory, viewed as the core's
//!   [`HostActivation`] while its capsule is held;
//! - [`Pinned`]: a device's reduction of a sample in pinned host memory (the Gram
//!   matrix, or the sketch's packed summary), held until the metrics thread has
//!   measured it, and counted against the pinned-memory pool's bound while held.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dlpark::ffi::{DLDataTypeCode, DLDeviceType};
use dlpark::python::{ImportedDlpack, from_dlpack};
use pyo3::prelude::*;
use rankscope_agent::sampling::{
    ElementType, F32Buffer, F64Buffer, HostActivation, KrylovSummary, SampleError,
};

/// DLPack's device type for CUDA-pinned host memory (`kDLCUDAHost`).
const CUDA_HOST: DLDeviceType = DLDeviceType(3);

/// The DLPack export of `tensor` (detached first: a tensor that requires grad is
/// refused by its producer), or why there is none.
pub(crate) fn import(tensor: &Bound<'_, PyAny>) -> Result<ImportedDlpack, String> {
    let detached = tensor
        .call_method0("detach")
        .map_err(|e| format!("cannot detach it: {e}"))?;
    from_dlpack(detached.as_borrowed(), None, None).map_err(|e| first_line(&e.to_string()))
}

/// The first line of a Python exception's text: torch appends its C++ backtrace
/// ("Exception raised from ...") on the lines after, which an `events` row does not need.
pub(crate) fn first_line(text: &str) -> String {
    let line = text.lines().next().unwrap_or_default();
    line.split(" Exception raised from ")
        .next()
        .unwrap_or(line)
        .trim_end()
        .to_string()
}

/// Calls `f` with the host view of an imported tensor; an error for what the core cannot
/// read (its element type, a device, vector lanes).
pub(crate) fn read_host<T>(
    imported: &ImportedDlpack,
    f: impl FnOnce(&HostActivation<'_>) -> T,
) -> Result<T, SampleError> {
    let tensor = imported
        .validate()
        .map_err(|e| SampleError::Layout(e.to_string()))?;
    let device = tensor.device();
    if device.device_type != DLDeviceType::CPU && device.device_type != CUDA_HOST {
        return Err(SampleError::Device(format!(
            "DLPack device type {} (index {})",
            device.device_type.0, device.device_id
        )));
    }
    let dtype = tensor.dtype();
    let element = match (dtype.code, dtype.bits, dtype.lanes) {
        (DLDataTypeCode::FLOAT, 32, 1) => ElementType::F32,
        (DLDataTypeCode::FLOAT, 64, 1) => ElementType::F64,
        (DLDataTypeCode::FLOAT, 16, 1) => ElementType::F16,
        (DLDataTypeCode::BFLOAT, 16, 1) => ElementType::BF16,
        (code, bits, lanes) => {
            return Err(SampleError::ElementType(format!(
                "DLPack code {} of {bits} bits ({lanes} lanes)",
                code.0
            )));
        }
    };
    let strides = tensor
        .strides_or_compact()
        .map_err(|e| SampleError::Layout(e.to_string()))?;
    let offset = usize::try_from(tensor.byte_offset())
        .map_err(|_| SampleError::Layout("byte offset beyond the address space".into()))?;
    let data = (tensor.data_ptr() as *const u8).wrapping_add(offset);
    // SAFETY: a valid DLPack tensor's data (at its byte offset) holds every element its
    // shape and strides address, and the capsule's owner keeps it alive while
    // `imported` lives, which outlives this call.
    let activation = unsafe { HostActivation::new(data, element, tensor.shape(), &strides) }?;
    Ok(f(&activation))
}

/// A device's reduction of a sample in pinned host memory: a contiguous float tensor of
/// one shape, held through its DLPack capsule until the sample is measured. Its bytes
/// count in `held` meanwhile.
pub(crate) struct Pinned {
    imported: ImportedDlpack,
    len: usize,
    bytes: u64,
    held: Arc<AtomicU64>,
}

impl Pinned {
    /// `tensor`, which must be a contiguous host tensor of `shape` with `bits`-bit float
    /// elements (`what` names it in the error), counted in `held`.
    fn new(
        tensor: &Bound<'_, PyAny>,
        shape: &[i64],
        bits: u8,
        what: &str,
        held: Arc<AtomicU64>,
    ) -> Result<Pinned, String> {
        let imported = import(tensor)?;
        {
            let t = imported.validate().map_err(|e| e.to_string())?;
            let dtype = t.dtype();
            let compact = t.is_compact().unwrap_or(false);
            let device = t.device().device_type;
            if (dtype.code, dtype.bits, dtype.lanes) != (DLDataTypeCode::FLOAT, bits, 1)
                || t.shape() != shape
                || !compact
                || t.byte_offset() != 0
                || (device != DLDeviceType::CPU && device != CUDA_HOST)
            {
                return Err(format!(
                    "the device side's {what} is not a contiguous float{bits} host tensor of shape {shape:?} (shape {:?})",
                    t.shape()
                ));
            }
        }
        let len = shape.iter().product::<i64>() as usize;
        let bytes = (len * usize::from(bits / 8)) as u64;
        held.fetch_add(bytes, Ordering::Relaxed);
        Ok(Pinned {
            imported,
            len,
            bytes,
            held,
        })
    }

    /// The `side × side` float32 Gram matrix of a sample.
    pub(crate) fn gram(
        tensor: &Bound<'_, PyAny>,
        side: usize,
        held: Arc<AtomicU64>,
    ) -> Result<PinnedGram, String> {
        let side = side as i64;
        Pinned::new(tensor, &[side, side], 32, "Gram matrix", held).map(PinnedGram)
    }

    /// The sketch's packed float64 summary, of the length of the depths the device ran
    /// (`KrylovSummary::packed_len_of`).
    pub(crate) fn summary(
        tensor: &Bound<'_, PyAny>,
        held: Arc<AtomicU64>,
    ) -> Result<PinnedSummary, String> {
        let len: usize = tensor
            .call_method0("numel")
            .and_then(|n| n.extract())
            .map_err(|e| format!("the device side's sketch summary has no length: {e}"))?;
        if KrylovSummary::depths_in(len).is_none() {
            return Err(format!(
                "the device side's sketch summary has {len} values, not a length of one of the schedule's depths ({:?})",
                KrylovSummary::packed_lens()
            ));
        }
        Pinned::new(tensor, &[len as i64], 64, "sketch summary", held).map(PinnedSummary)
    }

    /// Its elements as `T`, which `new` checked (`T` of `bits` bits).
    fn values<T>(&self) -> &[T] {
        match self.imported.validate() {
            // SAFETY: `new` checked a contiguous tensor of `len` elements of T's width
            // at offset 0, which the capsule's owner keeps alive while `imported` lives.
            Ok(t) if self.len > 0 => unsafe {
                std::slice::from_raw_parts(t.data_ptr() as *const T, self.len)
            },
            _ => &[],
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        self.held.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// A sample's Gram matrix in pinned memory (float32).
pub(crate) struct PinnedGram(Pinned);

impl F32Buffer for PinnedGram {
    fn values(&self) -> &[f32] {
        self.0.values()
    }
}

/// A sample's packed sketch summary in pinned memory (float64).
pub(crate) struct PinnedSummary(Pinned);

impl F64Buffer for PinnedSummary {
    fn values(&self) -> &[f64] {
        self.0.values()
    }
}
