//! The metrics of one sample, exactly as `docs/metrics.md` defines them: the core's
//! second step, on the metrics thread, over host buffers only.
//!
//! [`measure`] takes a [`HostSample`] (what an adapter handed over, [`super::host`]): the
//! health columns (`sampling::health`) → optional centring → the spectrum. The spectrum is
//! [`Method::Exact`] (`sampling::exact`: eigenvalues of the Gram matrix of the smaller
//! side) or, for matrices with at least [`SpectrumOptions::sketch_threshold`] rows and
//! columns, [`Method::Sketch`] ([`super::sketch`]: randomized block Krylov estimates, each
//! with its own error estimate), or [`Method::Fallback`] where the sketch cannot vouch for
//! a value within the bound `docs/metrics.md` states. A sample a device reduced brings its
//! Gram matrix, which both methods use as it is, or, where the sketch measures it, the
//! Krylov process the device ran ([`super::sketch::KrylovSummary`]): the sketch's
//! analysis then runs on that, and a column it cannot vouch for is null (there is no
//! matrix to fall back to).
//! [`LayerMetrics::into_layer_row`] is the one place the metrics become a `layers` row.

use faer::MatRef;
use rankscope_proto::v1::LayerRow;

use super::depths::SummaryDepths;
use super::exact::{exact_spectral, gram_spectral};
use super::gram::GramOperator;
use super::health::{Health, sums};
use super::host::{HostActivation, HostSample, SampleData, read_sample};
use super::options::{MatrixOptions, Method, SketchPolicy, SpectrumOptions, Unvouched};
use super::sketch::{KrylovSummary, sketch_spectral, sketch_summarized};
use super::spectral::{Spectral, SpectralErrors};

/// Everything one layers row needs besides identity and timing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerMetrics {
    /// Rows of the matrix actually measured (after sampling), saturating at `u32::MAX`.
    pub rows: u32,
    /// Columns of the matrix, saturating at `u32::MAX`.
    pub cols: u32,
    /// Whether column means were subtracted before the spectrum.
    pub centered: bool,
    /// `"channelwise"` or `"flatten"` for a 4-D activation, `""` otherwise.
    pub conv_layout: &'static str,
    /// `"exact"`, `"sketch"` or `"fallback"`: what computed the spectral columns; `""` when
    /// they are null.
    pub method: &'static str,
    /// The six spectral columns.
    pub spectral: Spectral,
    /// The sketch's error estimates of the six (`None` unless `method` is `"sketch"`).
    pub errors: SpectralErrors,
    pub mean: Option<f64>,
    /// Population standard deviation.
    pub std: Option<f64>,
    /// Exact zeros over the number of (finite) elements.
    pub zero_fraction: Option<f64>,
    /// NaN and ±Inf elements in the sample.
    pub nonfinite: u64,
    /// Where a device's Krylov summary was analysed: the depths it held and needed,
    /// which that layer's next sample learns from ([`super::depths`]). Not a column.
    pub summary_depths: Option<SummaryDepths>,
}

/// The metrics of a sample, with or without centring, with the spectrum method
/// `spectrum` picks. Never panics.
pub fn measure(
    sample: &mut HostSample,
    centered: bool,
    spectrum: &SpectrumOptions,
) -> LayerMetrics {
    measure_with(sample, centered, spectrum, &SketchPolicy::default())
}

/// [`measure`], with the sketch run by `policy` instead of the agent's (its CPU time for
/// some columns alone, or nulls instead of the exact path where it cannot vouch). A
/// matrix sample is centred in place.
pub fn measure_with(
    sample: &mut HostSample,
    centered: bool,
    spectrum: &SpectrumOptions,
    policy: &SketchPolicy,
) -> LayerMetrics {
    let (n, d) = (sample.rows, sample.cols);
    let mut out = LayerMetrics {
        centered,
        conv_layout: sample.conv_layout,
        rows: u32::try_from(n).unwrap_or(u32::MAX),
        cols: u32::try_from(d).unwrap_or(u32::MAX),
        ..LayerMetrics::default()
    };
    if n == 0 || d == 0 {
        return out;
    }
    let seed = sample.seed;
    let (health, spectral) = match &mut sample.data {
        SampleData::Matrix(values) => {
            if values.len() != n * d {
                tracing::warn!(
                    len = values.len(),
                    n,
                    d,
                    "a sample's buffer does not match its shape"
                );
                return out;
            }
            let s = sums(values);
            let spectral = (s.nonfinite == 0)
                .then(|| matrix_spectral(values, n, d, centered, s.sum_sq, seed, spectrum, policy));
            (Health::from_sums(&s), spectral)
        }
        SampleData::Reduced(reduced) => {
            let r = n.min(d);
            let spectral = match &reduced.gram {
                Some(gram) if reduced.health.nonfinite == 0 => {
                    let values = gram.values();
                    if reduced.side != r || values.len() != r * r {
                        tracing::warn!(
                            side = reduced.side,
                            n,
                            d,
                            "a reduced sample's Gram matrix does not match its shape"
                        );
                        None
                    } else {
                        Some(reduced_spectral(values, n, d, seed, spectrum, policy))
                    }
                }
                _ => None,
            };
            (Health::from_sums(&reduced.health), spectral)
        }
        SampleData::Sketched(sketched) => {
            let spectral = match &sketched.packed {
                Some(packed) if sketched.health.nonfinite == 0 => {
                    // Read here, off the training thread that handed it over.
                    match KrylovSummary::from_packed(n.min(d), packed.values()) {
                        Some(summary) => {
                            // The device ran the sketch: no Gram matrix here to fall back
                            // to, so a column the sketch cannot vouch for is null.
                            let sketch = sketch_summarized(&summary, sketched.trace, policy.goal);
                            out.summary_depths = SummaryDepths::of(summary.depths.len(), &sketch);
                            Some((Method::Sketch, sketch.spectral, sketch.errors))
                        }
                        None => {
                            tracing::warn!(
                                values = packed.values().len(),
                                deepest = KrylovSummary::packed_len(),
                                "a sketched sample's packed Krylov summary has the wrong length"
                            );
                            None
                        }
                    }
                }
                _ => None,
            };
            (Health::from_sums(&sketched.health), spectral)
        }
    };
    out.mean = health.mean;
    out.std = health.std;
    out.zero_fraction = health.zero_fraction;
    out.nonfinite = health.nonfinite;
    if let Some((method, spectral, errors)) = spectral {
        out.method = method.label();
        out.spectral = spectral;
        out.errors = errors;
    }
    out
}

/// Both steps, [`read_sample`] and [`measure`], for callers that hold the whole
/// activation on the host (the `spectrum` command, the benchmarks, the adapters' tests).
pub fn compute(
    activation: &HostActivation<'_>,
    options: &MatrixOptions,
    seed: u64,
) -> LayerMetrics {
    let (matrix, conv_layout) = read_sample(
        activation,
        options.conv_layout,
        options.max_rows,
        seed,
        Vec::new(),
    );
    let mut sample = HostSample::matrix(matrix, conv_layout, seed);
    measure(&mut sample, options.centered, &options.spectrum)
}

impl LayerMetrics {
    /// The `layers` row of these metrics: the one place the two are mapped.
    pub fn into_layer_row(self, step: u64, time: i64, layer: String, compute_ms: f64) -> LayerRow {
        let Spectral {
            stable_rank,
            participation_ratio,
            participation_ratio_sv,
            cum_energy_90,
            nuclear_norm_ratio,
            effective_rank,
        } = self.spectral;
        let errors = self.errors;
        LayerRow {
            step,
            time,
            layer,
            rows: self.rows,
            cols: self.cols,
            centered: self.centered,
            stable_rank,
            participation_ratio,
            participation_ratio_sv,
            cum_energy_90,
            nuclear_norm_ratio,
            effective_rank,
            mean: self.mean,
            std: self.std,
            zero_fraction: self.zero_fraction,
            nonfinite: self.nonfinite,
            compute_ms,
            conv_layout: self.conv_layout.to_string(),
            method: self.method.to_string(),
            stable_rank_err: errors.stable_rank,
            participation_ratio_err: errors.participation_ratio,
            participation_ratio_sv_err: errors.participation_ratio_sv,
            cum_energy_90_err: errors.cum_energy_90,
            nuclear_norm_ratio_err: errors.nuclear_norm_ratio,
            effective_rank_err: errors.effective_rank,
        }
    }
}

/// The spectrum of a matrix on the host (centred in place when asked).
#[allow(clippy::too_many_arguments)]
fn matrix_spectral(
    values: &mut [f32],
    n: usize,
    d: usize,
    centered: bool,
    sum_sq: f64,
    seed: u64,
    spectrum: &SpectrumOptions,
    policy: &SketchPolicy,
) -> (Method, Spectral, SpectralErrors) {
    match spectrum.method(n as i64, d as i64) {
        Method::Sketch => {
            // The exact path centres in float64 from the original values, so the sketch
            // (which centres in place) runs on a copy only when it may fall back.
            let trace = if centered {
                center(values, n, d)
            } else {
                sum_sq
            };
            let a = MatRef::from_row_major_slice(&*values, n, d);
            let sketch = sketch_spectral(&GramOperator::Factored(a), trace, seed, policy.goal);
            if sketch.vouched || policy.unvouched == Unvouched::Null {
                (Method::Sketch, sketch.spectral, sketch.errors)
            } else {
                // A value the sketch cannot vouch for: the exact path measures the
                // (already centred) sample.
                (
                    Method::Fallback,
                    exact_spectral(values, n, d, false),
                    SpectralErrors::default(),
                )
            }
        }
        method => (
            method,
            exact_spectral(values, n, d, centered),
            SpectralErrors::default(),
        ),
    }
}

/// The spectrum from a device's Gram matrix (already centred when asked).
fn reduced_spectral(
    gram: &[f32],
    n: usize,
    d: usize,
    seed: u64,
    spectrum: &SpectrumOptions,
    policy: &SketchPolicy,
) -> (Method, Spectral, SpectralErrors) {
    let r = n.min(d);
    match spectrum.method(n as i64, d as i64) {
        Method::Sketch => {
            let g = MatRef::from_row_major_slice(gram, r, r);
            let trace: f64 = (0..r).map(|i| f64::from(g[(i, i)])).sum();
            let sketch = sketch_spectral(&GramOperator::Explicit(g), trace, seed, policy.goal);
            if sketch.vouched || policy.unvouched == Unvouched::Null {
                (Method::Sketch, sketch.spectral, sketch.errors)
            } else {
                (
                    Method::Fallback,
                    gram_spectral(gram, r),
                    SpectralErrors::default(),
                )
            }
        }
        method => (method, gram_spectral(gram, r), SpectralErrors::default()),
    }
}

/// Subtracts the column means (computed in float64) of the `n × d` row-major matrix in
/// place; returns the centred matrix's Σx² (the trace the sketch takes).
fn center(values: &mut [f32], n: usize, d: usize) -> f64 {
    let mut means = vec![0.0f64; d];
    for row in values.chunks_exact(d) {
        for (m, &x) in means.iter_mut().zip(row) {
            *m += f64::from(x);
        }
    }
    let means: Vec<f32> = means.iter().map(|m| (m / n as f64) as f32).collect();
    let mut trace = 0.0;
    for row in values.chunks_exact_mut(d) {
        for (x, &m) in row.iter_mut().zip(&means) {
            *x -= m;
            trace += f64::from(*x) * f64::from(*x);
        }
    }
    trace
}
