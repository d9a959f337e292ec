//! [`SampleBuffers`]: the host buffers samples are read into, reused from one sampled
//! step to the next.
//!
//! Every sample is copied on the training thread (training may change its activation
//! in place later) and handed to the metrics thread, which gives the buffer back once
//! it has measured the sample. A fresh allocation per copy, freed by another thread a
//! few milliseconds later while the training thread's backward pass allocates its own
//! tensors, made glibc's heap hand training memory it had to fault in again: the
//! backward pass of a sampled step took about 250 more page faults and 0.4 ms more than
//! an unsampled one, more than the copies themselves cost (BENCHMARKS.md, "`overhead_ms`
//! told truly"). Buffers kept here leave the heap as it is from step to step.
//!
//! Each layer keeps at most [`PER_LAYER`] free buffers, enough for every sample the
//! metrics queue can hold; the pool is released at finish.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Free buffers kept per layer: the metrics queue holds 16 samples (or one step's), so
/// a layer sampled at every step has at most three samples queued and one being
/// measured.
pub const PER_LAYER: usize = 4;

#[derive(Debug, Default)]
pub struct SampleBuffers {
    free: Mutex<HashMap<String, Vec<Vec<f32>>>>,
    /// Every copy newly allocated, as before buffers were reused (benchmarks).
    fresh: AtomicBool,
}

impl SampleBuffers {
    /// A free buffer of `layer`'s (empty, its allocation kept), the largest one kept,
    /// or a new one.
    pub fn take(&self, layer: &str) -> Vec<f32> {
        if self.fresh.load(Ordering::Relaxed) {
            return Vec::new();
        }
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        free.get_mut(layer).and_then(Vec::pop).unwrap_or_default()
    }

    /// Gives `buffer` back for `layer`'s later samples, unless the layer keeps
    /// [`PER_LAYER`] already.
    pub fn give_back(&self, layer: &str, mut buffer: Vec<f32>) {
        if self.fresh.load(Ordering::Relaxed) || buffer.capacity() == 0 {
            return;
        }
        buffer.clear();
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let kept = free.entry(layer.to_string()).or_default();
        if kept.len() < PER_LAYER {
            kept.push(buffer);
        }
    }

    /// `false`: every copy gets a new allocation, freed after it is measured, as before
    /// buffers were reused (for benchmarks that show the difference).
    pub fn set_reuse(&self, reuse: bool) {
        self.fresh.store(!reuse, Ordering::Relaxed);
        if !reuse {
            self.clear();
        }
    }

    /// Frees every kept buffer.
    pub fn clear(&self) {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_per_layer_and_bounded() {
        let pool = SampleBuffers::default();
        let mut a = pool.take("fc1");
        a.extend([1.0, 2.0, 3.0]);
        let ptr = a.as_ptr();
        pool.give_back("fc1", a);
        let b = pool.take("fc1");
        assert_eq!((b.as_ptr(), b.len()), (ptr, 0));
        assert_eq!(pool.take("fc2").capacity(), 0);
        for _ in 0..PER_LAYER + 2 {
            pool.give_back("fc1", vec![0.0; 4]);
        }
        assert_eq!(pool.free.lock().unwrap()["fc1"].len(), PER_LAYER);
        pool.set_reuse(false);
        pool.give_back("fc1", vec![0.0; 4]);
        assert_eq!(pool.take("fc1").capacity(), 0);
    }
}
