//! What every part that writes rows shares: [`now_us`], the unit of every time
//! column, and the `events.kind` values the agent writes itself ([`event_kind`]).
//! It imports nothing of the agent, so every part can import it.

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
    /// An activation the agent could not read (its element type, its device, its
    /// layout: a sparse, meta or quantized tensor), so no sample of it was taken.
    pub const SAMPLE_UNREADABLE: &str = "sample_unreadable";
    /// Planned samples skipped because a share of the overhead budget (`cpu`,
    /// `device` or `observed`) had no room: sent at the first such skip and whenever
    /// another share becomes the limit.
    pub const BUDGET_LIMITED: &str = "budget_limited";
    pub const ALL: [&str; 8] = [
        ROWS_DROPPED,
        SAMPLES_DROPPED,
        SAMPLES_SKIPPED,
        OVERHEAD_SHARE,
        SPILL_DAMAGED,
        NONFINITE_ACTIVATION,
        SAMPLE_UNREADABLE,
        BUDGET_LIMITED,
    ];
}

/// Microseconds since the Unix epoch: the unit of every time column.
pub fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}
