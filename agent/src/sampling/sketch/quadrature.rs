//! The block Gauss and Gauss–Radau quadrature of the sketch: `effective_rank`,
//! `participation_ratio_sv`, `nuclear_norm_ratio` and `cum_energy_90` from one depth's
//! Ritz pairs, each with its error estimate (`docs/metrics.md`, "Sketch mode").

use faer::{Mat, MatRef, Side};

use super::dense::{eigh, mul, squared_rows};
use super::{SKETCH_BLOCK, SKETCH_EXHAUSTED, SKETCH_Z, mean};
use crate::sampling::spectral::CUM_ENERGY_REL_TOL;

/// The block quadrature over the Ritz pairs (and the Radau rule's nodes) of one depth,
/// in units of μ = λ / θ̂, per probe.
pub(super) struct Quadrature {
    r: usize,
    top: f64,
    /// Σλ / θ̂.
    sum_mu: f64,
    /// μ of the Ritz values, and whether each pair converged.
    mu: Vec<f64>,
    converged: Vec<bool>,
    /// Per probe (b rows) and Ritz pair: ‖(yⱼ)₀ᵢ‖², row-major.
    first_block: Vec<f64>,
    /// Σ over the converged pairs of (√μ, √μ·ln √μ), each counted once.
    converged_part: [f64; 2],
    /// The energy outside the converged pairs (units of θ̂), exactly.
    energy_outside: f64,
    /// Per probe: r × (Σ√μ, Σ√μ·ln √μ, Σμ) over the unconverged nodes, Gauss and Radau.
    gauss: Vec<[f64; 3]>,
    radau: Option<Vec<[f64; 3]>>,
}

/// (√μ, √μ·ln √μ, μ).
fn moments(mu: f64) -> [f64; 3] {
    let mu = mu.max(0.0);
    if mu == 0.0 {
        return [0.0; 3];
    }
    let s = mu.sqrt();
    [s, 0.5 * s * mu.ln(), mu]
}

impl Quadrature {
    pub(super) fn new(
        r: usize,
        top: f64,
        theta: &[f64],
        converged: &[bool],
        first_block: &[f64],
        radau: Option<&RadauRule>,
    ) -> Quadrature {
        let b = SKETCH_BLOCK;
        let k = theta.len();
        let mu: Vec<f64> = theta.iter().map(|&t| (t.max(0.0) / top).min(1.0)).collect();
        let mut converged_part = [0.0; 2];
        let mut converged_energy = 0.0;
        for (j, &m) in mu.iter().enumerate() {
            if converged[j] {
                let f = moments(m);
                converged_part[0] += f[0];
                converged_part[1] += f[1];
                converged_energy += theta[j].max(0.0);
            }
        }
        let scale = r as f64;
        let gauss: Vec<[f64; 3]> = (0..b)
            .map(|i| {
                let mut acc = [0.0; 3];
                for j in (0..k).filter(|&j| !converged[j]) {
                    let (w, f) = (scale * first_block[i * k + j], moments(mu[j]));
                    for c in 0..3 {
                        acc[c] += w * f[c];
                    }
                }
                acc
            })
            .collect();
        let radau = radau.map(|(nodes, vectors)| {
            let kb = nodes.len();
            (0..b)
                .map(|i| {
                    let mut acc = [0.0; 3];
                    for (l, &node) in nodes.iter().enumerate() {
                        let (w, f) = (scale * vectors[i * kb + l], moments(node.max(0.0) / top));
                        for c in 0..3 {
                            acc[c] += w * f[c];
                        }
                    }
                    // The converged pairs are nodes of the bordered matrix too; they count
                    // once, in `converged_part`.
                    for j in (0..k).filter(|&j| converged[j]) {
                        let (w, f) = (scale * first_block[i * k + j], moments(mu[j]));
                        for c in 0..3 {
                            acc[c] -= w * f[c];
                        }
                    }
                    acc
                })
                .collect()
        });
        Quadrature {
            r,
            top,
            sum_mu: 1.0 / top,
            mu,
            converged: converged.to_vec(),
            first_block: first_block.to_vec(),
            converged_part,
            energy_outside: (1.0 - converged_energy).max(0.0) / top,
            gauss,
            radau,
        }
    }

    /// Whether the converged pairs hold (nearly) all of Σλ: the quadrature is exact then.
    fn exhausted(&self) -> bool {
        self.energy_outside * self.top <= SKETCH_EXHAUSTED
    }

    /// (Σ√μ, Σ√μ·ln √μ) from one rule's per-probe sums, leaving out probe `skip`: the mean
    /// over the probes, corrected by the control variate Σμ, whose exact value is the
    /// energy outside the converged pairs.
    fn sums(&self, rule: &[[f64; 3]], skip: Option<usize>) -> [f64; 2] {
        let rows: Vec<&[f64; 3]> = rule
            .iter()
            .enumerate()
            .filter(|&(i, _)| Some(i) != skip)
            .map(|(_, row)| row)
            .collect();
        let count = rows.len() as f64;
        let mean_of = |c: usize| rows.iter().map(|row| row[c]).sum::<f64>() / count;
        let mean_c = mean_of(2);
        let var_c = rows
            .iter()
            .map(|row| (row[2] - mean_c).powi(2))
            .sum::<f64>();
        let mut out = [0.0; 2];
        for (c, slot) in out.iter_mut().enumerate() {
            let mean_v = mean_of(c);
            let beta = if var_c > 0.0 && !self.exhausted() {
                rows.iter()
                    .map(|row| (row[c] - mean_v) * (row[2] - mean_c))
                    .sum::<f64>()
                    / var_c
            } else {
                0.0
            };
            *slot = self.converged_part[c] + mean_v - beta * (mean_c - self.energy_outside);
        }
        out
    }

    /// (effective_rank, participation_ratio_sv, nuclear_norm_ratio) from (Σ√μ, Σ√μ ln √μ),
    /// clamped to what the exact values satisfy.
    fn columns(&self, [sum_s, sum_s_ln_s]: [f64; 2]) -> [f64; 3] {
        let r = self.r as f64;
        let sum_s = sum_s.clamp(1.0, (r * self.sum_mu).sqrt());
        let effective = (sum_s.ln() - sum_s_ln_s / sum_s).exp().clamp(1.0, r);
        [
            effective,
            (sum_s * sum_s / self.sum_mu).clamp(1.0, r),
            sum_s,
        ]
    }

    /// Each of the three σ-based columns with its error estimate: the geometric middle of
    /// the Gauss and Radau values, half their spread (as a ratio), and [`SKETCH_Z`]
    /// jackknife standard errors over the probes.
    pub(super) fn values(&self) -> [(f64, f64); 3] {
        let b = self.gauss.len();
        let rules: Vec<&Vec<[f64; 3]>> = match &self.radau {
            Some(radau) => vec![&self.gauss, radau],
            None => vec![&self.gauss],
        };
        let middle = |skip: Option<usize>| -> ([f64; 3], [f64; 3]) {
            let cols: Vec<[f64; 3]> = rules
                .iter()
                .map(|rule| self.columns(self.sums(rule, skip)))
                .collect();
            let mut mid = [0.0; 3];
            let mut spread = [0.0; 3];
            for c in 0..3 {
                let (lo, hi) = cols
                    .iter()
                    .map(|v| v[c])
                    .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
                        (lo.min(v), hi.max(v))
                    });
                mid[c] = (lo * hi).sqrt();
                spread[c] = (hi / lo).sqrt() - 1.0;
            }
            (mid, spread)
        };
        let (mid, spread) = middle(None);
        let leave_out: Vec<[f64; 3]> = (0..b).map(|i| middle(Some(i)).0).collect();
        // Without the Radau rule the Gauss rule is exact only where the space holds the
        // whole spectrum.
        let unbracketed = self.radau.is_none() && !self.exhausted();
        let mut out = [(0.0, 0.0); 3];
        for c in 0..3 {
            let m = leave_out.iter().map(|v| v[c]).sum::<f64>() / b as f64;
            let se = ((b as f64 - 1.0) / b as f64
                * leave_out.iter().map(|v| (v[c] - m).powi(2)).sum::<f64>())
            .sqrt();
            let err = if unbracketed {
                f64::INFINITY
            } else {
                spread[c] + SKETCH_Z * se / mid[c]
            };
            out[c] = (mid[c], err);
        }
        out
    }

    /// `cum_energy_90` and its error estimate: the Gauss nodes, largest first, counted
    /// (with their weights) until they hold 0.9·Σλ. Exact (error 0) where the count ends
    /// at a converged pair with only converged pairs before it; otherwise the node where
    /// it ends is counted in proportion to the energy still needed, and the error is that
    /// node's weight, [`SKETCH_Z`] jackknife standard errors, and half a count (rounding).
    pub(super) fn count90(&self) -> (u32, f64) {
        let b = SKETCH_BLOCK;
        let k = self.mu.len();
        let mut order: Vec<usize> = (0..k).collect();
        order.sort_unstable_by(|&i, &j| self.mu[j].total_cmp(&self.mu[i]));
        let count = |skip: Option<usize>| -> (f64, f64, bool) {
            let probes = if skip.is_some() { b - 1 } else { b };
            let weight = |j: usize| {
                if self.converged[j] {
                    1.0
                } else {
                    let s: f64 = (0..b)
                        .filter(|&i| Some(i) != skip)
                        .map(|i| self.first_block[i * k + j])
                        .sum();
                    self.r as f64 * s / probes as f64
                }
            };
            let target = 0.9 * self.sum_mu * (1.0 - CUM_ENERGY_REL_TOL);
            let (mut energy, mut counted, mut exact) = (0.0, 0.0, true);
            for &j in &order {
                let w = weight(j);
                let e = w * self.mu[j];
                exact &= self.converged[j];
                if energy + e >= target {
                    if exact {
                        return (counted + 1.0, 0.0, true);
                    }
                    let part = if e > 0.0 {
                        ((target - energy) / e).clamp(0.0, 1.0)
                    } else {
                        1.0
                    };
                    return (counted + part * w, w, false);
                }
                energy += e;
                counted += w;
            }
            (counted, 0.0, false)
        };
        let (estimate, crossing, exact) = count(None);
        let value = estimate.round().clamp(1.0, self.r as f64);
        if exact {
            return (value as u32, 0.0);
        }
        let leave_out: Vec<f64> = (0..b).map(|i| count(Some(i)).0).collect();
        let m = mean(&leave_out);
        let se = ((b as f64 - 1.0) / b as f64
            * leave_out.iter().map(|v| (v - m).powi(2)).sum::<f64>())
        .sqrt();
        (value as u32, (crossing + SKETCH_Z * se + 0.5) / value)
    }
}

/// The Gauss–Radau rule with a node at 0: T bordered by C (the last residual
/// R = V'·C, CᵀC = RᵀR = L·Lᵀ, C = Lᵀ) and the diagonal block C·(Eᵀ·T⁻¹·E)·Cᵀ (E picks
/// the last block), which makes 0 an eigenvalue. Its nodes and the start block's
/// squared components of their vectors (b × (k + b), row-major); `None` where the
/// residual vanishes (the space holds the whole spectrum). `projected` is T and
/// `residual_gram` RᵀR.
pub(super) fn radau(
    projected: MatRef<'_, f64>,
    residual_gram: MatRef<'_, f64>,
    theta: &[f64],
    vectors: MatRef<'_, f64>,
) -> Option<RadauRule> {
    let b = SKETCH_BLOCK;
    let k = theta.len();
    let largest = theta[k - 1];
    if largest <= 0.0 {
        return None;
    }
    let lower = residual_gram.llt(Side::Lower).ok()?.L().to_owned();
    let last = vectors.subrows(k - b, b);
    // Eᵀ·T⁺·E: Ritz values at round-off level are G's null directions inside K (a
    // rank below the space's size), already nodes at 0; their Ritz vectors have no
    // last-block component (G·K·y = 0 leaves no residual), so they drop out.
    let inverse_theta: Vec<f64> = theta
        .iter()
        .map(|&t| if t <= 1e-12 * largest { 0.0 } else { 1.0 / t })
        .collect();
    let weighted = Mat::from_fn(b, k, |i, j| last[(i, j)] * inverse_theta[j]);
    let inverse = mul(weighted.as_ref(), last.transpose());
    let corner = mul(
        mul(lower.transpose(), inverse.as_ref()).as_ref(),
        lower.as_ref(),
    );
    let mut bordered = Mat::zeros(k + b, k + b);
    bordered
        .as_mut()
        .submatrix_mut(0, 0, k, k)
        .copy_from(projected);
    bordered
        .as_mut()
        .submatrix_mut(k - b, k, b, b)
        .copy_from(&lower);
    bordered
        .as_mut()
        .submatrix_mut(k, k - b, b, b)
        .copy_from(lower.transpose());
    bordered
        .as_mut()
        .submatrix_mut(k, k, b, b)
        .copy_from(&corner);
    let (nodes, radau_vectors) = eigh(bordered.as_ref())?;
    let first = squared_rows(radau_vectors.subrows(0, b));
    Some((nodes, first))
}

/// The Gauss–Radau rule's nodes, and per probe (b rows) the squared start-block components
/// of their vectors (row-major).
pub(super) type RadauRule = (Vec<f64>, Vec<f64>);
