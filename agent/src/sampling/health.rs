//! The health columns of a sample: `mean`, `std`, `zero_fraction` and `nonfinite`
//! ([`Health`]), from sums over its elements ([`HealthSums`]): summed here, in float64,
//! for a matrix on the host ([`sums`]), or by the device that reduced the sample.
//!
//! # Conventions (defined, not accidental)
//!
//! - **Non-finite input** (any NaN or ±Inf in the sample): the spectral columns are `None`,
//!   `nonfinite` counts the bad elements, and mean / std / zero_fraction are computed over the
//!   finite elements only (`None` if there are none).
//! - **Empty input** (n = 0 or d = 0): every metric is `None`; `rows` and `cols` say why.
//! - `std` is the population standard deviation; `zero_fraction` counts exact zeros (dead
//!   ReLU units).

use super::host::HealthSums;

/// The health columns of one sample.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Health {
    pub mean: Option<f64>,
    /// Population standard deviation.
    pub std: Option<f64>,
    /// Exact zeros over the number of (finite) elements.
    pub zero_fraction: Option<f64>,
    /// NaN and ±Inf elements.
    pub nonfinite: u64,
}

impl Health {
    pub(super) fn from_sums(s: &HealthSums) -> Health {
        if s.finite == 0 {
            return Health {
                nonfinite: s.nonfinite,
                ..Health::default()
            };
        }
        let n = s.finite as f64;
        let mean = s.sum / n;
        Health {
            mean: Some(mean),
            // Population variance as E[x²] − mean², in float64: exact enough unless the
            // mean exceeds the spread by about 10⁶, far beyond any activation's.
            std: Some((s.sum_sq / n - mean * mean).max(0.0).sqrt()),
            zero_fraction: Some(s.zeros as f64 / n),
            nonfinite: s.nonfinite,
        }
    }
}

/// Elements summed per float64 partial: short runs keep the float64 sums exact enough
/// and let the compiler keep them in vector registers.
const LANES: usize = 8;

/// The health sums of `values`, in float64. Finite input (the common case) takes one
/// branch-free pass: a NaN or ±Inf anywhere makes Σx or Σx² non-finite (in float64 the
/// sums of finite float32 values cannot overflow), and only then does a second pass
/// count them and sum the finite elements alone.
pub(super) fn sums(values: &[f32]) -> HealthSums {
    let mut sum = [0.0f64; LANES];
    let mut sum_sq = [0.0f64; LANES];
    let mut zeros = [0u64; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for k in 0..LANES {
            let x = f64::from(chunk[k]);
            sum[k] += x;
            sum_sq[k] += x * x;
            zeros[k] += u64::from(chunk[k] == 0.0);
        }
    }
    for (k, &v) in tail.iter().enumerate() {
        let x = f64::from(v);
        sum[k] += x;
        sum_sq[k] += x * x;
        zeros[k] += u64::from(v == 0.0);
    }
    let out = HealthSums {
        finite: values.len() as u64,
        nonfinite: 0,
        sum: sum.iter().sum(),
        sum_sq: sum_sq.iter().sum(),
        zeros: zeros.iter().sum(),
    };
    if out.sum.is_finite() && out.sum_sq.is_finite() {
        return out;
    }
    let mut out = HealthSums::default();
    for &v in values {
        if v.is_finite() {
            let x = f64::from(v);
            out.finite += 1;
            out.sum += x;
            out.sum_sq += x * x;
            out.zeros += u64::from(v == 0.0);
        } else {
            out.nonfinite += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finite_and_nonfinite_sums() {
        let h = Health::from_sums(&sums(&[0.0, 1.0, 2.0, 3.0, 0.0]));
        assert_eq!(h.mean, Some(1.2));
        assert!((h.std.unwrap() - (1.36f64).sqrt()).abs() < 1e-12);
        assert_eq!(h.zero_fraction, Some(0.4));
        assert_eq!(h.nonfinite, 0);
        let h = Health::from_sums(&sums(&[1.0, f32::NAN, 3.0, f32::INFINITY]));
        assert_eq!((h.mean, h.nonfinite), (Some(2.0), 2));
        let h = Health::from_sums(&sums(&[f32::NAN]));
        assert_eq!((h.mean, h.std, h.nonfinite), (None, None, 1));
    }
}
