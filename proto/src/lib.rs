//! The rankscope wire protocol: generated types of package `rankscope.v1` and the
//! protocol facts both ends agree on.
//!
//! Layout:
//! - `proto/rankscope/v1/telemetry.proto`: the protocol, documented field by field;
//! - [`v1`]: the generated messages, client and server;
//! - [`tables`]: the seven tables, a row of any of them ([`Row`]), counting a
//!   batch's rows, and a `ranks` row from a `Hello`;
//! - [`columns`]: `layers` rows as columns (`Batch.layer_columns`), both ways;
//! - the constants below: version and size limits, which the agent keeps to and the
//!   collector enforces.

pub mod columns;
pub mod tables;

pub use tables::{Row, Table};

#[allow(clippy::all, missing_docs)]
pub mod v1;

/// The schema major version this build speaks; a different major is refused.
pub const SCHEMA_MAJOR: u32 = 1;
/// The schema minor version this build writes. Minor 1: an agent declares the seq
/// gaps it made (`Batch.dropped_from`), and the collector refuses undeclared ones.
/// Minor 2: the `comm` table (`Batch.comm`); older agents send none of it.
/// Minor 3: `layers` rows travel as columns (`Batch.layer_columns`) to a collector
/// whose `Welcome.schema_minor` is 3 or later, and as rows to older ones.
pub const SCHEMA_MINOR: u32 = 3;
/// The first schema minor whose collectors read `Batch.layer_columns`.
pub const LAYER_COLUMNS_MINOR: u32 = 3;
/// The largest gRPC message either side accepts by default, in bytes.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;
/// The longest run id accepted.
pub const MAX_RUN_ID_LEN: usize = 128;
/// The longest layer name, event kind or other label accepted, in bytes.
pub const MAX_LABEL_BYTES: usize = 256;
/// The longest event text (`EventRow.message`) accepted, in bytes.
pub const MAX_EVENT_MESSAGE_BYTES: usize = 4096;
/// The most rows of all tables in one batch.
pub const MAX_ROWS_PER_BATCH: usize = 100_000;

impl v1::RecordingMode {
    /// The name users write (`full`, `rank0`, `steps`) and the Parquet columns hold.
    pub fn label(self) -> &'static str {
        match self {
            v1::RecordingMode::Unspecified => "unspecified",
            v1::RecordingMode::Full => "full",
            v1::RecordingMode::Rank0 => "rank0",
            v1::RecordingMode::Steps => "steps",
        }
    }
}

/// The run id rule both ends apply before a run id names a folder: 1 to
/// [`MAX_RUN_ID_LEN`] ASCII letters, digits, `.`, `_` or `-`, starting with a
/// letter or digit, without `..`.
pub fn is_valid_run_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_RUN_ID_LEN
        && id.as_bytes()[0].is_ascii_alphanumeric()
        && !id.contains("..")
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The label rule the collector enforces: at most [`MAX_LABEL_BYTES`] bytes and no
/// control characters.
pub fn is_valid_label(text: &str) -> bool {
    text.len() <= MAX_LABEL_BYTES && !text.chars().any(char::is_control)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        assert!(is_valid_label("encoder.layers.0.attn"));
        assert!(is_valid_label(&"x".repeat(MAX_LABEL_BYTES)));
        assert!(!is_valid_label(&"x".repeat(MAX_LABEL_BYTES + 1)));
        assert!(!is_valid_label("bad\u{1b}[31m"));
    }
}
