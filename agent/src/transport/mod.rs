//! The transport: everything between the training side and the collector.
//!
//! The handle ([`Transport`]) starts a background thread, with its own single-threaded
//! tokio runtime, that batches rows and streams them to the collector. The training
//! thread only calls [`Transport::send`], a push into the bounded row queue: when the
//! queue is full the row is dropped and counted, never waited for.
//! [`Transport::finish`] sends a final batch, waits a bounded time for the
//! acknowledgements and returns a [`FinishReport`].
//!
//! - `handle`: [`Transport`], what the training side holds;
//! - `queue`: the bounded row queue between the training thread and the transport
//!   thread;
//! - `connection`: the transport thread's loop, which batches, streams and resends,
//!   and its settings ([`TransportConfig`]);
//! - [`outbox`]: unacknowledged batches, numbered, bounded, resent after reconnects;
//! - [`spill`]: the on-disk log that keeps them across outages and crashes;
//! - [`client_tls`]: TLS to the collector;
//! - [`report`]: what was delivered, at finish.
//!
//! The transport imports only the protocol and the budget's CPU clock (the handle
//! lends the transport thread's clock to the budget); config, sampling and the
//! training side import it. Within it, imports run up the list: the handle imports
//! the connection and the queue, the connection the outbox, the outbox the spill.

pub mod client_tls;
mod connection;
mod handle;
pub mod outbox;
mod queue;
pub mod report;
pub mod spill;

pub use client_tls::ClientTls;
pub use connection::{DEFAULT_QUEUE_ROWS, DEFAULT_SPILL_MAX_BYTES, DRAIN_EVERY, TransportConfig};
pub use handle::Transport;
pub use report::FinishReport;
