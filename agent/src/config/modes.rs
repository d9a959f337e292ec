//! The agent's modes: what it records (`RANKSCOPE_MODE`) and how it computes the
//! spectral columns (`RANKSCOPE_SPECTRUM`).

use std::fmt;

/// What the agent records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Every rank records everything.
    #[default]
    Full,
    /// Only rank 0 records; other ranks are inert (no thread, no connection).
    Rank0,
    /// Every rank records steps and memory, no layer spectra.
    Steps,
    /// Nothing is recorded.
    Off,
}

impl Mode {
    pub fn parse(text: &str) -> Option<Mode> {
        match text.trim().to_ascii_lowercase().as_str() {
            "full" => Some(Mode::Full),
            "rank0" => Some(Mode::Rank0),
            "steps" => Some(Mode::Steps),
            "off" => Some(Mode::Off),
            _ => None,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Mode::Full => "full",
            Mode::Rank0 => "rank0",
            Mode::Steps => "steps",
            Mode::Off => "off",
        }
    }

    /// The wire value (`off` never reaches the wire: an agent that records
    /// nothing does not connect).
    pub fn recording_mode(self) -> rankscope_proto::v1::RecordingMode {
        match self {
            Mode::Full => rankscope_proto::v1::RecordingMode::Full,
            Mode::Rank0 => rankscope_proto::v1::RecordingMode::Rank0,
            Mode::Steps => rankscope_proto::v1::RecordingMode::Steps,
            Mode::Off => rankscope_proto::v1::RecordingMode::Unspecified,
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// How the spectral columns are computed (`RANKSCOPE_SPECTRUM`; the `layers.method` column
/// records what ran).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpectrumMode {
    /// `sketch` for matrices with at least `RANKSCOPE_SKETCH_THRESHOLD` rows and columns,
    /// `exact` for the rest.
    #[default]
    Auto,
    /// The float64 Gram matrix and eigen-solve, whatever the size.
    Exact,
    /// The randomized block Krylov estimates, except for matrices too small to sketch.
    Sketch,
}

impl SpectrumMode {
    pub fn parse(text: &str) -> Option<SpectrumMode> {
        match text.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(SpectrumMode::Auto),
            "exact" => Some(SpectrumMode::Exact),
            "sketch" => Some(SpectrumMode::Sketch),
            _ => None,
        }
    }
}
