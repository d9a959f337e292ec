//! The health columns of a sample: `mean`, `std`, `zero_fraction` and `nonfinite`,
//! computed in float64 on the sample's own device ([`health`]). It imports only the
//! host copy of [`super::spectral`].
//!
//! # Conventions (defined, not accidental)
//!
//! - **Non-finite input** (any NaN or ±Inf in the sample): the spectral columns are `None`,
//!   `nonfinite` counts the bad elements, and mean / std / zero_fraction are computed over the
//!   finite elements only (`None` if there are none).
//! - **Empty input** (n = 0 or d = 0): every metric is `None`; `rows` and `cols` say why.
//! - `std` is the population standard deviation; `zero_fraction` counts exact zeros (dead
//!   ReLU units).

use tch::{Kind, TchError, Tensor};

use super::spectral::to_host;

/// Elements per block of the float64 health sums: a 2 MiB float64 copy, which stays in
/// cache for the sum and the dot product that read it (2¹⁸ elements took a third of the CPU
/// time of 2²⁰ at 2,048 × 4,096, where each block was also squared into a second copy).
const HEALTH_BLOCK: i64 = 1 << 18;

/// The health columns of one matrix.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Health {
    pub mean: Option<f64>,
    /// Population standard deviation.
    pub std: Option<f64>,
    /// Exact zeros over the number of (finite) elements.
    pub zero_fraction: Option<f64>,
    /// NaN and ±Inf elements.
    pub nonfinite: u64,
    /// Σx² when every element is finite (the trace of AᵀA, which the sketch needs);
    /// `None` when some are not, and then no spectrum is measured.
    pub sum_sq: Option<f64>,
}

/// The health of an `n × d` matrix with n, d > 0.
pub(super) fn health(matrix: &Tensor, n: i64, d: i64) -> Result<Health, TchError> {
    let numel = matrix.numel() as u64;
    // Σx and Σx² in float64, over blocks of about 2¹⁸ elements cast one at a
    // time (a float64 copy of the whole matrix costs more than the sums), with one
    // device → host transfer for all. A NaN or ±Inf anywhere makes Σx non-finite (in
    // float64 the sum of finite float32 values cannot overflow), so finite input needs no
    // isfinite pass.
    let block_rows = (HEALTH_BLOCK / d).max(1);
    let mut partial = Vec::new();
    for start in (0..n).step_by(block_rows as usize) {
        let block = matrix.f_narrow(0, start, block_rows.min(n - start))?;
        let wide = block.f_to_kind(Kind::Double)?.f_reshape([-1])?;
        partial.push(Tensor::f_stack(
            &[
                wide.f_sum(Kind::Double)?,
                // A float64 dot product: no squared copy of the block.
                wide.f_dot(&wide)?,
            ],
            0,
        )?);
    }
    // The zeros in one pass over the whole matrix: per block it cost twice as much.
    let health = to_host(&Tensor::f_cat(
        &[
            Tensor::f_stack(&partial, 0)?.f_sum_dim_intlist(0, false, Kind::Double)?,
            matrix
                .f_count_nonzero(None::<i64>)?
                .f_to_kind(Kind::Double)?
                .f_reshape([1])?,
        ],
        0,
    )?)?;
    let (sum, sum_sq, nonzero) = (health[0], health[1], health[2]);
    if !(sum.is_finite() && sum_sq.is_finite()) {
        return health_nonfinite(&matrix.f_to_kind(Kind::Double)?);
    }
    let n_values = numel as f64;
    let mean = sum / n_values;
    Ok(Health {
        mean: Some(mean),
        // Population variance as E[x²] − mean², in float64: exact enough unless the
        // mean exceeds the spread by about 10⁶, far beyond any activation's.
        std: Some((sum_sq / n_values - mean * mean).max(0.0).sqrt()),
        zero_fraction: Some((n_values - nonzero) / n_values),
        nonfinite: 0,
        sum_sq: Some(sum_sq),
    })
}

/// Health over the finite values of a matrix that holds NaN or ±Inf; no spectrum.
fn health_nonfinite(x: &Tensor) -> Result<Health, TchError> {
    let finite = x.f_isfinite()?;
    let values = x.f_masked_select(&finite)?;
    let finite_count = values.numel() as u64;
    let mut out = Health {
        nonfinite: (x.numel() as u64).saturating_sub(finite_count),
        ..Health::default()
    };
    if finite_count > 0 {
        let health = to_host(&Tensor::f_stack(
            &[
                values.f_mean(Kind::Double)?,
                values.f_std(false)?,
                values.f_eq(0.0)?.f_sum(Kind::Double)?,
            ],
            0,
        )?)?;
        out.mean = Some(health[0]);
        out.std = Some(health[1]);
        out.zero_fraction = Some(health[2] / finite_count as f64);
    }
    Ok(out)
}
