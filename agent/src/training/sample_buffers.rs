//! [`SampleBuffers`]: the training thread's copies of its samples, in buffers reused
//! from one sampled step to the next.
//!
//! Every sample is copied on the training thread (training may change its activation
//! in place later) and handed to the metrics thread, which drops it once measured. A
//! fresh CPU allocation per copy, freed by another thread a few milliseconds later
//! while the training thread's backward pass allocates its own tensors, made glibc's
//! heap hand training memory it had to fault in again: the backward pass of a sampled
//! step took about 250 more page faults and 0.4 ms more than an unsampled one, more
//! than the copies themselves cost (BENCHMARKS.md, "`overhead_ms` told truly").
//! Buffers kept here leave the heap as it is from step to step.
//!
//! A buffer is reused once the metrics thread has let go of it: when this pool holds
//! the only reference to its tensor and to its storage (read through the C++ shim in
//! `device_stats.cpp`, with the memory ordering that makes the reuse safe). Each layer
//! keeps at most [`PER_LAYER`] buffers, enough for every sample the metrics queue can
//! hold, so the pool holds at most what the queue may; it is released at finish.
//!
//! CPU only: a copy on an accelerator comes from libtorch's caching allocator, which
//! faults nothing in, and a buffer held there would count in
//! `device_allocated_bytes` between sampled steps.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use tch::{Device, TchError, Tensor};

/// Buffers kept per layer: the metrics queue holds 16 samples (or one step's), so a
/// layer sampled at every step has at most three samples queued and one being
/// measured.
pub(super) const PER_LAYER: usize = 4;

unsafe extern "C" {
    fn rankscope_tensor_unshared(tensor: *const torch_sys::C_tensor) -> i32;
}

/// Whether `buffer` is referenced by no one else (tensor and storage).
fn unshared(buffer: &Tensor) -> bool {
    // SAFETY: `buffer` is a live tensor; the shim only reads reference counts.
    unsafe { rankscope_tensor_unshared(buffer.as_ptr()) == 1 }
}

#[derive(Debug, Default)]
pub(super) struct SampleBuffers {
    by_layer: Mutex<HashMap<String, Vec<Tensor>>>,
    /// Every copy newly allocated, as before buffers were reused (benchmarks).
    fresh: AtomicBool,
}

impl SampleBuffers {
    /// A detached copy of `matrix` that the caller owns: written into a free buffer of
    /// `layer`'s with the same shape and kind when there is one, else newly allocated
    /// (and kept for the layer's later samples, in place of a free buffer of another
    /// shape, while the layer has fewer than [`PER_LAYER`]).
    pub fn copy(&self, layer: &str, matrix: &Tensor) -> Result<Tensor, TchError> {
        if matrix.device() != Device::Cpu || self.fresh.load(Ordering::Relaxed) {
            return matrix.f_detach_copy();
        }
        let mut by_layer = self.by_layer.lock().unwrap_or_else(|e| e.into_inner());
        let slots = match by_layer.get_mut(layer) {
            Some(slots) => slots,
            None => by_layer.entry(layer.to_string()).or_default(),
        };
        let (size, kind) = (matrix.size(), matrix.kind());
        let fits = |b: &Tensor| b.kind() == kind && b.size() == size;
        if let Some(buffer) = slots.iter_mut().find(|b| fits(b) && unshared(b)) {
            buffer.f_copy_(matrix)?;
            return Ok(buffer.shallow_clone());
        }
        // Shapes change (another batch size): a free buffer of an old shape makes room.
        if let Some(stale) = slots.iter().position(|b| !fits(b) && unshared(b)) {
            drop(slots.swap_remove(stale));
        }
        let copy = matrix.f_detach_copy()?;
        if slots.len() < PER_LAYER {
            slots.push(copy.shallow_clone());
        }
        Ok(copy)
    }

    /// Buffers held, over all layers (tests).
    #[cfg(test)]
    pub fn held(&self) -> usize {
        let by_layer = self.by_layer.lock().unwrap_or_else(|e| e.into_inner());
        by_layer.values().map(Vec::len).sum()
    }

    /// `false`: every later copy is newly allocated and none is kept, as before
    /// buffers were reused (for benchmarks that show the difference).
    pub fn set_reuse(&self, reuse: bool) {
        self.fresh.store(!reuse, Ordering::Relaxed);
        if !reuse {
            self.clear();
        }
    }

    /// Releases every buffer.
    pub fn clear(&self) {
        self.by_layer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    #[test]
    fn a_buffer_is_reused_once_its_other_holder_drops_it() {
        let pool = SampleBuffers::default();
        let a = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
        let first = pool.copy("fc1", &a).unwrap();
        assert!(first.equal(&a));
        // Still held (as by the metrics thread): the next copy gets a new buffer.
        let b = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
        let second = pool.copy("fc1", &b).unwrap();
        assert_ne!(first.data_ptr(), second.data_ptr());
        assert!(first.equal(&a) && second.equal(&b));
        // Dropped: its memory is written again, and what it held is not changed by
        // a later write to the source.
        let first_ptr = first.data_ptr();
        drop(first);
        let c = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
        let third = pool.copy("fc1", &c).unwrap();
        assert_eq!(third.data_ptr(), first_ptr);
        assert!(third.equal(&c));
        let mut c = c;
        let _ = c.fill_(0.0);
        assert!(!third.equal(&c));
        assert_eq!(pool.held(), 2);
    }

    #[test]
    fn a_view_of_a_buffer_keeps_it_busy() {
        let pool = SampleBuffers::default();
        let a = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
        let first = pool.copy("fc1", &a).unwrap();
        let view = first.narrow(0, 0, 2);
        let first_ptr = first.data_ptr();
        drop(first);
        let second = pool.copy("fc1", &a).unwrap();
        assert_ne!(second.data_ptr(), first_ptr);
        drop(view);
    }

    #[test]
    fn a_new_shape_or_kind_gets_its_own_buffer_and_the_layer_keeps_at_most_per_layer() {
        let pool = SampleBuffers::default();
        let held: Vec<Tensor> = (0..PER_LAYER + 2)
            .map(|_| {
                pool.copy("fc1", &Tensor::ones([3, 2], (Kind::Float, Device::Cpu)))
                    .unwrap()
            })
            .collect();
        assert_eq!(pool.held(), PER_LAYER);
        drop(held);
        let wide = pool
            .copy("fc1", &Tensor::ones([3, 5], (Kind::Float, Device::Cpu)))
            .unwrap();
        assert_eq!(wide.size(), [3, 5]);
        let double = pool
            .copy("fc1", &Tensor::ones([3, 2], (Kind::Double, Device::Cpu)))
            .unwrap();
        assert_eq!(double.kind(), Kind::Double);
        assert_eq!(pool.held(), PER_LAYER);
        pool.clear();
        assert_eq!(pool.held(), 0);
    }

    #[test]
    fn without_reuse_every_copy_is_new_and_none_is_kept() {
        let pool = SampleBuffers::default();
        let a = Tensor::ones([3, 2], (Kind::Float, Device::Cpu));
        drop(pool.copy("fc1", &a).unwrap());
        assert_eq!(pool.held(), 1);
        pool.set_reuse(false);
        assert_eq!(pool.held(), 0);
        let copy = pool.copy("fc1", &a).unwrap();
        assert!(copy.equal(&a));
        assert_eq!(pool.held(), 0);
    }
}
