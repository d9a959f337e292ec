//! λ₁ of the sketch: its second estimate (the top of a pencil) and its upper bound, from
//! one depth of the Krylov space (`docs/metrics.md`, "Sketch mode"). `stable_rank` is
//! Σλ / λ₁, so its error estimate is this bound over the estimate.

use faer::{Mat, MatRef};

use super::SKETCH_BLOCK;
use super::dense::{eigvalsh, mul, solve_spd};

/// Ritz values below this fraction of the largest are left out of the second estimate of
/// λ₁, whose projected matrix divides by them.
const SKETCH_PENCIL_FLOOR: f64 = 1e-6;
/// The lower [`SKETCH_FAILURE`](super::SKETCH_FAILURE) quantile of χ² with [`SKETCH_BLOCK`]
/// degrees of freedom: with that probability ‖Q₀ᵀu‖² · r falls below it for a fixed unit
/// vector u and the start block Q₀ (the regularized lower incomplete gamma P(8, x/2) = 10⁻⁶ at x = 1.4507).
const CHI2_BLOCK_QUANTILE: f64 = 1.4507;
/// The float32 products' rounding, relative to λ₁, allowed for in the residuals that
/// bound λ₁ (measured: about 10⁻⁶ at 2,048 × 4,096).
const SKETCH_ROUNDING: f64 = 1e-5;

/// An upper bound on λ₁ (units of Σλ) that holds except with probability
/// [`SKETCH_FAILURE`](super::SKETCH_FAILURE) over the start block. For an eigenpair
/// (x, u) of G, with GK = KT + R·E_qᵀ + R_off (R = V'·C the last block's residual, R_off the other blocks'
/// round-off) and y = Kᵀu, w = V'ᵀu: y = (x − T)⁻¹(E_q·Cᵀw + R_offᵀu), ‖y‖² + ‖w‖² ≤ 1,
/// and the start block's share of u is ‖E₀ᵀy‖². The largest share any unit u allows at
/// x falls fast as x moves above the Ritz values; λ₁'s eigenvector has at least
/// [`CHI2_BLOCK_QUANTILE`]/r of it (except with that probability), so the largest x
/// allowing that much bounds λ₁. `residual_gram` is RᵀR and `off` is ‖R_off‖_F, both
/// measured ([`super::Depth`]).
pub(super) fn lambda_bound(
    r: usize,
    theta: &[f64],
    vectors: MatRef<'_, f64>,
    residual_gram: MatRef<'_, f64>,
    off: f64,
    top: f64,
) -> f64 {
    let r = r as f64;
    let b = SKETCH_BLOCK;
    let k = theta.len();
    if top >= 1.0 {
        return 1.0;
    }
    // ‖Q₀ᵀu‖² = X / (X + Y) with X ~ χ²_b and Y ~ χ²_{r−b}; Y ≤ r + 9√r + 40 except with
    // probability below 10⁻⁹ (Laurent and Massart), so X below the quantile is the
    // only way under this share.
    let least = CHI2_BLOCK_QUANTILE / (r + 9.0 * r.sqrt() + 40.0 + CHI2_BLOCK_QUANTILE);
    // The float32 products' round-off (an operator-norm allowance, on top of R_off).
    let rounding = SKETCH_ROUNDING * top;
    let start = vectors.subrows(0, b);
    let last = vectors.subrows(k - b, b);
    // C with CᵀC = RᵀR + rounding²·I (a larger C only widens the set of u considered).
    let off = off + rounding;
    let regularized = Mat::from_fn(b, b, |i, j| {
        residual_gram[(i, j)] + if i == j { rounding * rounding } else { 0.0 }
    });
    let Ok(cholesky) = regularized.llt(faer::Side::Lower) else {
        return 1.0;
    };
    // Yᵀ·E_q·Cᵀ (k × b): the last block's residual in the Ritz basis.
    let coupling = mul(last.transpose(), cholesky.L());
    let largest = theta.last().copied().unwrap_or(0.0);
    let share = |x: f64| -> f64 {
        // How much the round-off can move y, against the scale of x − T.
        let slack = off / (x - largest);
        if slack >= 0.5 {
            return f64::INFINITY;
        }
        let inverse: Vec<f64> = theta.iter().map(|t| 1.0 / (x - t)).collect();
        let start_scaled = Mat::from_fn(b, k, |i, j| start[(i, j)] * inverse[j]);
        let first = mul(start_scaled.as_ref(), coupling.as_ref());
        let scaled = Mat::from_fn(k, b, |i, j| coupling[(i, j)] * inverse[i]);
        let mut constraint = mul(scaled.transpose(), scaled.as_ref());
        for i in 0..b {
            for j in 0..b {
                constraint[(i, j)] *= 1.0 - slack;
            }
            constraint[(i, i)] += 1.0;
        }
        let Some(solved) = solve_spd(constraint.as_ref(), first.transpose()) else {
            return f64::INFINITY;
        };
        let reach = max_eigenvalue(mul(first.as_ref(), solved.as_ref()).as_ref());
        let spill = max_eigenvalue(mul(start_scaled.as_ref(), start_scaled.transpose()).as_ref())
            .sqrt()
            * off;
        (((1.0 + slack) * reach).max(0.0).sqrt() + spill).powi(2)
    };
    // x = top·(1 + eᵘ), u from ln 10⁻⁹ to where x = 1 (λ₁ ≤ Σλ): a coarse scan down
    // from the top, then bisection where the share crosses `least`.
    let (low, high) = (1e-9f64.ln(), (1.0 / top - 1.0).max(1e-9).ln());
    let at = |u: f64| top * (1.0 + u.exp());
    if share(at(high).min(1.0)) >= least {
        return 1.0;
    }
    const SCAN: usize = 24;
    let grid: Vec<f64> = (0..=SCAN)
        .map(|i| high - (high - low) * i as f64 / SCAN as f64)
        .collect();
    let mut above = None;
    for pair in grid.windows(2) {
        if share(at(pair[1])) >= least {
            above = Some((pair[1], pair[0]));
            break;
        }
    }
    let Some((mut lo, mut hi)) = above else {
        return at(low);
    };
    for _ in 0..14 {
        let mid = 0.5 * (lo + hi);
        if share(at(mid)) >= least {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    at(hi).min(1.0)
}

/// The pencil's top eigenvalue (Kᵀ·G²·K, Kᵀ·G·K), on the Ritz directions T can divide by:
/// the Rayleigh quotient of AᵀA on the space Aᵀ·K, one degree higher in G for free.
pub(super) fn pencil_top(theta: &[f64], vectors: MatRef<'_, f64>, squares: MatRef<'_, f64>) -> f64 {
    let k = theta.len();
    let largest = theta.last().copied().unwrap_or(0.0);
    let skip = theta
        .iter()
        .take_while(|&&t| t <= SKETCH_PENCIL_FLOOR * largest)
        .count();
    if largest <= 0.0 || skip >= k {
        return 0.0;
    }
    let scaled = Mat::from_fn(k, k - skip, |i, j| {
        vectors[(i, skip + j)] / theta[skip + j].sqrt()
    });
    let pencil = mul(mul(scaled.transpose(), squares).as_ref(), scaled.as_ref());
    eigvalsh(pencil.as_ref())
        .and_then(|values| values.last().copied())
        .unwrap_or(f64::NAN)
}

/// The largest eigenvalue of a small symmetric matrix (infinite where the solver fails).
fn max_eigenvalue(m: MatRef<'_, f64>) -> f64 {
    eigvalsh(m)
        .and_then(|values| values.last().copied())
        .unwrap_or(f64::INFINITY)
}
