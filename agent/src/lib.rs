//! The rankscope agent: a library linked into every training rank. It samples layer
//! activations, computes their dimensionality off the training thread, times every
//! step, and streams all of it to the collector without ever blocking training.
//!
//! Layout:
//! - [`row`]: a row of any table;
//! - [`outbox`]: unacknowledged batches, resent after reconnects;
//! - [`transport`]: the background thread that batches and streams rows.

pub mod outbox;
pub mod row;
pub mod transport;

pub use row::Row;
pub use transport::{FinishReport, Transport, TransportConfig};

/// Microseconds since the Unix epoch: the unit of every time column.
pub fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}
