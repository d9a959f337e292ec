//! The metrics worker: a thread that turns sampled activations into `layers` rows,
//! so the spectra never run on the training thread.
//!
//! The training thread prepares each sample once ([`super::prepare::prepare`]: reshape
//! and row sample, then a detached copy) and hands the [`Job`] over through a queue;
//! this thread only measures ([`super::measure::measure`]). The training thread
//! samples no step whose samples the queue has no room for (it counts the step as
//! skipped, [`crate::budget::sampler`]), and the overhead budget keeps the worker's CPU
//! time within its share ([`crate::budget`]): the worker runs in the normal
//! scheduling class and reports its own CPU time after each sample.
//!
//! Before its first job the thread warms up ([`warm_up`]): it prepares and measures
//! a small synthetic sample, so libtorch's one-time set-up (its first calls, the
//! LAPACK eigen-solver's, the thread's intra-op pool) is paid at `init`, off the
//! training thread, and not by the run's first sample. Its CPU time is reported
//! apart ([`WorkerCounters::warm_up_ns`]) and left out of the overhead budget, which
//! then learns what a sample costs from a first sample that costs what later ones do.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rankscope_proto::v1::EventRow;

use tch::{Device, Kind, Tensor};

use super::measure::measure;
use super::options::{ConvLayout, MatrixOptions, SpectrumMode, SpectrumOptions};
use super::prepare::{Sample, prepare};
use super::sketch::SKETCH_MIN_SIDE;
use crate::budget::cpu_clock;
use crate::budget::sampler::WorkerCounters;
use crate::rows::now_us;
use crate::transport::Transport;
use rankscope_proto::Row;

/// One sampled activation, prepared on the training thread.
#[derive(Debug)]
pub struct Job {
    pub step: u64,
    pub layer: String,
    pub sample: Sample,
    /// When it was sampled.
    pub time: i64,
}

impl Job {
    /// A job for `sample`, time-stamped now.
    pub fn new(step: u64, layer: &str, sample: Sample) -> Job {
        Job {
            step,
            layer: layer.to_string(),
            sample,
            time: now_us(),
        }
    }
}

/// Rows and columns of the warm-up's synthetic activation: past the row cap's
/// default, so row sampling runs too, and small enough to cost a few milliseconds.
const WARM_UP_SHAPE: [i64; 2] = [320, 48];

/// Runs the metrics path once on a synthetic sample, so that libtorch's one-time
/// set-up for it happens now rather than in the run's first sample: the ops of
/// [`prepare`] (whose first calls set up state shared by every thread) and of
/// [`measure`] (the Gram matrix, the eigen-solve, the health statistics), and the
/// sketch's where the configured mode always sketches a wide enough matrix. On a
/// CUDA device, whose samples are measured there, it also pays for the device's
/// first calls on this thread (the solver's handle among them). Its result is
/// thrown away; a failure only means the first sample pays instead.
pub(crate) fn warm_up(centered: bool, spectrum: &SpectrumOptions, device: Device) {
    let _guard = tch::no_grad_guard();
    let options = MatrixOptions {
        max_rows: 256,
        centered,
        conv_layout: ConvLayout::default(),
        spectrum: *spectrum,
    };
    let Ok(activation) = Tensor::f_randn(WARM_UP_SHAPE, (Kind::Float, device)) else {
        return;
    };
    if let Ok(sample) = prepare(&activation, &options, 0x5eed) {
        let _ = measure(&sample, centered, spectrum);
    }
    if spectrum.mode == SpectrumMode::Sketch {
        let side = SKETCH_MIN_SIDE;
        if let Ok(wide) = Tensor::f_randn([side, side], (Kind::Float, device)) {
            let sample = Sample {
                matrix: wide,
                conv_layout: "",
                seed: 0x5eed,
            };
            let _ = measure(&sample, centered, spectrum);
        }
    }
}

/// The worker thread and its queue.
#[derive(Debug)]
pub struct Worker {
    queue: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    /// Set when [`Worker::finish`] gives up waiting: queued jobs are skipped.
    abandon: Arc<AtomicBool>,
}

impl Worker {
    /// Starts the thread; it counts the jobs it is done with, its CPU time, and
    /// the jobs it skips at finish (dropped) in `counters`.
    /// `cuda`: the index of the CUDA device this rank's samples come from, which the
    /// warm-up sets up too.
    pub(crate) fn start(
        transport: Arc<Transport>,
        centered: bool,
        spectrum: SpectrumOptions,
        counters: Arc<WorkerCounters>,
        cuda: Option<usize>,
    ) -> std::io::Result<Worker> {
        // Unbounded as a channel: the training side admits a step only when the
        // queue has room for all its samples (`Sampler::decide`), which bounds it.
        let (tx, rx) = channel::<Job>();
        let abandon = Arc::new(AtomicBool::new(false));
        let abandoned = abandon.clone();
        let thread = std::thread::Builder::new()
            .name("rankscope-metrics".into())
            .spawn(move || {
                let _guard = tch::no_grad_guard();
                if super::threads::limit_this_thread(1).is_none() {
                    tracing::debug!("cannot limit the metrics worker's intra-op threads");
                }
                warm_up(centered, &spectrum, Device::Cpu);
                if let Some(index) = cuda {
                    warm_up(centered, &spectrum, Device::Cuda(index));
                }
                // The warm-up (and the thread's start) is the agent's set-up, not a
                // sample's cost: the CPU time reported from here on leaves it out.
                let warm_up_ns = cpu_clock::this_thread_ns().unwrap_or(0);
                counters.warm_up_ns.store(warm_up_ns, Ordering::Relaxed);
                let report_cpu = || {
                    if let Some(ns) = cpu_clock::this_thread_ns() {
                        counters
                            .cpu_ns
                            .store(ns.saturating_sub(warm_up_ns), Ordering::Relaxed);
                    }
                };
                for job in rx {
                    if abandoned.load(Ordering::Relaxed) {
                        counters.dropped.fetch_add(1, Ordering::Relaxed);
                        counters.done.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    let started = Instant::now();
                    let m = measure(&job.sample, centered, &spectrum);
                    let compute_ms = started.elapsed().as_secs_f64() * 1e3;
                    if m.nonfinite > 0 {
                        transport.send(Row::Event(EventRow {
                            time: job.time,
                            kind: crate::rows::event_kind::NONFINITE_ACTIVATION.into(),
                            message: format!("layer {} has NaN or Inf values", job.layer),
                            value: Some(m.nonfinite as i64),
                            step: Some(job.step),
                        }));
                    }
                    transport.send(Row::Layer(
                        m.into_layer_row(job.step, job.time, job.layer, compute_ms),
                    ));
                    report_cpu();
                    if counters.done.fetch_add(1, Ordering::Relaxed) == 0 {
                        let first = counters.cpu_ns.load(Ordering::Relaxed);
                        counters.first_ns.store(first, Ordering::Relaxed);
                    }
                }
                report_cpu();
            })?;
        Ok(Worker {
            queue: Some(tx),
            thread: Some(thread),
            abandon,
        })
    }

    /// A handle to the queue; the training thread hands jobs over (it has admitted
    /// their step with room for them).
    pub fn sender(&self) -> Option<Sender<Job>> {
        self.queue.clone()
    }

    /// Measures the queued jobs and stops the thread (once every sender is
    /// dropped). Past `wait` (a worker starved of CPU time by other processes),
    /// the jobs still queued are skipped (and counted as dropped) rather than
    /// hold up the caller.
    pub fn finish(&mut self, wait: Duration) {
        self.queue = None;
        let Some(thread) = self.thread.take() else {
            return;
        };
        let deadline = Instant::now() + wait;
        while !thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if !thread.is_finished() {
            tracing::warn!(
                "the metrics worker got no CPU time to finish: its queued samples are dropped (counted)"
            );
            // Skipping is instant; only a sample already being measured is waited for.
            self.abandon.store(true, Ordering::Relaxed);
        }
        let _ = thread.join();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.finish(Duration::from_secs(2));
    }
}
