//! The metrics worker: a thread that turns samples into `layers` rows, so the spectra
//! never run on the training thread (`RANKSCOPE_METRICS_THREADS` of them, one by
//! default, take jobs from one queue; what is said of the thread holds for each).
//!
//! The training thread reads each sample once (into a buffer of the agent's,
//! [`super::host`]), or an adapter hands over what a device reduced it to, and the
//! [`Job`] goes through a queue; this thread only measures ([`super::measure::measure`])
//! and gives the buffer back ([`SampleBuffers`]). An adapter whose sample still has to
//! come to the host (a tch tensor on a GPU) hands over a [`DeferredSample`], read here.
//! The training thread samples no step whose samples the queue has no room for (it
//! counts the step as skipped, `budget::sampler`), and the overhead budget
//! keeps the worker's CPU time within its share ([`crate::budget`]): the worker runs in
//! the normal scheduling class and reports its own CPU time after each sample.
//!
//! Before its first job the thread warms up (`warm_up`): it measures a small
//! synthetic sample, so one-time set-up (the thread's first allocations, the eigen-
//! solver's first call) is paid at `init`, off the training thread, and not by the
//! run's first sample. Its CPU time is reported apart (`WorkerCounters::warm_up_ns`)
//! and left out of the overhead budget, which then learns what a sample costs from a
//! first sample that costs what later ones do.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rankscope_proto::v1::EventRow;

use super::buffers::SampleBuffers;
use super::depths::SketchDepths;
use super::host::{HostSample, SampleMatrix};
use super::measure::measure;
use super::options::{SpectrumMode, SpectrumOptions};
use super::sketch::SKETCH_MIN_SIDE;
use super::spectral::{SplitMix64, gaussian};
use crate::budget::cpu_clock;
use crate::budget::sampler::WorkerCounters;
use crate::rows::now_us;
use crate::transport::Transport;
use rankscope_proto::Row;

/// A sample whose data an adapter still has to bring to the host, on the metrics
/// thread (a tch tensor on a GPU: the copy waits for the device, so not on the
/// training thread).
pub trait DeferredSample: Send {
    /// The sample on the host, read into `buffer` (reused) where it is a matrix; the
    /// error's text goes into an `events` row.
    fn read(self: Box<Self>, buffer: Vec<f32>) -> Result<HostSample, String>;

    /// The host memory its reading will take (what the metrics queue's bound counts).
    fn bytes(&self) -> u64;
}

/// What a job brings.
pub enum JobInput {
    Ready(HostSample),
    Deferred(Box<dyn DeferredSample>),
}

impl JobInput {
    /// The host memory the sample holds, or will once read: what the metrics queue's
    /// bound counts (`budget::sampler`).
    pub fn bytes(&self) -> u64 {
        match self {
            JobInput::Ready(sample) => sample.bytes(),
            JobInput::Deferred(deferred) => deferred.bytes(),
        }
    }
}

impl std::fmt::Debug for JobInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobInput::Ready(sample) => f.debug_tuple("Ready").field(sample).finish(),
            JobInput::Deferred(_) => f.write_str("Deferred"),
        }
    }
}

/// One sampled activation, handed over by the training thread.
#[derive(Debug)]
pub struct Job {
    pub step: u64,
    pub layer: String,
    pub input: JobInput,
    /// When it was sampled.
    pub time: i64,
}

impl Job {
    /// A job for `input`, time-stamped now.
    pub fn new(step: u64, layer: &str, input: JobInput) -> Job {
        Job {
            step,
            layer: layer.to_string(),
            input,
            time: now_us(),
        }
    }
}

/// Rows and columns of the warm-up's synthetic sample: small enough to cost a few
/// milliseconds.
const WARM_UP_SHAPE: (usize, usize) = (256, 48);

/// Measures a synthetic sample once, so the metrics path's one-time set-up happens now
/// rather than in the run's first sample; and the sketch's, where the configured mode
/// always sketches a wide enough matrix. Its result is thrown away.
pub(crate) fn warm_up(centered: bool, spectrum: &SpectrumOptions) {
    let mut rng = SplitMix64(0x5eed);
    let (rows, cols) = WARM_UP_SHAPE;
    let matrix = SampleMatrix {
        values: gaussian(&mut rng, rows * cols),
        rows,
        cols,
    };
    let _ = measure(
        &mut HostSample::matrix(matrix, "", 0x5eed),
        centered,
        spectrum,
    );
    if spectrum.mode == SpectrumMode::Sketch {
        let side = SKETCH_MIN_SIDE as usize;
        let matrix = SampleMatrix {
            values: gaussian(&mut rng, side * side),
            rows: side,
            cols: side,
        };
        let _ = measure(
            &mut HostSample::matrix(matrix, "", 0x5eed),
            centered,
            spectrum,
        );
    }
}

/// The metrics threads and their queue.
#[derive(Debug)]
pub struct Worker {
    queue: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
    /// Set when [`Worker::finish`] gives up waiting: queued jobs are skipped.
    abandon: Arc<AtomicBool>,
}

impl Worker {
    /// Starts `threads` metrics threads (at least one) on one queue; they count the
    /// jobs they are done with, their CPU time together, and the jobs they skip at
    /// finish (dropped) in `counters`. Measured samples' buffers go back to `buffers`.
    pub(crate) fn start(
        transport: Arc<Transport>,
        centered: bool,
        spectrum: SpectrumOptions,
        threads: usize,
        counters: Arc<WorkerCounters>,
        buffers: Arc<SampleBuffers>,
        sketch_depths: Arc<SketchDepths>,
    ) -> std::io::Result<Worker> {
        // Unbounded as a channel: the training side admits a step only when the
        // queue has room for all its samples (`Sampler::decide`), which bounds it.
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let abandon = Arc::new(AtomicBool::new(false));
        let threads = threads.max(1);
        let mut handles = Vec::with_capacity(threads);
        for index in 0..threads {
            let name = if threads == 1 {
                "rankscope-metrics".to_string()
            } else {
                format!("rankscope-metrics-{index}")
            };
            let thread = Measuring {
                transport: transport.clone(),
                centered,
                spectrum,
                counters: counters.clone(),
                buffers: buffers.clone(),
                sketch_depths: sketch_depths.clone(),
                abandon: abandon.clone(),
            };
            let rx = rx.clone();
            let spawned = std::thread::Builder::new().name(name).spawn(move || {
                thread.run(|| rx.lock().unwrap_or_else(|e| e.into_inner()).recv().ok());
            });
            match spawned {
                Ok(handle) => handles.push(handle),
                // One thread measures as well, only slower.
                Err(error) if !handles.is_empty() => {
                    tracing::warn!(%error, started = handles.len(), "could not start every metrics thread");
                    break;
                }
                Err(error) => return Err(error),
            }
        }
        Ok(Worker {
            queue: Some(tx),
            threads: handles,
            abandon,
        })
    }

    /// A handle to the queue; the training thread hands jobs over (it has admitted
    /// their step with room for them).
    pub fn sender(&self) -> Option<Sender<Job>> {
        self.queue.clone()
    }

    /// Measures the queued jobs and stops the threads (once every sender is
    /// dropped). Past `wait` (workers starved of CPU time by other processes),
    /// the jobs still queued are skipped (and counted as dropped) rather than
    /// hold up the caller.
    pub fn finish(&mut self, wait: Duration) {
        self.queue = None;
        let threads = std::mem::take(&mut self.threads);
        if threads.is_empty() {
            return;
        }
        let deadline = Instant::now() + wait;
        while !threads.iter().all(JoinHandle::is_finished) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if !threads.iter().all(JoinHandle::is_finished) {
            tracing::warn!(
                "the metrics worker had not measured its queued samples when finish stopped waiting ({:.1} s): they are dropped (counted in the samples_dropped event)",
                wait.as_secs_f64()
            );
            // Skipping is instant; only samples already being measured are waited for.
            self.abandon.store(true, Ordering::Relaxed);
        }
        for thread in threads {
            let _ = thread.join();
        }
    }
}

/// What one metrics thread holds.
struct Measuring {
    transport: Arc<Transport>,
    centered: bool,
    spectrum: SpectrumOptions,
    counters: Arc<WorkerCounters>,
    buffers: Arc<SampleBuffers>,
    sketch_depths: Arc<SketchDepths>,
    abandon: Arc<AtomicBool>,
}

impl Measuring {
    /// Warms up, then measures the jobs `next` gives until it gives none, adding this
    /// thread's CPU time to the counters after each.
    fn run(self, next: impl Fn() -> Option<Job>) {
        let Measuring {
            transport,
            centered,
            spectrum,
            counters,
            buffers,
            sketch_depths,
            abandon,
        } = self;
        warm_up(centered, &spectrum);
        // The warm-up (and the thread's start) is the agent's set-up, not a sample's
        // cost: the CPU time reported from here on leaves it out.
        let warm_up_ns = cpu_clock::this_thread_ns().unwrap_or(0);
        counters.warm_up_ns.fetch_add(warm_up_ns, Ordering::Relaxed);
        let mut reported = 0u64;
        let mut report_cpu = || {
            if let Some(ns) = cpu_clock::this_thread_ns() {
                let spent = ns.saturating_sub(warm_up_ns);
                counters
                    .cpu_ns
                    .fetch_add(spent.saturating_sub(reported), Ordering::Relaxed);
                reported = reported.max(spent);
            }
        };
        while let Some(job) = next() {
            let bytes = job.input.bytes();
            if abandon.load(Ordering::Relaxed) {
                counters.dropped.fetch_add(1, Ordering::Relaxed);
                counters.done_with(bytes);
                continue;
            }
            let started = Instant::now();
            let sample = match job.input {
                JobInput::Ready(sample) => Ok(sample),
                JobInput::Deferred(deferred) => deferred.read(buffers.take(&job.layer)),
            };
            let mut sample = match sample {
                Ok(sample) => sample,
                Err(error) => {
                    transport.send(Row::Event(EventRow {
                        time: job.time,
                        kind: crate::rows::event_kind::SAMPLE_UNREADABLE.into(),
                        message: format!("layer {}: {error}", job.layer),
                        value: None,
                        step: Some(job.step),
                    }));
                    counters.dropped.fetch_add(1, Ordering::Relaxed);
                    counters.done_with(bytes);
                    report_cpu();
                    continue;
                }
            };
            let m = measure(&mut sample, centered, &spectrum);
            if let Some(seen) = m.summary_depths {
                sketch_depths.learn(&job.layer, seen);
            }
            let compute_ms = started.elapsed().as_secs_f64() * 1e3;
            if let Some(buffer) = sample.into_buffer() {
                buffers.give_back(&job.layer, buffer);
            }
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
            if counters.done_with(bytes) == 0 {
                let first = counters.cpu_ns.load(Ordering::Relaxed);
                counters.first_ns.store(first, Ordering::Relaxed);
            }
        }
        report_cpu();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.finish(Duration::from_secs(2));
    }
}
