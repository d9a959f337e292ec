//! Jumps (change points in level) in one series of (step, value) points.
//!
//! # Method
//!
//! A moving-window jump test on local linear fits, the two-sided local-linear
//! change-point statistic of Müller (1992) and Loader (1996) scanned like a MOSUM
//! (Eichinger and Kirch 2018), with a threshold from a stated false-alarm rate:
//!
//! 1. **Noise.** σ̂ is the MAD of the Gasser–Sroka–Jennen-Steinmetz pseudo-residuals
//!    (each point against the straight line through its two neighbours, scaled to
//!    unit variance). A linear trend cancels exactly in them, even with uneven
//!    steps, and a jump touches only two of them, so neither drift nor jumps
//!    inflate σ̂. Correlated noise (a metric averaged over overlapping batches)
//!    would make a window's mean vary more than σ̂ says, so the lag-1
//!    autocorrelation φ̂ is estimated from the first differences
//!    ([`noise_correlation`]) and, for AR(1) noise, σ̂ is corrected for what the
//!    pseudo-residuals miss and the test uses the long-run scale
//!    σ̂·√((1 + φ̂)/(1 − φ̂)).
//! 2. **Spikes.** A point more than `spike_z`·σ̂ away from the median of the 7
//!    points around it is replaced by that median (a Hampel filter). A median is
//!    edge-preserving, so a level shift survives; a one-to-three-point spike
//!    (a loss spike) does not reach the next step.
//! 3. **Statistic.** For every boundary k (between point k−1 and point k), a line
//!    is fitted by least squares to the `window` points before it and another to
//!    the `window` points from it, against the step numbers. The jump estimate is
//!    D = right line − left line, both evaluated half-way between the two steps,
//!    and z = D / (σ̂ · √(v_left + v_right)), where v is each fitted value's
//!    variance factor. Without a jump, a locally linear series gives D ≈ 0: drift,
//!    a change of slope (a kink) at the boundary and curvature (both one-sided
//!    extrapolations err alike, to second order) do not register. Under
//!    independent Gaussian noise z is standard normal. A window whose line does
//!    not fit (a kink inside it, strong curvature, another jump) uses its own
//!    pooled residual scale instead of σ̂ when that is larger, so misfit lowers
//!    |z| instead of raising it; z never exceeds the σ̂ version.
//! 4. **Selection.** The boundary with the largest |z| becomes a jump if
//!    |z| ≥ c; windows of other boundaries then stop at it (so two jumps close
//!    together do not blur each other), and the search repeats. Finally every
//!    jump is re-tested between its neighbours and dropped if it fell below c.
//!
//! # False-alarm control
//!
//! c is the two-sided normal quantile of `false_alarm_rate` (default 1e-4, so
//! c ≈ 3.89): on a series without jumps the expected number of boundaries over the
//! threshold is at most `false_alarm_rate` per point (Bonferroni), that is at most
//! 0.1 false jumps per 1,000 points, and so per 1,000 steps whatever the sampling.
//! Neighbouring boundaries share their windows, so exceedances come in clusters
//! that yield one jump, and the real rate is lower. The validity tests
//! (`jumps_validity`) measure it, with the recall on planted jumps.
//!
//! **Assumptions** (where the control weakens): the signal is locally linear
//! within a window, and the noise is independent from point to point or AR(1)
//! (other correlation is only corrected to its lag-1 part). A change
//! of slope by Δb per point *inside* a window (not at its boundary) biases D by up
//! to 4.45·Δb (window 30, worst position), that is |z| up to 8.6·Δb/σ: a kink
//! sharper than about 0.3σ per point can be reported as a jump next to it (NDT's
//! drift fixture has a slope of 0.083σ per step). Heavy tails beyond what the
//! spike filter removes raise the false-alarm rate.
//!
//! Each jump also carries a **confidence**: 1 − the probability that noise alone
//! would give one |z| this large anywhere in a series of this length, by Šidák
//! over the boundaries: (1 − P(|Z| ≥ |z|))^(n−1). It is conservative (the
//! boundaries' tests are correlated).

use serde::Serialize;

use super::stats::{self, Line};

/// The detector's settings; [`JumpConfig::default`] is what the CLI and the
/// validity tests use.
#[derive(Clone, Debug)]
pub struct JumpConfig {
    /// Points on each side of a boundary in the local fits.
    pub window: usize,
    /// Fewest points on a side (near the ends and near another jump) for a
    /// boundary to be tested.
    pub min_side: usize,
    /// Expected false jumps per point on a series without any (the Bonferroni
    /// bound above).
    pub false_alarm_rate: f64,
    /// Spike filter threshold, in units of σ̂.
    pub spike_z: f64,
    /// Least σ̂, as a share of the series' median absolute value: on a series
    /// with (almost) no noise, a change below this share of its level is not a
    /// jump (rounding would otherwise be one).
    pub relative_noise_floor: f64,
}

impl Default for JumpConfig {
    fn default() -> Self {
        JumpConfig {
            window: 30,
            min_side: 5,
            false_alarm_rate: 1e-4,
            spike_z: 6.0,
            relative_noise_floor: 1e-3,
        }
    }
}

/// Which way a jump went.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    Up,
    Down,
}

impl std::fmt::Display for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Direction::Up => "up",
            Direction::Down => "down",
        })
    }
}

/// One detected jump.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Jump {
    /// The first step at the new level.
    pub step: u64,
    /// The last step at the old level.
    pub previous_step: u64,
    pub direction: Direction,
    /// |D| / σ̂: the jump in units of the noise.
    pub size: f64,
    /// D, in the series' own units (signed).
    pub delta: f64,
    /// The local fits' values at the boundary: before and after the jump.
    pub before: f64,
    pub after: f64,
    /// The test statistic (signed).
    pub z: f64,
    /// See the module documentation: 0–1, conservative.
    pub confidence: f64,
}

/// What [`detect`] found, with the numbers needed to judge it.
#[derive(Clone, Debug, Serialize)]
pub struct Detection {
    pub jumps: Vec<Jump>,
    /// σ̂, in the series' units: the noise of one point.
    pub noise: f64,
    /// φ̂: the noise's estimated lag-1 autocorrelation (0 when independent or
    /// negative), which widens the test.
    pub correlation: f64,
    /// c: the |z| a boundary needs to be a jump.
    pub threshold_z: f64,
    /// Points in the series.
    pub points: usize,
    /// Points replaced by the spike filter.
    pub spikes: usize,
}

/// A series the detector cannot read. Indices count points from 0.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SeriesError {
    #[error("step {step} appears twice (points {first} and {second}); give one value per step")]
    DuplicateStep {
        step: u64,
        first: usize,
        second: usize,
    },
    #[error("step {step} (point {index}) comes after step {previous}; sort the series by step")]
    Unsorted {
        step: u64,
        previous: u64,
        index: usize,
    },
    #[error(
        "the value at step {step} (point {index}) is {value}; only finite values can be tested"
    )]
    NonFinite { step: u64, index: usize, value: f64 },
    #[error(
        "the value at step {step} (point {index}) is {value:e}; the test takes values up to {MAX_VALUE:e} in size (its sums of squares stay finite): rescale the series, e.g. to its log10"
    )]
    TooLarge { step: u64, index: usize, value: f64 },
}

/// The largest value in size a series may hold: its squares, and their sums over
/// any series that fits in memory, stay finite.
pub const MAX_VALUE: f64 = 1e150;

/// Checks that steps strictly increase and values are finite, at most
/// [`MAX_VALUE`] in size.
pub fn validate(points: &[(u64, f64)]) -> Result<(), SeriesError> {
    for (i, &(step, value)) in points.iter().enumerate() {
        if !value.is_finite() {
            return Err(SeriesError::NonFinite {
                step,
                index: i,
                value,
            });
        }
        if value.abs() > MAX_VALUE {
            return Err(SeriesError::TooLarge {
                step,
                index: i,
                value,
            });
        }
        if i > 0 {
            let previous = points[i - 1].0;
            if step == previous {
                return Err(SeriesError::DuplicateStep {
                    step,
                    first: i - 1,
                    second: i,
                });
            }
            if step < previous {
                return Err(SeriesError::Unsorted {
                    step,
                    previous,
                    index: i,
                });
            }
        }
    }
    Ok(())
}

/// Finds the jumps in `points` (sorted by step, one value per step, finite).
pub fn detect(points: &[(u64, f64)], config: &JumpConfig) -> Result<Detection, SeriesError> {
    validate(points)?;
    let n = points.len();
    let xs: Vec<f64> = points.iter().map(|p| p.0 as f64).collect();
    let raw: Vec<f64> = points.iter().map(|p| p.1).collect();
    let threshold_z = stats::two_sided_quantile(config.false_alarm_rate);
    let correlation = noise_correlation(&raw);
    let phi = correlation;
    // For AR(1) noise the pseudo-residuals see a variance of 1 + φ²/3 − 4φ/3
    // times the noise's, and a sum over a window the long-run variance,
    // (1 + φ) / (1 − φ) times it.
    let noise = noise_scale(&xs, &raw) / (1.0 + phi * phi / 3.0 - 4.0 * phi / 3.0).sqrt();
    let level = stats::median(&raw.iter().map(|v| v.abs()).collect::<Vec<_>>()).unwrap_or(0.0);
    let noise = noise.max(config.relative_noise_floor * level);
    let long_run = ((1.0 + phi) / (1.0 - phi)).sqrt();
    let (ys, spikes) = despike(&raw, noise, config.spike_z);
    let mut detection = Detection {
        jumps: Vec::new(),
        noise,
        correlation,
        threshold_z,
        points: n,
        spikes,
    };
    let min_side = config.min_side.max(2);
    if n < 2 * min_side || noise <= 0.0 {
        return Ok(detection);
    }
    let scan = Scan {
        xs: &xs,
        ys: &ys,
        noise,
        long_run,
        window: config.window.max(min_side),
        min_side,
    };
    // Boundaries k = 1..n (jump between k−1 and k); cps holds the chosen ones.
    let mut cps: Vec<usize> = Vec::new();
    let mut tests: Vec<Option<Test>> = (0..n).map(|k| scan.test(k, 0, n)).collect();
    loop {
        let best = tests
            .iter()
            .enumerate()
            .filter_map(|(k, t)| t.map(|t| (k, t)))
            .filter(|(k, _)| !cps.contains(k))
            .max_by(|a, b| a.1.z.abs().total_cmp(&b.1.z.abs()));
        let Some((k, t)) = best else { break };
        if t.z.abs() < threshold_z {
            break;
        }
        cps.push(k);
        cps.sort_unstable();
        let (lo, hi) = (k.saturating_sub(scan.window), (k + scan.window).min(n));
        for (j, slot) in tests.iter_mut().enumerate().take(hi).skip(lo) {
            if !cps.contains(&j) {
                let (a, b) = bounds(&cps, j, n);
                *slot = scan.test(j, a, b);
            }
        }
    }
    // Re-test each jump between its final neighbours; drop the weakest failing
    // one and repeat.
    loop {
        let retested: Vec<(usize, Option<Test>)> = cps
            .iter()
            .map(|&k| {
                let (a, b) = bounds(&cps, k, n);
                (k, scan.test(k, a, b))
            })
            .collect();
        let weakest = retested
            .iter()
            .min_by(|a, b| abs_z(a.1).total_cmp(&abs_z(b.1)));
        match weakest {
            Some(&(k, t)) if abs_z(t) < threshold_z => cps.retain(|&c| c != k),
            _ => {
                let boundaries = n.saturating_sub(1).max(1) as f64;
                detection.jumps = retested
                    .into_iter()
                    .filter_map(|(k, t)| t.map(|t| (k, t)))
                    .map(|(k, t)| Jump {
                        step: points[k].0,
                        previous_step: points[k - 1].0,
                        direction: if t.delta >= 0.0 {
                            Direction::Up
                        } else {
                            Direction::Down
                        },
                        size: t.delta.abs() / noise,
                        delta: t.delta,
                        before: t.before,
                        after: t.after,
                        z: t.z,
                        confidence: (boundaries * (-stats::two_sided_p(t.z)).ln_1p()).exp(),
                    })
                    .collect();
                return Ok(detection);
            }
        }
    }
}

fn abs_z(t: Option<Test>) -> f64 {
    t.map_or(0.0, |t| t.z.abs())
}

/// The segment boundary k lies in: after the previous jump, before the next.
fn bounds(cps: &[usize], k: usize, n: usize) -> (usize, usize) {
    let lo = cps.iter().copied().filter(|&c| c < k).max().unwrap_or(0);
    let hi = cps.iter().copied().filter(|&c| c > k).min().unwrap_or(n);
    (lo, hi)
}

#[derive(Clone, Copy, Debug)]
struct Test {
    z: f64,
    delta: f64,
    before: f64,
    after: f64,
}

struct Scan<'a> {
    xs: &'a [f64],
    ys: &'a [f64],
    noise: f64,
    long_run: f64,
    window: usize,
    min_side: usize,
}

impl Scan<'_> {
    /// The jump test at boundary k, with windows kept inside [lo, hi).
    fn test(&self, k: usize, lo: usize, hi: usize) -> Option<Test> {
        if k == 0 || k <= lo || k >= hi {
            return None;
        }
        let left = k.saturating_sub(self.window).max(lo)..k;
        let right = k..(k + self.window).min(hi);
        if left.len() < self.min_side || right.len() < self.min_side {
            return None;
        }
        let fit = |r: std::ops::Range<usize>| {
            let line = Line::fit(
                self.xs[r.clone()].iter().copied(),
                self.ys[r.clone()].iter().copied(),
            )?;
            Some((line, line.rss(&self.xs[r.clone()], &self.ys[r])))
        };
        let ((l, l_rss), (r, r_rss)) = (fit(left)?, fit(right)?);
        let at = 0.5 * (self.xs[k - 1] + self.xs[k]);
        let (before, after) = (l.at(at), r.at(at));
        // A window whose line does not fit (a kink or strong curvature inside it,
        // another jump) widens its own test: σ is the larger of σ̂ and the fits'
        // pooled residual scale.
        let local = ((l_rss + r_rss) / (l.len() + r.len() - 4.0).max(1.0)).sqrt();
        let sigma = self.noise.max(local) * self.long_run;
        let sd = sigma * (l.variance_factor_at(at) + r.variance_factor_at(at)).sqrt();
        let delta = after - before;
        Some(Test {
            z: delta / sd,
            delta,
            before,
            after,
        })
    }
}

/// σ̂ from the pseudo-residuals (module documentation, step 1). Falls back to
/// their mean absolute deviation when more than half are 0 (a quantised metric),
/// and to 1e-9 of the series' range for a series that is exactly piecewise
/// linear; 0 for a constant series (which has no jumps).
pub fn noise_scale(xs: &[f64], ys: &[f64]) -> f64 {
    let n = xs.len();
    if n < 3 {
        return 0.0;
    }
    let residuals: Vec<f64> = (1..n - 1)
        .map(|i| {
            let span = xs[i + 1] - xs[i - 1];
            let (a, b) = ((xs[i + 1] - xs[i]) / span, (xs[i] - xs[i - 1]) / span);
            (a * ys[i - 1] + b * ys[i + 1] - ys[i]) / (a * a + b * b + 1.0).sqrt()
        })
        .collect();
    // Round-off leaves residuals of ~1e-16 where the series is exactly linear;
    // anything below `negligible` counts as 0.
    let (lo, hi) = ys
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &y| {
            (lo.min(y), hi.max(y))
        });
    let negligible = 1e-9 * (hi - lo);
    if negligible <= 0.0 {
        return 0.0;
    }
    let mad = stats::mad(&residuals).unwrap_or(0.0);
    if mad > negligible {
        return mad;
    }
    let centre = stats::median(&residuals).unwrap_or(0.0);
    let mean_abs =
        residuals.iter().map(|r| (r - centre).abs()).sum::<f64>() / residuals.len() as f64;
    (mean_abs * (std::f64::consts::PI / 2.0).sqrt()).max(negligible)
}

/// φ̂, the lag-1 autocorrelation of the noise, from its first differences: for
/// AR(1) noise their lag-1 correlation is −(1 − φ)/2, whatever a linear trend
/// (the median difference is removed). Differences beyond 4 MADs (jumps, spikes)
/// are clipped. The estimate is lowered by 1.645 of its standard errors and
/// clamped to 0–0.9: anticorrelated noise is treated as independent, which keeps
/// the test conservative.
pub fn noise_correlation(ys: &[f64]) -> f64 {
    if ys.len() < 10 {
        return 0.0;
    }
    let d: Vec<f64> = ys.windows(2).map(|w| w[1] - w[0]).collect();
    let (Some(m), Some(s)) = (stats::median(&d), stats::mad(&d)) else {
        return 0.0;
    };
    if s <= 0.0 {
        return 0.0;
    }
    let u: Vec<f64> = d.iter().map(|v| (v - m).clamp(-4.0 * s, 4.0 * s)).collect();
    let (num, den) = u
        .windows(2)
        .fold((0.0, 0.0), |(n, d), w| (n + w[0] * w[1], d + w[1] * w[1]));
    if den <= 0.0 {
        return 0.0;
    }
    // Under independent noise the estimate's standard error is √(2/n) (Bartlett);
    // only the part above 1.645 standard errors counts, so independent noise is
    // taken as such 95 % of the time and the test keeps its power.
    let se = (2.0 / d.len() as f64).sqrt();
    (1.0 + 2.0 * num / den - 1.645 * se).clamp(0.0, 0.9)
}

/// The Hampel filter of step 2: returns the filtered series and how many points
/// it replaced.
fn despike(ys: &[f64], noise: f64, spike_z: f64) -> (Vec<f64>, usize) {
    const HALF: usize = 3;
    let n = ys.len();
    let mut out = ys.to_vec();
    let mut replaced = 0;
    if noise <= 0.0 || n < 2 * HALF + 1 {
        return (out, 0);
    }
    for i in 0..n {
        let (a, b) = (i.saturating_sub(HALF), (i + HALF + 1).min(n));
        let med = stats::median(&ys[a..b]).unwrap_or(ys[i]);
        if (ys[i] - med).abs() > spike_z * noise {
            out[i] = med;
            replaced += 1;
        }
    }
    (out, replaced)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(values: &[f64]) -> Vec<(u64, f64)> {
        values
            .iter()
            .enumerate()
            .map(|(i, &v)| (i as u64, v))
            .collect()
    }

    #[test]
    fn rejects_bad_series() {
        assert_eq!(
            detect(&[(1, 0.0), (1, 1.0)], &JumpConfig::default()).unwrap_err(),
            SeriesError::DuplicateStep {
                step: 1,
                first: 0,
                second: 1
            }
        );
        assert!(matches!(
            detect(&[(2, 0.0), (1, 1.0)], &JumpConfig::default()),
            Err(SeriesError::Unsorted { index: 1, .. })
        ));
        assert!(matches!(
            detect(&[(1, f64::NAN)], &JumpConfig::default()),
            Err(SeriesError::NonFinite { index: 0, .. })
        ));
        // Values whose differences overflow (they made a clamp panic).
        let huge: Vec<f64> = (0..100)
            .map(|i| if i % 2 == 0 { 1e308 } else { -1e308 })
            .collect();
        assert!(matches!(
            detect(&series(&huge), &JumpConfig::default()),
            Err(SeriesError::TooLarge { index: 0, .. })
        ));
        let widest: Vec<f64> = (0..2000)
            .map(|i| if i % 3 == 0 { MAX_VALUE } else { -MAX_VALUE })
            .collect();
        assert!(detect(&series(&widest), &JumpConfig::default()).is_ok());
    }

    #[test]
    fn short_and_constant_series_have_no_jumps() {
        for n in 0..12 {
            let d = detect(&series(&vec![1.0; n]), &JumpConfig::default()).unwrap();
            assert!(d.jumps.is_empty(), "n = {n}");
        }
    }

    #[test]
    fn a_noiseless_step_is_found_exactly() {
        let mut v = vec![1.0; 40];
        v.extend(vec![3.0; 40]);
        let d = detect(&series(&v), &JumpConfig::default()).unwrap();
        assert_eq!(d.jumps.len(), 1, "{d:?}");
        let j = &d.jumps[0];
        assert_eq!(
            (j.step, j.previous_step, j.direction),
            (40, 39, Direction::Up)
        );
        assert!((j.delta - 2.0).abs() < 1e-9);
        assert!(j.confidence > 0.999);
    }

    #[test]
    fn a_kink_and_a_spike_are_not_jumps() {
        use rand::SeedableRng;
        // 20 series of 200 points: at the design rate of 1e-4 per point, noise alone
        // gives 0.4 false jumps in all; a kink or a spike that registered would give
        // one per series.
        let mut found = Vec::new();
        for seed in 0..20 {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
            // Flat, then a slope of 0.01 per step (0.1σ; NDT's drift is 0.083σ),
            // with one spike of 500σ.
            let mut v: Vec<f64> = (0..200)
                .map(|i| {
                    let trend = if i < 100 {
                        0.0
                    } else {
                        0.01 * (i - 100) as f64
                    };
                    trend + 0.1 * crate::analysis::validity::normal(&mut rng)
                })
                .collect();
            v[150] += 50.0;
            let d = detect(&series(&v), &JumpConfig::default()).unwrap();
            found.extend(d.jumps);
            assert_eq!(d.spikes, 1);
        }
        assert!(found.len() <= 2, "{found:#?}");
    }

    #[test]
    fn uneven_steps_report_the_steps() {
        // Sampled every 10 steps: the jump is at the first sampled step of the new level.
        let points: Vec<(u64, f64)> = (0..100)
            .map(|i| {
                let wiggle = 0.1 * ((i * 31 % 7) as f64 - 3.0) / 3.0;
                (
                    10 * i as u64 + 3,
                    if i < 60 { wiggle } else { 5.0 + wiggle },
                )
            })
            .collect();
        let d = detect(&points, &JumpConfig::default()).unwrap();
        assert_eq!(d.jumps.len(), 1, "{d:?}");
        assert_eq!((d.jumps[0].step, d.jumps[0].previous_step), (603, 593));
    }
}
