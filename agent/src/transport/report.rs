//! What the transport delivered, as known when it finished: [`FinishReport`].

use std::path::PathBuf;

/// What the transport delivered, as known when it finished.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FinishReport {
    /// Rows handed to the transport (queued, including the final batch's).
    pub rows_queued: u64,
    /// Rows the collector acknowledged as durable.
    pub rows_acked: u64,
    /// Rows dropped because the queue or the outbox was full.
    pub rows_dropped: u64,
    /// Rows still unacknowledged when the deadline passed (collector unreachable).
    pub rows_unacked: u64,
    /// Of those, rows kept in the rank's spill directory: a later process of the
    /// same run and rank, or `rankscope replay`, sends them.
    pub rows_spilled: u64,
    /// This rank's spill directory (`<spill_dir>/<run id>/rank-<rank>`), which
    /// holds them.
    pub rank_spill_dir: Option<PathBuf>,
    /// Whether the collector was ever reached.
    pub connected: bool,
}

impl FinishReport {
    /// True when every row reached durable storage.
    pub fn complete(&self) -> bool {
        self.rows_dropped == 0 && self.rows_unacked == 0
    }
}
