//! [`Transport`], the handle the training side holds. It starts the transport
//! thread (the `connection` module) and talks to it through the row queue and
//! [`super::connection::Control`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rankscope_proto::v1::Hello;
use tokio::sync::mpsc;

use super::connection::{Control, Counters, Streamer, TransportConfig};
use super::queue::RowQueue;
use super::report::FinishReport;
use rankscope_proto::Row;

/// The handle the training side holds. Cheap to call from the hot path.
#[derive(Debug)]
pub struct Transport {
    data: Arc<RowQueue>,
    control: mpsc::UnboundedSender<Control>,
    counters: Arc<Counters>,
    warned_full: AtomicBool,
    /// Whether a row sent after finish was warned about.
    warned_finished: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
    report: OnceLock<FinishReport>,
}

impl Transport {
    /// Starts the background thread; it connects lazily and never blocks the caller.
    pub fn start(config: TransportConfig, hello: Hello) -> std::io::Result<Transport> {
        let data = Arc::new(RowQueue::new(config.queue_rows));
        let data_rx = data.clone();
        let (control_tx, control_rx) = mpsc::unbounded_channel();
        let counters = Arc::new(Counters::default());
        let thread_counters = counters.clone();
        let thread = std::thread::Builder::new()
            .name(format!("rankscope-transport-{}", hello.rank))
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(error) => {
                        tracing::error!(%error, "cannot start the transport runtime; telemetry is off");
                        return;
                    }
                };
                let streamer = Streamer::new(config, hello, thread_counters);
                runtime.block_on(streamer.run(data_rx, control_rx));
            })?;
        Ok(Transport {
            data,
            control: control_tx,
            counters,
            warned_full: Default::default(),
            warned_finished: Default::default(),
            thread: Mutex::new(Some(thread)),
            report: OnceLock::new(),
        })
    }

    /// The transport thread's CPU clock (for the overhead budget); read it only
    /// before [`Transport::finish`], which joins the thread.
    pub fn cpu_clock(&self) -> Option<crate::budget::cpu_clock::ThreadClock> {
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        thread
            .as_ref()
            .and_then(crate::budget::cpu_clock::ThreadClock::of)
    }

    /// The transport thread's one-time set-up CPU time (0 until its first connection
    /// attempt is over), for the overhead budget to leave out.
    pub fn set_up_ns(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.counters.set_up_ns.clone()
    }

    /// The process's CPU time and the transport thread's, as the transport thread
    /// reads them on its tick, for the overhead budget's decisions.
    pub fn tick_clocks(&self) -> Arc<crate::budget::cpu_clock::TickClocks> {
        self.counters.tick_clocks.clone()
    }

    /// Queues a row, or gives it back when the queue is full (nothing counted): for
    /// producers that can wait, such as the load generator.
    // The row comes back by value: boxing it would allocate on the hot path.
    #[allow(clippy::result_large_err)]
    pub fn try_send(&self, row: Row) -> Result<(), Row> {
        match self.data.push(row) {
            Ok(()) => {
                self.counters.queued.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(row) => Err(row),
        }
    }

    /// Queues a row; never blocks. Returns false (and counts the row as dropped)
    /// when the queue is full or the transport has finished.
    pub fn send(&self, row: Row) -> bool {
        match self.try_send(row) {
            Ok(()) => true,
            // Not the queue's fault: the rank's report is made, nothing more is sent.
            Err(_) if self.report.get().is_some() => {
                if !self.warned_finished.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "the agent has finished: rows recorded after finish() (steps, events, samples) are not sent"
                    );
                }
                false
            }
            Err(_) => {
                self.counters.dropped_queue.fetch_add(1, Ordering::Relaxed);
                if !self.warned_full.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "telemetry queue full: dropping rows (counted, reported as rows_dropped events)"
                    );
                }
                false
            }
        }
    }

    /// Sends `final_rows` in a final batch, waits at most `timeout` for everything
    /// to be acknowledged, and stops the thread. Callable more than once: later
    /// calls return the first report.
    pub fn finish(&self, final_rows: Vec<Row>, timeout: Duration) -> FinishReport {
        if let Some(report) = self.report.get() {
            return report.clone();
        }
        let (reply_tx, reply_rx) = std_mpsc::channel();
        self.counters
            .queued
            .fetch_add(final_rows.len() as u64, Ordering::Relaxed);
        let control = Control::Finish {
            final_rows,
            deadline: Instant::now() + timeout,
            reply: reply_tx,
        };
        let report = if self.control.send(control).is_ok() {
            reply_rx
                .recv_timeout(timeout + Duration::from_secs(1))
                .unwrap_or_default()
        } else {
            FinishReport::default()
        };
        if let Some(thread) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = thread.join();
        }
        self.report.get_or_init(|| report).clone()
    }
}

impl Drop for Transport {
    fn drop(&mut self) {
        if self.report.get().is_none() {
            self.finish(Vec::new(), Duration::from_secs(2));
        }
    }
}
