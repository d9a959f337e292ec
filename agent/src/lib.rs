//! The rankscope agent: a library linked into every training rank. It samples layer
//! activations, computes their dimensionality off the training thread, times every
//! step, and streams all of it to the collector without ever blocking training.
//!
//! Layout, by job, from the floor up (each part imports only the parts above it in
//! this list, and `rows`: [`now_us`], the unit of every time column, and [`event_kind`]):
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
mod rows;
pub mod transport;

#[cfg(feature = "torch")]
pub mod sampling;
#[cfg(feature = "torch")]
pub mod training;

pub use config::{AgentConfig, ConfigError, Mode};
pub use rankscope_proto::Row;
pub use rows::{event_kind, now_us};
#[cfg(feature = "torch")]
pub use training::Agent;
#[cfg(feature = "torch")]
pub use training::comm::CommKind;
#[cfg(feature = "torch")]
pub use training::profile::Optimizer;
#[cfg(feature = "torch")]
pub use training::step::{Phase, StepGuard};
pub use transport::ClientTls;
pub use transport::FinishReport;
pub use transport::{Transport, TransportConfig};
