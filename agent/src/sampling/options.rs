//! The options of the metrics pipeline: how an activation becomes a matrix
//! ([`ConvLayout`], [`MatrixOptions`]) and which computation gives its spectrum
//! ([`SpectrumOptions`], [`Method`], [`SketchPolicy`]). Plain values; it imports only the
//! sketch's size floor and goals, and the configured [`SpectrumMode`].

use super::sketch::{SKETCH_MIN_SIDE, SketchGoal};
pub use crate::config::SpectrumMode;

/// How a 4-D (B, C, H, W) activation becomes a matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ConvLayout {
    /// Every spatial position is a sample of the C channel features: (B·H·W, C).
    #[default]
    Channelwise,
    /// One row per example, NDT's convention: (B, C·H·W).
    Flatten,
}

impl ConvLayout {
    /// The name used in configuration and in the `conv_layout` column.
    pub fn label(self) -> &'static str {
        match self {
            ConvLayout::Channelwise => "channelwise",
            ConvLayout::Flatten => "flatten",
        }
    }

    /// The inverse of [`ConvLayout::label`]; anything else is `None`.
    pub fn parse(s: &str) -> Option<ConvLayout> {
        match s {
            "channelwise" => Some(ConvLayout::Channelwise),
            "flatten" => Some(ConvLayout::Flatten),
            _ => None,
        }
    }
}

/// Options of the activation → matrix step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MatrixOptions {
    /// Row cap; rows beyond it are sampled. 0 means no cap.
    pub max_rows: usize,
    /// Subtract column means before the spectrum (covariance convention) or not (NDT's).
    pub centered: bool,
    /// How 4-D activations become matrices.
    pub conv_layout: ConvLayout,
    /// Exact or sketched spectrum.
    pub spectrum: SpectrumOptions,
}

/// Which computation gives the spectral columns (see `docs/metrics.md`, "Sketch mode").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpectrumOptions {
    pub mode: SpectrumMode,
    /// `auto` sketches a matrix whose rows and columns are both at least this many.
    pub sketch_threshold: usize,
    /// The same where a device runs the sketch's Krylov process and the host only
    /// analyses it ([`SpectrumOptions::method_on_device`]).
    pub device_sketch_threshold: usize,
}

impl Default for SpectrumOptions {
    fn default() -> Self {
        SpectrumOptions {
            mode: SpectrumMode::Auto,
            sketch_threshold: crate::config::DEFAULT_SKETCH_THRESHOLD,
            device_sketch_threshold: crate::config::DEFAULT_DEVICE_SKETCH_THRESHOLD,
        }
    }
}

/// The computation that produced a row's spectral columns (the `method` column).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// The Gram matrix of the smaller side and a symmetric eigen-solve, in float64.
    Exact,
    /// Randomized block Krylov in float32 ([`super::sketch::sketch_spectral`]), every
    /// stored value within its stated bound by the sketch's own error estimate.
    Sketch,
    /// The sketch ran but could not vouch for a value within its bound, and the exact path
    /// measured the sample ([`SpectrumOptions::method`] never chooses it).
    Fallback,
}

impl Method {
    /// The value of the `method` column.
    pub fn label(self) -> &'static str {
        match self {
            Method::Exact => "exact",
            Method::Sketch => "sketch",
            Method::Fallback => "fallback",
        }
    }
}

impl SpectrumOptions {
    /// The method for a matrix of `rows` × `cols`.
    pub fn method(&self, rows: i64, cols: i64) -> Method {
        self.method_from(self.sketch_threshold, rows, cols)
    }

    /// The method for a matrix of `rows` × `cols` that a device reduces, and whose
    /// Krylov process it runs where the sketch measures it.
    pub fn method_on_device(&self, rows: i64, cols: i64) -> Method {
        self.method_from(self.device_sketch_threshold, rows, cols)
    }

    fn method_from(&self, threshold: usize, rows: i64, cols: i64) -> Method {
        let side = rows.min(cols);
        let threshold = i64::try_from(threshold).unwrap_or(i64::MAX);
        match self.mode {
            _ if side < SKETCH_MIN_SIDE => Method::Exact,
            SpectrumMode::Exact => Method::Exact,
            SpectrumMode::Sketch => Method::Sketch,
            SpectrumMode::Auto if side >= threshold => Method::Sketch,
            SpectrumMode::Auto => Method::Exact,
        }
    }
}

/// What [`super::measure::measure_with`] does with a sample the sketch cannot vouch for
/// (an error estimate above its stated bound, `docs/metrics.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Unvouched {
    /// Measure it with the exact path (`method` = `fallback`): what the agent does. Its
    /// CPU time is the metrics thread's, which the overhead budget counts.
    #[default]
    Exact,
    /// Store the values the sketch vouches for and null the others, whose error estimates
    /// stay in the `_err` columns as the marker.
    Null,
}

/// How the sketch runs: which columns decide its depth, and what happens where it cannot
/// vouch for them. The default is the agent's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SketchPolicy {
    pub goal: SketchGoal,
    pub unvouched: Unvouched,
}
