//! The rankscope wire protocol: generated types of package `rankscope.v1` and the
//! protocol constants both ends agree on.
//!
//! Layout:
//! - `proto/rankscope/v1/telemetry.proto`: the protocol, documented field by field;
//! - [`v1`]: the generated messages, client and server;
//! - the constants below: version and size limits.

/// Generated code for `rankscope.v1`.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("rankscope.v1");
}

/// The schema major version this build speaks; a different major is refused.
pub const SCHEMA_MAJOR: u32 = 1;
/// The schema minor version this build writes.
pub const SCHEMA_MINOR: u32 = 0;
/// The largest message either side accepts by default, in bytes.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;
/// The longest run id accepted.
pub const MAX_RUN_ID_LEN: usize = 128;

impl v1::Mode {
    /// The name users write (`full`, `rank0`, `steps`) and the Parquet columns hold.
    pub fn label(self) -> &'static str {
        match self {
            v1::Mode::Unspecified => "unspecified",
            v1::Mode::Full => "full",
            v1::Mode::Rank0 => "rank0",
            v1::Mode::Steps => "steps",
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
