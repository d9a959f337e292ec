//! Sampling: what an activation sample becomes, off the training thread. The core of
//! the metrics: pure Rust over host buffers, with no framework (the adapters reduce a
//! tensor to what [`host`] takes).
//!
//! The metrics pipeline, as `docs/metrics.md` defines it, in the order data flows:
//! - [`options`]: how an activation becomes a matrix, and which spectrum method;
//! - [`prepare`]: the seed of a sample and the rows it draws;
//! - [`host`]: what an adapter hands over (an activation in host memory, read into a
//!   sample here on the training thread, or a device's reduction of it: its Gram
//!   matrix, or the sketch's [`sketch::KrylovSummary`], packed) and the activation → matrix
//!   table;
//! - [`buffers`]: the reused buffers samples are read into;
//! - [`depths`]: how many depths of the sketch's schedule each layer's device Krylov
//!   process runs, learnt from that layer's last summary;
//! - [`measure`](mod@measure): a sample → its `layers` metrics, on the metrics thread, using
//!   - `health`: `mean`, `std`, `zero_fraction`, `nonfinite`;
//!   - `exact`: the float64 Gram eigen-solve (faer);
//!   - [`sketch`]: randomized block Krylov estimates for large matrices, each with its
//!     own error estimate, over [`gram::GramOperator`];
//!   - [`spectral`](mod@spectral): the six spectral columns from eigenvalues, and the seeded random
//!     source both spectrum methods use;
//! - [`worker`]: the metrics thread that runs [`measure`](fn@measure) on queued samples;
//! - [`spectra`]: seeded test spectra and the exact-against-sketch comparison
//!   (benchmarks and tests).
//!
//! Sampling imports the transport (the worker sends `layers` rows), the budget (the
//! worker reports its CPU time) and config (the spectrum mode); never the training
//! side. Within it, imports run down the list above: `spectral` imports no other part.

pub mod buffers;
pub mod depths;
mod exact;
pub mod gram;
mod health;
pub mod host;
pub mod measure;
pub mod options;
pub mod prepare;
pub mod sketch;
#[cfg(feature = "torch")]
pub mod spectra;
pub mod spectral;
pub mod worker;

#[cfg(test)]
mod tests;

pub use host::{
    ElementType, F32Buffer, F64Buffer, HealthSums, HostActivation, HostSample, MatrixPlan, Reduced,
    SampleData, SampleError, SampleMatrix, Sketched, read_sample,
};
pub use measure::{LayerMetrics, compute, measure, measure_with};
pub use options::{
    ConvLayout, MatrixOptions, Method, SketchPolicy, SpectrumMode, SpectrumOptions, Unvouched,
};
pub use prepare::{choose_rows, sample_seed};
pub use sketch::{
    KrylovSummary, SKETCH_BLOCK, SKETCH_BOUNDS, SKETCH_MIN_SIDE, SKETCH_PROBES, SKETCH_SCHEDULE,
    SketchGoal,
};
pub use spectral::{Spectral, SpectralErrors, spectral};
