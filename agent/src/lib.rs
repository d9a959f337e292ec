//! The rankscope agent: a library linked into every training rank. It samples layer
//! activations, computes their dimensionality off the training thread, times every
//! step, and streams all of it to the collector without ever blocking training.
//!
//! Layout, by job, from the floor up (each part imports only the parts above it in
//! this list, and the crate root's [`Row`], [`now_us`] and [`event_kind`]):
//! - [`budget`]: the agent's CPU time, measured, and the overhead budget that bounds it;
//! - [`transport`]: the row queue, the transport thread, the outbox and the spill:
//!   everything between the training side and the collector;
//! - [`config`]: `RANKSCOPE_*`, torchrun and SLURM variables, and the builder;
//! - with the `torch` feature, [`sampling`]: an activation sample → its metrics, on
//!   the metrics thread;
//! - with the `torch` feature, [`training`]: what training code calls: the
//!   [`Agent`] handle, step timing, taps, the model profile, memory.
//!
//! `ARCHITECTURE.md` draws the same parts.

pub mod budget;
pub mod config;
pub mod transport;

#[cfg(feature = "torch")]
pub mod sampling;
#[cfg(feature = "torch")]
pub mod training;

pub use config::{AgentConfig, ConfigError, Mode};
pub use rankscope_proto::Row;
#[cfg(feature = "torch")]
pub use training::Agent;
#[cfg(feature = "torch")]
pub use training::profile::Optimizer;
#[cfg(feature = "torch")]
pub use training::step::{Phase, StepGuard};
pub use transport::ClientTls;
pub use transport::FinishReport;
pub use transport::{Transport, TransportConfig};

/// The `events.kind` values the agent writes itself (docs/columns.md explains each).
pub mod event_kind {
    /// Rows dropped because the row queue or the outbox was full.
    pub const ROWS_DROPPED: &str = "rows_dropped";
    /// Activation samples taken but not measured.
    pub const SAMPLES_DROPPED: &str = "samples_dropped";
    /// Planned activation samples not taken (overhead budget, full metrics queue).
    pub const SAMPLES_SKIPPED: &str = "samples_skipped";
    /// The agent's share of the process's CPU time, at finish.
    pub const OVERHEAD_SHARE: &str = "overhead_share";
    /// Damaged records skipped in a rank's spill directory.
    pub const SPILL_DAMAGED: &str = "spill_damaged";
    /// NaN or ±Inf in a sampled activation.
    pub const NONFINITE_ACTIVATION: &str = "nonfinite_activation";
    pub const ALL: [&str; 6] = [
        ROWS_DROPPED,
        SAMPLES_DROPPED,
        SAMPLES_SKIPPED,
        OVERHEAD_SHARE,
        SPILL_DAMAGED,
        NONFINITE_ACTIVATION,
    ];
}

/// Microseconds since the Unix epoch: the unit of every time column.
pub fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}
