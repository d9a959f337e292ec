//! Small statistics the detectors share: the normal tail and its inverse, robust
//! location and scale, least-squares lines, and the binomial tail.
//!
//! Everything is float64 and dependency-free; accuracy is stated per function.

/// The complementary error function, with a relative error below 1.2e-7 for
/// every x (the Chebyshev fit of Numerical Recipes' `erfcc`), which is enough for
/// tail probabilities down to 1e-300.
pub fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if x >= 0.0 { r } else { 2.0 - r }
}

/// P(|Z| ≥ z) for a standard normal Z.
pub fn two_sided_p(z: f64) -> f64 {
    erfc(z.abs() / std::f64::consts::SQRT_2).min(1.0)
}

/// The z with P(|Z| ≥ z) = p, for 0 < p < 1 (bisection; exact to 1e-10).
pub fn two_sided_quantile(p: f64) -> f64 {
    let p = p.clamp(1e-300, 1.0 - 1e-16);
    let (mut lo, mut hi) = (0.0_f64, 40.0_f64);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if two_sided_p(mid) > p {
            lo = mid;
        } else {
            hi = mid;
        }
        if hi - lo < 1e-12 {
            break;
        }
    }
    0.5 * (lo + hi)
}

/// The median of `values` (NaN-free); `None` when empty.
pub fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    })
}

/// The normal-consistent median absolute deviation, 1.4826 · median |x − median x|.
pub fn mad(values: &[f64]) -> Option<f64> {
    let m = median(values)?;
    let dev: Vec<f64> = values.iter().map(|v| (v - m).abs()).collect();
    median(&dev).map(|d| 1.4826 * d)
}

/// The quantile `q` (0–1) by linear interpolation between order statistics.
pub fn quantile(values: &[f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let pos = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let (i, frac) = (pos.floor() as usize, pos.fract());
    let next = v[(i + 1).min(v.len() - 1)];
    Some(v[i] + frac * (next - v[i]))
}

/// A least-squares line fitted to some points, kept as what the detectors need:
/// its value at a point and that value's variance in units of the noise variance.
#[derive(Clone, Copy, Debug)]
pub struct Line {
    pub slope: f64,
    x_mean: f64,
    y_mean: f64,
    n: f64,
    sxx: f64,
}

impl Line {
    /// Fits y = a + b·x; `None` with fewer than two distinct x. The x are shifted by
    /// their first value before summing, so large step numbers lose no precision.
    pub fn fit(
        xs: impl Iterator<Item = f64> + Clone,
        ys: impl Iterator<Item = f64> + Clone,
    ) -> Option<Line> {
        let mut origin = None;
        let (mut n, mut sx, mut sy) = (0.0, 0.0, 0.0);
        for (x, y) in xs.clone().zip(ys.clone()) {
            let o = *origin.get_or_insert(x);
            n += 1.0;
            sx += x - o;
            sy += y;
        }
        let o = origin?;
        let (xm, ym) = (sx / n, sy / n);
        let (mut sxx, mut sxy) = (0.0, 0.0);
        for (x, y) in xs.zip(ys) {
            let dx = x - o - xm;
            sxx += dx * dx;
            sxy += dx * (y - ym);
        }
        if sxx <= 0.0 {
            return None;
        }
        Some(Line {
            slope: sxy / sxx,
            x_mean: xm + o,
            y_mean: ym,
            n,
            sxx,
        })
    }

    /// The fitted value at `x`.
    pub fn at(&self, x: f64) -> f64 {
        self.y_mean + self.slope * (x - self.x_mean)
    }

    /// Var(fitted value at `x`) / σ², for independent noise of variance σ².
    pub fn variance_factor_at(&self, x: f64) -> f64 {
        let d = x - self.x_mean;
        1.0 / self.n + d * d / self.sxx
    }

    /// Var(slope) / σ².
    pub fn slope_variance_factor(&self) -> f64 {
        1.0 / self.sxx
    }

    /// The residual sum of squares over some points.
    pub fn rss(&self, xs: &[f64], ys: &[f64]) -> f64 {
        xs.iter()
            .zip(ys)
            .map(|(&x, &y)| (y - self.at(x)).powi(2))
            .sum()
    }

    /// Points fitted.
    pub fn len(&self) -> f64 {
        self.n
    }
}

/// P(X ≥ k) for X ~ Binomial(n, p), summed in log space (exact for the n of a run).
pub fn binomial_upper_tail(k: u64, n: u64, p: f64) -> f64 {
    if k == 0 {
        return 1.0;
    }
    if k > n || p <= 0.0 {
        return 0.0;
    }
    if p >= 1.0 {
        return 1.0;
    }
    let ln_choose = |n: u64, k: u64| {
        ln_gamma(n as f64 + 1.0) - ln_gamma(k as f64 + 1.0) - ln_gamma((n - k) as f64 + 1.0)
    };
    let mut total = 0.0;
    for i in k..=n {
        total += (ln_choose(n, i) + i as f64 * p.ln() + (n - i) as f64 * (1.0 - p).ln()).exp();
    }
    total.min(1.0)
}

/// ln Γ(x) for x > 0 (Lanczos, g = 7, about 15 significant digits).
pub fn ln_gamma(x: f64) -> f64 {
    const G: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut a = G[0];
    let t = x + 7.5;
    for (i, g) in G.iter().enumerate().skip(1) {
        a += g / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_tail_matches_known_values() {
        // Values from any statistics table.
        assert!((two_sided_p(1.959_964) - 0.05).abs() < 1e-7);
        assert!((two_sided_p(3.290_527) / 1e-3 - 1.0).abs() < 1e-5);
        assert!((two_sided_p(5.0) / 5.733_031e-7 - 1.0).abs() < 1e-5);
        assert!((two_sided_quantile(1e-4) - 3.890_592).abs() < 1e-5);
    }

    #[test]
    fn robust_location_and_scale() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
        assert_eq!(mad(&[1.0, 1.0, 2.0, 2.0, 4.0, 6.0, 9.0]), Some(1.4826));
        assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0, 5.0], 0.5), Some(3.0));
        assert_eq!(quantile(&[0.0, 10.0], 0.95), Some(9.5));
    }

    #[test]
    fn line_fit_at_large_steps() {
        let xs = [1e12, 1e12 + 1.0, 1e12 + 2.0, 1e12 + 3.0];
        let line = Line::fit(
            xs.iter().copied(),
            xs.iter().map(|x| 2.0 * (x - 1e12) + 1.0),
        )
        .unwrap();
        assert!((line.slope - 2.0).abs() < 1e-12);
        assert!((line.at(1e12 + 10.0) - 21.0).abs() < 1e-9);
        // One point, or one distinct x: no line.
        assert!(Line::fit([1.0].into_iter(), [1.0].into_iter()).is_none());
        assert!(Line::fit([1.0, 1.0].into_iter(), [1.0, 2.0].into_iter()).is_none());
    }

    #[test]
    fn binomial_tail() {
        assert!((binomial_upper_tail(1, 1, 0.25) - 0.25).abs() < 1e-12);
        // P(X ≥ 8 | n = 10, p = 0.5) = 56 / 1024.
        assert!((binomial_upper_tail(8, 10, 0.5) - 56.0 / 1024.0).abs() < 1e-12);
        assert_eq!(binomial_upper_tail(0, 10, 0.5), 1.0);
        assert!((ln_gamma(5.0) - 24f64.ln()).abs() < 1e-12);
    }
}
