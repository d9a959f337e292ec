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
//! - [`sampling`]: a sample → its metrics, on the metrics thread, over host buffers
//!   (pure Rust: no framework);
//! - [`training`]: what training code calls: the [`Agent`] handle, step timing, the
//!   model profile, memory.
//!
//! Above the core, the adapters, which only reduce a framework's tensors to what the
//! core takes (host buffers, a device's reduction, shapes):
//! - with the `torch` feature, [`torch`]: tch programs (`Agent::tap`, `observe`,
//!   `profile_model`, libtorch's allocator bytes);
//! - the Python package (its own crate, `python/`), through DLPack and the user's torch.
//!
//! `ARCHITECTURE.md` draws the same parts.

pub mod budget;
pub mod config;
mod rows;
pub mod sampling;
pub mod training;
pub mod transport;

#[cfg(feature = "torch")]
pub mod torch;

pub use config::{AgentConfig, ConfigError, Mode};
pub use rankscope_proto::Row;
pub use rows::{event_kind, now_us};
pub use training::Agent;
pub use training::comm::CommKind;
pub use training::memory::{DeviceBytes, DeviceMemory};
pub use training::profile::{Optimizer, Parameter};
pub use training::step::{Phase, StepGuard};
pub use transport::ClientTls;
pub use transport::FinishReport;
pub use transport::{Transport, TransportConfig};
