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
//! ([`super::sketch`]: randomized block Krylov estimates, whose errors `docs/metrics.md`
//! states).
//! [`LayerMetrics::into_layer_row`] is the one place the metrics become a `layers` row.

use rankscope_proto::v1::LayerRow;
use tch::{Kind, TchError, Tensor};

use super::exact::exact_spectral;
use super::health::health;
use super::options::{MatrixOptions, Method, SpectrumOptions};
use super::prepare::{Sample, prepare};
use super::sketch::sketch_spectral;
use super::spectral::{Spectral, to_host};

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
    /// `"exact"` or `"sketch"`: what computed the spectral columns; `""` when they are null.
    pub method: &'static str,
    /// The six spectral columns.
    pub spectral: Spectral,
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
        sample.seed,
        &mut metrics,
    ) {
        tracing::warn!(%error, "activation metrics failed");
        metrics.spectral = Spectral::default();
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
        }
    }
}

fn measure_matrix(
    matrix: &Tensor,
    centered: bool,
    spectrum: &SpectrumOptions,
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

    let method = spectrum.method(n, d);
    out.spectral = match method {
        Method::Exact => exact_spectral(matrix, centered)?,
        Method::Sketch => {
            let a = matrix.f_to_kind(Kind::Float)?;
            if centered {
                let a = a.f_sub(&a.f_mean_dim(0i64, true, Kind::Float)?)?;
                let trace = to_host(&a.f_norm()?.f_square()?.f_reshape([1])?)?[0];
                sketch_spectral(&a, trace, seed)?
            } else {
                sketch_spectral(&a, sum_sq, seed)?
            }
        }
    };
    out.method = method.label();
    Ok(())
}
