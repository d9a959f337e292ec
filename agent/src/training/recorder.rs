//! [`Recorder`]: the running agent of one active rank, which the handle
//! ([`crate::Agent`]) and its step guards ([`super::step`]) share. It starts the
//! transport and the metrics worker, takes samples on the training thread (an
//! adapter's activation read into reused buffers, [`crate::sampling::buffers`], or
//! what a device reduced it to), counts the agent's time there, and sends the final
//! rows at finish. It imports the layers below the training side (config, sampling,
//! the budget, the transport), never the handle or the step guards.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use rankscope_proto::v1::{EventRow, Hello, RankRow, RunRow};
use rankscope_proto::{MAX_EVENT_MESSAGE_BYTES, MAX_LABEL_BYTES};

use super::comm::{self, CommTally};
use super::memory::{DeviceBytes, DeviceMemory, RssReader};
use crate::budget::counts::Overhead;
use crate::budget::sampler::Sampler;
use crate::config::AgentConfig;
use crate::rows::now_us;
use crate::sampling::buffers::SampleBuffers;
use crate::sampling::depths::SketchDepths;
use crate::sampling::worker::{self, JobInput, Worker};
use crate::sampling::{
    self, ConvLayout, HostActivation, HostSample, MatrixOptions, SpectrumOptions,
};
use crate::transport::report::FinishReport;
use crate::transport::{Transport, TransportConfig};
use rankscope_proto::Row;

/// A tapped layer's output shape, seen during profiling.
#[derive(Debug, Clone)]
pub(crate) struct ObservedShape {
    pub name: String,
    pub kind: Option<&'static str>,
    pub output: Vec<i64>,
}

/// Sampled activations waiting for the metrics worker, at most, unless one step
/// samples more layers: a step is sampled whole, so the queue then holds one step's
/// samples. This bounds the host memory of queued samples to
/// `max(WORKER_QUEUE, layers per step) × max_rows × cols` float32 values (a device's
/// reduction: its Gram matrix or sketch summary instead), or to
/// [`crate::budget::sampler::SECOND_STEP_BYTES`] where a second step queues behind
/// the first (at the bytes a sample has held so far). The copies' buffers are kept
/// for reuse until finish; they are at most as many as the queue holds, plus one
/// being measured, per layer.
pub(super) const WORKER_QUEUE: usize = 16;

#[derive(Debug)]
pub(crate) struct Recorder {
    pub(crate) config: AgentConfig,
    pub(crate) transport: Arc<Transport>,
    worker: Mutex<Option<Worker>>,
    /// Sample counters, the agent's CPU time and the overhead budget.
    pub(crate) sampler: Sampler,
    worker_queue: Mutex<Option<std::sync::mpsc::Sender<worker::Job>>>,
    /// Samples kept back from the metrics thread while a measurement holds them
    /// ([`Recorder::hold_samples`]); `None` when nothing holds them.
    held: Mutex<Option<Vec<worker::Job>>>,
    /// True during a step whose activations are sampled.
    pub(crate) sampling: AtomicBool,
    pub(crate) step: AtomicU64,
    /// Nanoseconds the agent spent on the training thread since the last step row
    /// took them.
    pub(crate) overhead_ns: AtomicU64,
    /// A delay added to every sampled step, unseen by the agent's clocks
    /// ([`crate::Agent::inject_sampled_step_delay`], tests only).
    pub(crate) injected_delay_ns: AtomicU64,
    /// Collectives completed since a step last took them (the `comm` table).
    pub(crate) comm: CommTally,
    pub(crate) rss: RssReader,
    /// Reads the accelerator allocator's bytes for each step row, where an adapter
    /// set a reader ([`crate::Agent::set_device_memory`]).
    pub(crate) device_memory: Mutex<Option<Box<dyn DeviceMemory>>>,
    /// True while [`crate::Agent::profile_model`] runs its forward pass.
    pub(crate) profiling: AtomicBool,
    /// Output shapes recorded while profiling, in forward order.
    pub(crate) shapes: Mutex<Vec<ObservedShape>>,
    /// How the training thread prepares a sample.
    pub(crate) options: MatrixOptions,
    /// The buffers the training thread copies samples into.
    pub(super) buffers: Arc<SampleBuffers>,
    /// How deep each layer's device sketch runs, learnt by the metrics threads.
    pub(super) sketch_depths: Arc<SketchDepths>,
    /// This rank's identity as sent to the collector; its `ranks` row at finish.
    hello: Hello,
    report: OnceLock<FinishReport>,
}

/// How long an agent dropped unfinished waits for the collector.
const DROP_FINISH_TIMEOUT: Duration = Duration::from_secs(2);

impl Drop for Recorder {
    /// An agent dropped unfinished (a Python agent collected before the interpreter's
    /// exit, which would finish it) finishes as [`Recorder::finish`] does. Without it
    /// the fields would drop in their order: the metrics worker first, which joins its
    /// threads while the queue's sender, a later field, keeps them waiting for work.
    fn drop(&mut self) {
        if self.report.get().is_none() {
            // As briefly as the transport's own drop waits: nobody waits for this one.
            self.finish_within(DROP_FINISH_TIMEOUT.min(self.config.finish_timeout));
        }
    }
}

impl Recorder {
    pub(crate) fn start(config: AgentConfig) -> std::io::Result<Recorder> {
        let started_at = now_us();
        let hostname = clean_label(&hostname(), MAX_LABEL_BYTES);
        let hello = Hello {
            run_id: config.run_id.clone(),
            rank: config.rank,
            local_rank: config.local_rank,
            node_rank: config.node_rank,
            world_size: config.world_size,
            hostname,
            pid: std::process::id(),
            mode: config.mode.recording_mode() as i32,
            agent_version: env!("CARGO_PKG_VERSION").into(),
            schema_major: rankscope_proto::SCHEMA_MAJOR,
            schema_minor: rankscope_proto::SCHEMA_MINOR,
            started_at,
        };
        let mut tc = TransportConfig::new(&config.collector);
        tc.queue_rows = config.queue_rows;
        tc.token = config.token.clone();
        tc.spill_dir = config.spill_dir.clone();
        tc.spill_max_bytes = config.spill_max_bytes;
        tc.tls = config.tls.clone();
        let transport = Arc::new(Transport::start(tc, hello.clone())?);
        if config.rank == 0 {
            transport.send(Row::Run(RunRow {
                started_at,
                world_size: config.world_size,
                mode: config.mode.recording_mode() as i32,
                sample_every: u32::try_from(config.sample_every).unwrap_or(u32::MAX),
                max_rows: u32::try_from(config.max_rows).unwrap_or(u32::MAX),
                centered: config.centered,
                layer_filter: config.layer_filter.as_text(),
                agent_version: env!("CARGO_PKG_VERSION").into(),
                workload: config.workload.clone(),
                overhead_budget: Some(config.overhead_budget.fraction()),
            }));
        }
        let options = MatrixOptions {
            max_rows: config.max_rows,
            centered: config.centered,
            conv_layout: ConvLayout::parse(&config.conv_layout).unwrap_or_default(),
            spectrum: SpectrumOptions {
                mode: config.spectrum,
                sketch_threshold: config.sketch_threshold,
                device_sketch_threshold: config.device_sketch_threshold,
            },
        };
        let sampler = Sampler::new(
            config.overhead_budget,
            transport.cpu_clock(),
            transport.set_up_ns(),
            transport.tick_clocks(),
        );
        let buffers = Arc::new(SampleBuffers::default());
        let sketch_depths = Arc::new(SketchDepths::default());
        let (worker, queue) = if config.samples_layers() {
            let w = Worker::start(
                transport.clone(),
                config.centered,
                options.spectrum,
                config.metrics_threads,
                sampler.worker.clone(),
                buffers.clone(),
                sketch_depths.clone(),
            )?;
            let queue = w.sender();
            (Some(w), queue)
        } else {
            (None, None)
        };
        Ok(Recorder {
            config,
            transport,
            worker: Mutex::new(worker),
            sampler,
            worker_queue: Mutex::new(queue),
            held: Mutex::new(None),
            sampling: AtomicBool::new(false),
            step: AtomicU64::new(0),
            overhead_ns: AtomicU64::new(0),
            injected_delay_ns: AtomicU64::new(0),
            comm: CommTally::default(),
            rss: RssReader::default(),
            device_memory: Mutex::new(None),
            profiling: AtomicBool::new(false),
            shapes: Mutex::new(Vec::new()),
            options,
            buffers,
            sketch_depths,
            hello,
            report: OnceLock::new(),
        })
    }

    /// Counts the time since `since` as the agent's on the training thread: in the
    /// step row's `overhead_ms` and in the overhead budget.
    pub(crate) fn add_overhead(&self, since: Instant) {
        self.add_overhead_ns(since.elapsed().as_nanos() as u64, false);
    }

    /// [`Recorder::add_overhead`] for time spent taking a sample (it teaches the
    /// budget what a sample costs).
    pub(crate) fn add_sampling_overhead(&self, since: Instant) {
        self.add_overhead_ns(since.elapsed().as_nanos() as u64, true);
    }

    /// `ns` of the agent's time on the training thread; `sampling` when it was spent
    /// on a sampled step's samples (taking them, and a binding's hooks).
    pub(crate) fn add_overhead_ns(&self, ns: u64, sampling: bool) {
        self.overhead_ns.fetch_add(ns, Ordering::Relaxed);
        self.sampler.add_training_ns(ns, sampling);
    }

    fn record_shape(&self, name: &str, kind: Option<&'static str>, shape: &[i64]) {
        let mut shapes = self.shapes.lock().unwrap_or_else(|e| e.into_inner());
        if !shapes.iter().any(|s| s.name == name) {
            shapes.push(ObservedShape {
                name: name.to_string(),
                kind,
                output: shape.to_vec(),
            });
        }
    }

    /// On the training thread: whether a sample of layer `name` (output `shape`) is
    /// taken now, and if so its identity, counted as taken. On a step that is not
    /// sampled this costs one atomic load (and records the shape while profiling).
    pub(crate) fn begin_sample(
        &self,
        name: &str,
        kind: Option<&'static str>,
        shape: &[i64],
    ) -> Option<PendingSample> {
        if !self.sampling.load(Ordering::Relaxed) {
            if self.profiling.load(Ordering::Relaxed) {
                self.record_shape(name, kind, shape);
            }
            return None;
        }
        if !self.wants_layer(name) {
            return None;
        }
        // The step was admitted whole (`Sampler::decide`): every layer is taken.
        self.sampler.taken();
        let step = self.step.load(Ordering::Relaxed);
        Some(PendingSample {
            step,
            layer: name.to_string(),
            seed: sampling::sample_seed(&self.config.run_id, self.config.rank, step, name),
            time: now_us(),
        })
    }

    /// Hands a taken sample to the metrics thread, or, where the adapter could not
    /// read it, counts it as dropped and says why in an `events` row.
    pub(crate) fn hand_over(&self, pending: PendingSample, input: Result<JobInput, String>) {
        let input = match input {
            Ok(input) => input,
            Err(error) => {
                self.transport.send(Row::Event(EventRow {
                    time: pending.time,
                    kind: crate::rows::event_kind::SAMPLE_UNREADABLE.into(),
                    message: clean_label(
                        &format!("layer {}: {error}", pending.layer),
                        MAX_EVENT_MESSAGE_BYTES,
                    ),
                    value: None,
                    step: Some(pending.step),
                }));
                self.sampler.handed(false, 0);
                return;
            }
        };
        let bytes = input.bytes();
        let job = worker::Job {
            step: pending.step,
            layer: pending.layer,
            input,
            time: pending.time,
        };
        if let Some(held) = self.held.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            held.push(job);
            self.sampler.handed(true, bytes);
            return;
        }
        let queue = self.worker_queue.lock().unwrap_or_else(|e| e.into_inner());
        // The step was admitted with room for all its samples; only a finished
        // agent refuses.
        let sent = queue.as_ref().is_some_and(|q| q.send(job).is_ok());
        self.sampler.handed(sent, bytes);
    }

    /// Observes an activation in host memory: on a sampled step, reads its sample into
    /// a reused buffer and hands it over, counting the agent's time from `since` (the
    /// caller's own work for it began then) or else from here.
    pub(crate) fn observe_host(
        &self,
        name: &str,
        kind: Option<&'static str>,
        activation: &HostActivation<'_>,
        since: Option<Instant>,
    ) {
        let started = since.unwrap_or_else(Instant::now);
        let Some(pending) = self.begin_sample(name, kind, activation.shape()) else {
            return;
        };
        let sample = self.read_host(&pending, activation);
        self.hand_over(pending, Ok(JobInput::Ready(sample)));
        self.add_sampling_overhead(started);
    }

    /// The sample of a taken activation in host memory, read into a reused buffer.
    pub(crate) fn read_host(
        &self,
        pending: &PendingSample,
        activation: &HostActivation<'_>,
    ) -> HostSample {
        let (matrix, conv_layout) = sampling::read_sample(
            activation,
            self.options.conv_layout,
            self.options.max_rows,
            pending.seed,
            self.buffers.take(&pending.layer),
        );
        HostSample::matrix(matrix, conv_layout, pending.seed)
    }

    /// Drops the samples held so far (counted as dropped), for measurements that
    /// time the training thread with no metrics work at all. Returns how many.
    pub(crate) fn discard_held_samples(&self) -> usize {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let Some(jobs) = held.as_mut() else {
            return 0;
        };
        let n = jobs.len();
        for job in jobs.drain(..) {
            self.sampler.handed_then_dropped(job.input.bytes());
        }
        n
    }

    /// `true`: samples taken from now on wait on the training side instead of going
    /// to the metrics thread; `false`: they all go now, and later ones at once
    /// again. For measurements that keep the metrics thread's work out of the
    /// training steps they time (python/tests/test_api.py); a held sample counts
    /// as queued.
    pub(crate) fn hold_samples(&self, hold: bool) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if hold {
            held.get_or_insert_with(Vec::new);
            return;
        }
        let Some(jobs) = held.take() else {
            return;
        };
        drop(held);
        let queue = self.worker_queue.lock().unwrap_or_else(|e| e.into_inner());
        for job in jobs {
            let bytes = job.input.bytes();
            if queue.as_ref().is_none_or(|q| q.send(job).is_err()) {
                // Counted as handed when held: a refused one is dropped after all.
                self.sampler.handed_then_dropped(bytes);
            }
        }
    }

    pub(crate) fn finish(&self) -> FinishReport {
        self.finish_within(self.config.finish_timeout)
    }

    /// [`Recorder::finish`], waiting at most `timeout` for the collector (half of it
    /// for the metrics threads).
    fn finish_within(&self, timeout: Duration) -> FinishReport {
        if let Some(report) = self.report.get() {
            return report.clone();
        }
        self.sampling.store(false, Ordering::Relaxed);
        self.hold_samples(false);
        self.worker_queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(mut w) = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            w.finish(timeout / 2);
        }
        self.buffers.clear();
        self.sampler.freeze();
        let mut final_rows = comm::rows(None, &self.comm.take());
        final_rows.extend(self.sampling_events());
        final_rows.push(Row::Rank(RankRow::from_hello(&self.hello, Some(now_us()))));
        let report = self.transport.finish(final_rows, timeout);
        self.report.get_or_init(|| report).clone()
    }

    /// The events of the final batch: samples dropped and skipped, and the agent's
    /// share of the process's CPU time.
    fn sampling_events(&self) -> Vec<Row> {
        let event = |kind: &str, message: String, value: u64| {
            Row::Event(EventRow {
                time: now_us(),
                kind: kind.into(),
                message,
                value: Some(i64::try_from(value).unwrap_or(i64::MAX)),
                step: None,
            })
        };
        let samples = self.sampler.samples();
        let overhead = self.sampler.overhead();
        let budget = overhead.budget;
        let mut rows = Vec::new();
        if samples.dropped > 0 {
            rows.push(event(
                crate::rows::event_kind::SAMPLES_DROPPED,
                "activation samples taken but not measured: the activation could not be read (sample_unreadable events say why), or the metrics thread had not measured them when finish stopped waiting".into(),
                samples.dropped,
            ));
        }
        if samples.skipped > 0 || samples.steps_skipped > 0 {
            let by_budget = samples.skipped - samples.skipped_queue_full;
            rows.push(event(
                crate::rows::event_kind::SAMPLES_SKIPPED,
                format!(
                    "planned activation samples not taken: {by_budget} to stay within RANKSCOPE_OVERHEAD_BUDGET={budget} (cpu {}, device {}, observed {}: the share furthest over its room), {} because the metrics queue was full; {} planned steps skipped, each whole (a step is sampled at every layer or at none); {} steps sampled by the floor (one every {} steps) over the budget",
                    samples.skipped_cpu,
                    samples.skipped_device,
                    samples.skipped_observed,
                    samples.skipped_queue_full,
                    samples.steps_skipped,
                    samples.steps_floor,
                    crate::budget::sampler::FLOOR_STEPS,
                ),
                samples.skipped,
            ));
        }
        if let Some(share) = overhead.share() {
            rows.push(event(
                crate::rows::event_kind::OVERHEAD_SHARE,
                format!(
                    "the agent used {:.1} ms (training thread {:.1}, metrics thread {:.1}, transport thread {:.1}, device-side thread {:.1}) of the process's {:.1} ms of CPU time ({:.2} %; budget {budget}); the agent's threads' set-up at init ({:.1} ms: the metrics thread's warm-up, the transport thread's start and first connection) is left out of both; value in millionths. {}. {}",
                    overhead.agent_ns as f64 / 1e6,
                    overhead.training_ns as f64 / 1e6,
                    overhead.metrics_ns as f64 / 1e6,
                    overhead.transport_ns as f64 / 1e6,
                    overhead.device_thread_ns as f64 / 1e6,
                    overhead.process_ns as f64 / 1e6,
                    share * 100.0,
                    overhead.set_up_ns as f64 / 1e6,
                    device_sentence(&overhead),
                    observed_sentence(&overhead),
                ),
                (share * 1e6).round() as u64,
            ));
        }
        rows
    }

    /// Reads RSS and allocator bytes for a step row.
    pub(crate) fn memory(&self) -> (Option<u64>, Option<DeviceBytes>) {
        let device = self
            .device_memory
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .and_then(|reader| reader.read());
        (self.rss.read(), device)
    }
    /// Whether activations of `name` are sampled at all (see [`crate::Agent::wants_layer`]).
    pub(crate) fn wants_layer(&self, name: &str) -> bool {
        self.config.samples_layers()
            && self.config.layer_filter.matches(name)
            && rankscope_proto::is_valid_label(name)
    }

    /// Sends an event row (see [`crate::Agent::event`]).
    pub(crate) fn event(&self, kind: &str, message: &str, value: Option<i64>) {
        self.transport.send(Row::Event(EventRow {
            time: now_us(),
            kind: clean_label(kind, MAX_LABEL_BYTES),
            message: clean_label(message, MAX_EVENT_MESSAGE_BYTES),
            value,
            step: Some(self.step.load(Ordering::Relaxed)),
        }));
    }
}

/// The device time of the `overhead_share` event's message.
fn device_sentence(o: &Overhead) -> String {
    if o.device_samples == 0 {
        return "No device time (no device side)".into();
    }
    format!(
        "Device time of the agent's sample work: {:.1} ms over {} samples",
        o.device_ns as f64 / 1e6,
        o.device_samples
    )
}

/// The observed slowdown of the `overhead_share` event's message.
fn observed_sentence(o: &Overhead) -> String {
    match o.observed_per_step_ms {
        Some(median) => format!(
            "Observed slowdown: {:.1} ms over {} sampled steps (recent median {median:.2} ms a sampled step)",
            o.observed_ms, o.observed_steps
        ),
        None => "Observed slowdown: not measured (too few steps without sample work)".into(),
    }
}

/// A sample taken on the training thread and not yet handed over: what the adapter
/// needs to make it (the seed its rows are drawn with) and what its row says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingSample {
    pub step: u64,
    pub layer: String,
    /// The sampling seed of (run, rank, step, layer) ([`sampling::sample_seed`]).
    pub seed: u64,
    /// When it was taken.
    pub time: i64,
}

/// `text` with control characters replaced and cut to `max` bytes.
fn clean_label(text: &str, max: usize) -> String {
    let mut out = String::new();
    for c in text.chars().map(|c| if c.is_control() { ' ' } else { c }) {
        if out.len() + c.len_utf8() > max {
            break;
        }
        out.push(c);
    }
    out
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".into())
}
