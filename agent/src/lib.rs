//! The rankscope agent: a library linked into every training rank. It samples layer
//! activations, computes their dimensionality off the training thread, times every
//! step, and streams all of it to the collector without ever blocking training.
//!
//! Layout:
//! - [`budget`]: the overhead budget and the controller that holds it;
//!   [`cpu_clock`]: the CPU clocks it reads;
//! - [`collector_list`]: which collector each rank sends to;
//! - [`config`]: `RANKSCOPE_*`, torchrun and SLURM variables, and the builder;
//! - [`layer_filter`]: which layers are sampled (`RANKSCOPE_LAYERS`);
//! - [`Row`]: a row of any table (from `rankscope-proto`);
//! - [`outbox`]: unacknowledged batches, numbered, bounded, resent after reconnects;
//! - [`spill`]: the on-disk log that keeps them across outages and crashes;
//! - [`transport`]: the handle that queues rows for the transport thread, through
//!   the bounded `queue`; `connection`: that thread's loop, which batches,
//!   streams and resends; [`client_tls`]: TLS to the collector; [`report`]: what
//!   was delivered, at finish;
//! - with the `torch` feature: [`metrics`] (the spectral and health metrics),
//!   [`sketch`] (the randomized spectrum of large matrices), [`spectra`] (seeded
//!   test spectra and the exact-against-sketch comparison),
//!   [`worker`] (metrics off the training thread), [`sampler`] (which
//!   planned samples are taken, within the budget), [`tap`] (capturing
//!   activations), [`step`] (step and phase timing), [`memory`] (RSS and
//!   allocator bytes), [`threads`] (intra-op threads per thread), [`profile`]
//!   (the static model profile), and [`agent`] (the handle training code holds).

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
pub use training::{Agent, agent, memory, profile, step, tap};
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
