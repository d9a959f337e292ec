//! The metrics of one activation, exactly as `docs/metrics.md` defines them: the
//! pipeline's second step and the whole pipeline.
//!
//! The pipeline ([`compute`]) has two typed steps. [`prepare`]: activation → matrix →
//! row sample, giving a [`Sample`]; in the agent it runs once, on the training thread,
//! which hands the sample to the metrics thread. [`measure`]: the health columns
//! ([`super::health`]) → optional centring → the spectrum; the metrics thread runs only
//! this. The spectrum is [`Method::Exact`] ([`super::exact`]: eigenvalues of the Gram
//! matrix of the smaller side) or, for matrices with at least
//! [`SpectrumOptions::sketch_threshold`] rows and columns, [`Method::Sketch`]
//! ([`super::sketch`]: randomized block Krylov estimates, each with its own error
//! estimate), or [`Method::Fallback`] where the sketch cannot vouch for a value within the
//! bound `docs/metrics.md` states.
//! [`LayerMetrics::into_layer_row`] is the one place the metrics become a `layers` row.

use rankscope_proto::v1::LayerRow;
use tch::{Kind, TchError, Tensor};

use super::exact::exact_spectral;
use super::health::health;
use super::options::{MatrixOptions, Method, SketchPolicy, SpectrumOptions, Unvouched};
use super::prepare::{Sample, prepare};
use super::sketch::sketch_spectral;
use super::spectral::{Spectral, SpectralErrors, to_host};

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
}

/// The second step: the metrics of a prepared sample, on its own device, with or without
/// centring, with the spectrum method `spectrum` picks. Never panics: a libtorch failure
/// (which valid input does not cause) is logged and leaves the columns it prevented at `None`.
pub fn measure(sample: &Sample, centered: bool, spectrum: &SpectrumOptions) -> LayerMetrics {
    measure_with(sample, centered, spectrum, &SketchPolicy::default())
}

/// [`measure`], with the sketch run by `policy` instead of the agent's (its CPU time for
/// some columns alone, or nulls instead of the exact path where it cannot vouch).
pub fn measure_with(
    sample: &Sample,
    centered: bool,
    spectrum: &SpectrumOptions,
    policy: &SketchPolicy,
) -> LayerMetrics {
    let _guard = tch::no_grad_guard();
    let mut metrics = LayerMetrics {
        centered,
        conv_layout: sample.conv_layout,
        ..LayerMetrics::default()
    };
    if let Err(error) = measure_matrix(
        &sample.matrix,
        centered,
        spectrum,
        policy,
        sample.seed,
        &mut metrics,
    ) {
        tracing::warn!(%error, "activation metrics failed");
        metrics.spectral = Spectral::default();
        metrics.errors = SpectralErrors::default();
        metrics.method = "";
    }
    metrics
}

/// Both steps, [`prepare`] and [`measure`], for callers that hold the whole activation (the
/// `spectrum` command, the benchmarks). Never panics: a failure to prepare gives the empty
/// metrics, logged.
pub fn compute(activation: &Tensor, options: &MatrixOptions, seed: u64) -> LayerMetrics {
    let _guard = tch::no_grad_guard();
    match prepare(activation, options, seed) {
        Ok(sample) => measure(&sample, options.centered, &options.spectrum),
        Err(error) => {
            tracing::warn!(%error, "activation metrics failed");
            LayerMetrics {
                centered: options.centered,
                ..LayerMetrics::default()
            }
        }
    }
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

fn measure_matrix(
    matrix: &Tensor,
    centered: bool,
    spectrum: &SpectrumOptions,
    policy: &SketchPolicy,
    seed: u64,
    out: &mut LayerMetrics,
) -> Result<(), TchError> {
    let (n, d) = match matrix.size().as_slice() {
        &[n, d] => (n, d),
        _ => return Ok(()),
    };
    out.rows = u32::try_from(n).unwrap_or(u32::MAX);
    out.cols = u32::try_from(d).unwrap_or(u32::MAX);
    if n == 0 || d == 0 {
        return Ok(());
    }
    let health = health(matrix, n, d)?;
    out.mean = health.mean;
    out.std = health.std;
    out.zero_fraction = health.zero_fraction;
    out.nonfinite = health.nonfinite;
    let Some(sum_sq) = health.sum_sq else {
        return Ok(());
    };

    let mut method = spectrum.method(n, d);
    out.spectral = match method {
        Method::Sketch => {
            let a = matrix.f_to_kind(Kind::Float)?;
            let sketch = if centered {
                let a = a.f_sub(&a.f_mean_dim(0i64, true, Kind::Float)?)?;
                let trace = to_host(&a.f_norm()?.f_square()?.f_reshape([1])?)?[0];
                sketch_spectral(&a, trace, seed, policy.goal)?
            } else {
                sketch_spectral(&a, sum_sq, seed, policy.goal)?
            };
            if sketch.vouched || policy.unvouched == Unvouched::Null {
                out.errors = sketch.errors;
                sketch.spectral
            } else {
                // A value the sketch cannot vouch for: the exact path measures the sample.
                method = Method::Fallback;
                exact_spectral(matrix, centered)?
            }
        }
        Method::Exact | Method::Fallback => exact_spectral(matrix, centered)?,
    };
    out.method = method.label();
    Ok(())
}
