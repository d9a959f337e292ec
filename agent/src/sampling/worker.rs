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

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rankscope_proto::v1::EventRow;

use super::measure::measure;
use super::options::SpectrumOptions;
use super::prepare::Sample;
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
    pub(crate) fn start(
        transport: Arc<Transport>,
        centered: bool,
        spectrum: SpectrumOptions,
        counters: Arc<WorkerCounters>,
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
                let report_cpu = || {
                    if let Some(ns) = cpu_clock::this_thread_ns() {
                        counters.cpu_ns.store(ns, Ordering::Relaxed);
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
