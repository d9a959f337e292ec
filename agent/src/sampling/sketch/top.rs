//! λ₁ of the sketch: its second estimate (the top of a pencil) and its upper bound, from
//! one depth of the Krylov space (`docs/metrics.md`, "Sketch mode"). `stable_rank` is
//! Σλ / λ₁, so its error estimate is this bound over the estimate.

use tch::{Kind, TchError, Tensor};

use super::{Krylov, SKETCH_BLOCK};
use crate::sampling::spectral::to_host;

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

impl Krylov {
    /// An upper bound on λ₁ (units of Σλ) that holds except with probability
    /// [`SKETCH_FAILURE`](super::SKETCH_FAILURE) over the start block. For an eigenpair
    /// (x, u) of G, with GK = KT + R·E_qᵀ + R_off (R = V'·C the last block's residual, R_off the other blocks'
    /// round-off) and y = Kᵀu, w = V'ᵀu: y = (x − T)⁻¹(E_q·Cᵀw + R_offᵀu), ‖y‖² + ‖w‖² ≤ 1,
    /// and the start block's share of u is ‖E₀ᵀy‖². The largest share any unit u allows at
    /// x falls fast as x moves above the Ritz values; λ₁'s eigenvector has at least
    /// [`CHI2_BLOCK_QUANTILE`]/r of it (except with that probability), so the largest x
    /// allowing that much bounds λ₁. `residual_gram` is RᵀR.
    pub(super) fn lambda_bound(
        &self,
        g_basis: &Tensor,
        theta: &Tensor,
        theta_host: &[f64],
        vectors: &Tensor,
        residual_gram: &Tensor,
        top: f64,
    ) -> Result<f64, TchError> {
        let r = self.r as f64;
        let b = SKETCH_BLOCK;
        let k = theta.size()[0];
        let options = (Kind::Double, theta.device());
        if top >= 1.0 {
            return Ok(1.0);
        }
        // ‖Q₀ᵀu‖² = X / (X + Y) with X ~ χ²_b and Y ~ χ²_{r−b}; Y ≤ r + 9√r + 40 except with
        // probability below 10⁻⁹ (Laurent and Massart), so X below the quantile is the
        // only way under this share.
        let least = CHI2_BLOCK_QUANTILE / (r + 9.0 * r.sqrt() + 40.0 + CHI2_BLOCK_QUANTILE);
        // The float32 products' round-off (an operator-norm allowance, on top of R_off).
        let rounding = SKETCH_ROUNDING * top;
        let start = vectors.f_narrow(0, 0, b)?;
        let last = vectors.f_narrow(0, k - b, b)?;
        // R_off = GK − KT − R·E_qᵀ, measured; and C with CᵀC = RᵀR + rounding²·I (a larger
        // C only widens the set of u considered).
        let mut off_blocks = g_basis.f_sub(
            &self
                .basis
                .f_matmul(&self.projected.f_to_kind(Kind::Float)?)?,
        )?;
        let _ = off_blocks.f_narrow(1, k - b, b)?.f_sub_(&self.residual)?;
        off_blocks = off_blocks.f_to_kind(Kind::Double)?;
        let off = off_blocks
            .f_square()?
            .f_sum(Kind::Double)?
            .double_value(&[])
            .sqrt()
            + rounding;
        let eye = Tensor::f_eye(b, options)?;
        let lower = residual_gram
            .f_add(&eye.f_mul_scalar(rounding * rounding)?)?
            .f_linalg_cholesky(false)?;
        // Yᵀ·E_q·Cᵀ (k × b): the last block's residual in the Ritz basis.
        let coupling = last.f_tr()?.f_matmul(&lower)?;
        let largest = theta_host.last().copied().unwrap_or(0.0);
        let share = |x: f64| -> Result<f64, TchError> {
            // How much the round-off can move y, against the scale of x − T.
            let slack = off / (x - largest);
            if slack >= 0.5 {
                return Ok(f64::INFINITY);
            }
            let inverse = theta.f_neg()?.f_add_scalar(x)?.f_reciprocal()?;
            let first = start.f_mul(&inverse)?.f_matmul(&coupling)?;
            let scaled = coupling.f_mul(&inverse.f_unsqueeze(1)?)?;
            let constraint = eye.f_add(
                &scaled
                    .f_tr()?
                    .f_matmul(&scaled)?
                    .f_mul_scalar(1.0 - slack)?,
            )?;
            let reach =
                first.f_matmul(&Tensor::f_linalg_solve(&constraint, &first.f_tr()?, true)?)?;
            let reach = max_eigenvalue(&reach)?;
            let start_scaled = start.f_mul(&inverse)?;
            let spill =
                max_eigenvalue(&start_scaled.f_matmul(&start_scaled.f_tr()?)?)?.sqrt() * off;
            Ok((((1.0 + slack) * reach).max(0.0).sqrt() + spill).powi(2))
        };
        // x = top·(1 + eᵘ), u from ln 10⁻⁹ to where x = 1 (λ₁ ≤ Σλ): a coarse scan down
        // from the top, then bisection where the share crosses `least`.
        let (low, high) = (1e-9f64.ln(), (1.0 / top - 1.0).max(1e-9).ln());
        let at = |u: f64| top * (1.0 + u.exp());
        if share(at(high).min(1.0))? >= least {
            return Ok(1.0);
        }
        const SCAN: usize = 24;
        let grid: Vec<f64> = (0..=SCAN)
            .map(|i| high - (high - low) * i as f64 / SCAN as f64)
            .collect();
        let mut above = None;
        for pair in grid.windows(2) {
            if share(at(pair[1]))? >= least {
                above = Some((pair[1], pair[0]));
                break;
            }
        }
        let Some((mut lo, mut hi)) = above else {
            return Ok(at(low));
        };
        for _ in 0..14 {
            let mid = 0.5 * (lo + hi);
            if share(at(mid))? >= least {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Ok(at(hi).min(1.0))
    }
}

/// The pencil's top eigenvalue (Kᵀ·G²·K, Kᵀ·G·K), on the Ritz directions T can divide by:
/// the Rayleigh quotient of AᵀA on the space Aᵀ·K, one degree higher in G for free.
pub(super) fn pencil_top(
    theta: &Tensor,
    theta_host: &[f64],
    vectors: &Tensor,
    squares: &Tensor,
) -> Result<f64, TchError> {
    let k = theta_host.len() as i64;
    let largest = theta_host.last().copied().unwrap_or(0.0);
    let skip = theta_host
        .iter()
        .take_while(|&&t| t <= SKETCH_PENCIL_FLOOR * largest)
        .count() as i64;
    if largest <= 0.0 || skip >= k {
        return Ok(0.0);
    }
    let scaled = vectors
        .f_narrow(1, skip, k - skip)?
        .f_div(&theta.f_narrow(0, skip, k - skip)?.f_sqrt()?)?;
    let pencil = scaled.f_tr()?.f_matmul(squares)?.f_matmul(&scaled)?;
    Ok(to_host(&pencil.f_linalg_eigvalsh("L")?)?
        .last()
        .copied()
        .unwrap_or(0.0))
}

/// The largest eigenvalue of a small symmetric matrix.
fn max_eigenvalue(m: &Tensor) -> Result<f64, TchError> {
    Ok(to_host(&m.f_linalg_eigvalsh("L")?)?
        .last()
        .copied()
        .unwrap_or(f64::INFINITY))
}
