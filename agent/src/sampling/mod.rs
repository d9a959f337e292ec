//! Sampling: what an activation sample becomes, off the training thread.
//!
//! The metrics pipeline, as `docs/metrics.md` defines it, in the order data flows:
//! - [`options`]: how an activation becomes a matrix, and which spectrum method;
//! - [`prepare`]: activation → matrix → row sample (on the training thread);
//! - [`measure`]: a sample → its `layers` metrics ([`compute`]: both steps), using
//!   - `health`: `mean`, `std`, `zero_fraction`, `nonfinite`;
//!   - `exact`: the float64 Gram eigen-solve;
//!   - [`sketch`]: randomized block Krylov estimates for large matrices, each with its
//!     own error estimate;
//!   - [`spectral`]: the six spectral columns from eigenvalues, and the seeded random
//!     source both spectrum methods use;
//! - [`worker`]: the metrics thread that runs [`measure`] on queued samples;
//! - [`threads`]: libtorch's intra-op threads per thread (the worker uses one);
//! - [`spectra`]: seeded test spectra and the exact-against-sketch comparison
//!   (benchmarks and tests).
//!
//! Sampling imports the transport (the worker sends `layers` rows), the budget (the
//! worker reports its CPU time) and config (the spectrum mode); never the training
//! side. Within it, imports run down the list above: `spectral` imports no other part.

mod exact;
mod gram;
mod health;
pub mod measure;
pub mod options;
pub mod prepare;
pub mod sketch;
pub mod spectra;
pub mod spectral;
pub mod threads;
pub mod worker;

#[cfg(test)]
mod tests;

pub use measure::{LayerMetrics, compute, measure, measure_with};
pub use options::{
    ConvLayout, MatrixOptions, Method, SketchPolicy, SpectrumMode, SpectrumOptions, Unvouched,
};
pub use prepare::{Sample, prepare, sample_rows, sample_seed, to_matrix};
pub use sketch::{SKETCH_BOUNDS, SKETCH_MIN_SIDE, SketchGoal};
pub use spectral::{Spectral, SpectralErrors, spectral};
