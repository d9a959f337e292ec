//! [`Report`]: what `finish()` returns.

use pyo3::prelude::*;
use rankscope_agent::FinishReport;

/// What `finish()` returns: rows sent, acknowledged, dropped and left unsent.
#[pyclass(module = "rankscope._native", frozen, get_all)]
#[derive(Clone)]
pub(crate) struct Report {
    /// Rows handed to the transport.
    rows_sent: u64,
    /// Rows the collector acknowledged as durable.
    rows_acked: u64,
    /// Rows dropped because a queue or the outbox was full (also an `events` row).
    rows_dropped: u64,
    /// Rows still unacknowledged at the deadline (collector unreachable).
    rows_unsent: u64,
    /// Of those, rows kept on disk for a later process or `rankscope replay`.
    rows_spilled: u64,
    /// The spill directory that holds them.
    spill_dir: Option<String>,
    /// Whether the collector was ever reached.
    connected: bool,
    /// Whether every row reached durable storage.
    complete: bool,
}

#[pymethods]
impl Report {
    fn __repr__(&self) -> String {
        format!(
            "Report(rows_sent={}, rows_acked={}, rows_dropped={}, rows_unsent={}, rows_spilled={}, spill_dir={}, connected={}, complete={})",
            self.rows_sent,
            self.rows_acked,
            self.rows_dropped,
            self.rows_unsent,
            self.rows_spilled,
            match &self.spill_dir {
                Some(dir) => format!("{dir:?}"),
                None => "None".into(),
            },
            self.connected,
            self.complete
        )
    }
}

impl From<FinishReport> for Report {
    fn from(r: FinishReport) -> Report {
        Report {
            complete: r.complete(),
            rows_sent: r.rows_queued,
            rows_acked: r.rows_acked,
            rows_dropped: r.rows_dropped,
            rows_unsent: r.rows_unacked,
            rows_spilled: r.rows_spilled,
            spill_dir: r.rank_spill_dir.map(|d| d.display().to_string()),
            connected: r.connected,
        }
    }
}

/// The report of an agent that recorded nothing.
#[pyfunction]
pub(crate) fn empty_report() -> Report {
    Report::from(FinishReport::default())
}
