//! Where the collector is in its life ([`Phase`]), as the streams, the committer
//! and the ops endpoints see it, and [`until`], the wait on it.
//!
//! `serve` starts it at [`Phase::Serving`] and sets [`Phase::Draining`] on
//! shutdown; the committer sets [`Phase::Drained`] after the final commit.
//!
//! Below every module that watches the phase; it imports nothing of the crate.

use tokio::sync::watch;

/// Where the collector is in its life, as streams see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Serving,
    /// Stop reading new batches; a final commit is under way.
    Draining,
    /// The final commit is done: send the last acks and close.
    Drained,
}

/// Resolves once `phase` satisfies `done` (or its sender is gone).
pub async fn until(phase: &mut watch::Receiver<Phase>, done: impl Fn(Phase) -> bool) {
    let _ = phase.wait_for(|p| done(*p)).await;
}
