//! The sketch: the six spectral columns of a large matrix from a randomized block Krylov
//! space, in float32 on the matrix's own device, instead of the exact float64 Gram and
//! eigen-solve. `docs/metrics.md` ("Sketch mode") states the method, the measured errors and
//! the bounds that this module's tests hold it to. [`super::measure`] chooses the method
//! ([`super::options::SpectrumOptions::method`]) and computes the health sums and the Σλ
//! that the sketch takes as given.

use tch::{Kind, TchError, Tensor};

use super::spectral::{CUM_ENERGY_REL_TOL, Spectral, SplitMix64, gaussian, to_host};

/// Below this many rows or columns the sketch would span most of the space, and the exact
/// path is cheap: `sketch` mode measures such a matrix exactly (and says so in `method`).
pub const SKETCH_MIN_SIDE: i64 = 512;
/// Gaussian start vectors of the block Krylov space (b). A product's CPU time grows less than
/// its width (one thread, 2,048 × 4,096: 15 ms for 16 columns, 21 ms for 32), and λ₁ needs
/// depth more than width, so the space is narrow and deep.
const SKETCH_BLOCK: i64 = 16;
/// Block Krylov steps after the first block (q): the space has b·(q + 1) = 112 vectors.
const SKETCH_STEPS: usize = 6;
/// Rademacher probes for the part of Σλ² outside the Krylov space (m). 16 left
/// `participation_ratio` up to 1.6 % off, too close to its 2 % bound.
const SKETCH_PROBES: i64 = 32;
/// A Ritz pair whose residual ‖G·v − θ·v‖ is at most this fraction of θ counts as an
/// eigenpair (weight 1 in the trace estimates).
const SKETCH_CONVERGED: f64 = 1e-3;
/// The Gauss–Radau rule's share in the estimates of Σσ and Σ σ ln σ (the Gauss rule has the
/// rest). For √λ the Gauss rule errs high and the Radau rule with a node at 0 errs low;
/// this share, measured on the spectra of `docs/metrics.md`, brings the steep power law's
/// `effective_rank` from 20 % to within 5 % at 2,048 × 4,096 without moving the others out.
const SKETCH_RADAU_SHARE: f64 = 0.3;
/// A new block is orthogonalized a second time when its smallest QR pivot is at most this
/// fraction of the product it came from (see [`sketch_spectral`]).
const SKETCH_REORTHOGONALIZE: f64 = 1e-2;
/// Ritz values below this fraction of the largest are left out of the second estimate of
/// λ₁, whose projected matrix divides by them.
const SKETCH_PENCIL_FLOOR: f64 = 1e-6;

/// The six spectral columns of a float32 matrix `x` (n × d, finite, not empty) whose
/// squared Frobenius norm is `trace`, by a randomized block Krylov method, in float32 on
/// `x`'s device. With G the Gram matrix of the smaller side (r × r, r = min(n, d)),
/// applied as A·(Aᵀ·V) and never formed:
///
/// - Σλ = `trace` = ‖x‖²_F, computed exactly in float64 by the caller; the products are
///   divided by it (G / Σλ has eigenvalues summing to 1), so float32 neither overflows nor
///   underflows whatever the activations' scale.
/// - A block Krylov space K = span{Ω, GΩ, …, G^q Ω} from b Gaussian vectors Ω,
///   orthonormal (block Gram–Schmidt twice, then QR, and all of it again where the
///   projection removed most of a block), with Aᵀ·K and G·K kept from the
///   products that built it. Rayleigh–Ritz on K gives Ritz values θⱼ from
///   T = Kᵀ·G·K = (AᵀK)ᵀ(AᵀK), formed in float64.
/// - λ₁ is the larger of θ₁ and the top eigenvalue of the pencil (Kᵀ·G²·K, Kᵀ·G·K): the
///   Rayleigh quotient of AᵀA on the space Aᵀ·K, which reaches one degree higher in G for
///   free (G·K is known). Both are Rayleigh quotients, so λ₁ is never overestimated.
/// - Σλ² = ‖G·K‖²_F + ‖G·(I − P)·Z‖²_F / m: exact inside K, Hutchinson with m Rademacher
///   probes Z outside it (P projects on K); the products G·Z ride along with the first block.
/// - Σσ and Σ σ ln σ: block quadrature from the same space. The Gauss rule has nodes θⱼ and
///   weights (r / b)·‖Q₀ᵀ·vⱼ‖² (vⱼ the Ritz vector, Q₀ the first block; 1 on average, r
///   in all), except that a converged Ritz pair (residual ≤ 10⁻³·θ) counts once. The Gauss–Radau rule adds a node at 0: T
///   bordered by the block of the last product's residual, whose last diagonal block makes 0
///   an eigenvalue. For √λ the two rules bracket the probes' value; the estimate mixes them.
///
/// Costs 2(q + 1) passes over x (the first with b + m columns, the others with b) and
/// small dense algebra; its errors are measured in `docs/metrics.md`.
pub fn sketch_spectral(x: &Tensor, trace: f64, seed: u64) -> Result<Spectral, TchError> {
    let (n, d) = match x.size().as_slice() {
        &[n, d] => (n, d),
        _ => return Ok(Spectral::default()),
    };
    if trace == 0.0 {
        return Ok(Spectral::zero());
    }
    let device = x.device();
    let x = x.f_to_kind(Kind::Float)?;
    let r = n.min(d);
    // With a the r × c orientation of x (r ≤ c, so G = a·aᵀ is the smaller Gram matrix),
    // (aᵀ·v, G·v), both divided by ‖x‖_F: the sketch works on G / Σλ, whose eigenvalues sum
    // to 1, so that float32 neither overflows for large activations nor underflows for tiny
    // ones (every column is scale-free); the two scalings touch only the thin results.
    // aᵀ·v is kept for the Rayleigh quotients, whose rounding it makes quadratic (G's null
    // directions get Ritz values of order ε², not ε). x stays as it is stored, never copied,
    // and each product takes it in the layout the BLAS reads fastest: a transposed x as the
    // left factor cost about 16 % more CPU per product, on one thread at 2,048 × 4,096.
    let inverse_norm = 1.0 / trace.sqrt();
    let gram_times = |v: &Tensor| -> Result<(Tensor, Tensor), TchError> {
        if n <= d {
            // a = x: aᵀ·v = (vᵀ·x)ᵀ and G·v = (vᵀ·x·xᵀ)ᵀ.
            let half = v.f_tr()?.f_matmul(&x)?.f_mul_scalar(inverse_norm)?;
            let full = half.f_matmul(&x.f_tr()?)?.f_mul_scalar(inverse_norm)?;
            Ok((half.f_tr()?, full.f_tr()?))
        } else {
            // a = xᵀ: aᵀ·v = x·v and G·v = ((x·v)ᵀ·x)ᵀ.
            let half = x.f_matmul(v)?.f_mul_scalar(inverse_norm)?;
            let full = half.f_tr()?.f_matmul(&x)?.f_mul_scalar(inverse_norm)?;
            Ok((half, full.f_tr()?))
        }
    };
    let (b, m) = (SKETCH_BLOCK, SKETCH_PROBES);
    let mut rng = SplitMix64(seed ^ 0x5ce7_c4b0_0000_0001);
    let omega = Tensor::f_from_slice(&gaussian(&mut rng, (r * b) as usize))?
        .f_reshape([r, b])?
        .f_to_device(device)?;
    let probes: Vec<f32> = (0..r * m)
        .map(|_| if rng.next_u64() >> 63 == 0 { 1.0 } else { -1.0 })
        .collect();
    let z = Tensor::f_from_slice(&probes)?
        .f_reshape([r, m])?
        .f_to_device(device)?;

    let (q0, _) = Tensor::f_linalg_qr(&omega, "reduced")?;
    let (half, first) = gram_times(&Tensor::f_cat(&[&q0, &z], 1)?)?;
    let gz = first.f_narrow(1, b, m)?;
    let mut basis = q0;
    let mut halves = vec![half.f_narrow(1, 0, b)?];
    let mut products = vec![first.f_narrow(1, 0, b)?];
    // (I − P)·G·V for the last block V: the next block, and after the last step the
    // border of the Gauss–Radau rule.
    let mut residual = orthogonal_to(&products[0], &basis)?;
    for _ in 0..SKETCH_STEPS {
        let (next, upper) = Tensor::f_linalg_qr(&residual, "reduced")?;
        // The residual keeps round-off components along the basis of about ε·‖G·V‖, which
        // the QR scales up by ‖G·V‖ / |Rᵢᵢ|. Where the projection took most of the block
        // (the space nearly exhausted: rank below its size, or a steep spectrum) they
        // would not be small any more, so the block is orthogonalized once more.
        let scale = to_host(&Tensor::f_stack(
            &[
                upper.f_diagonal(0, 0, 1)?.f_abs()?.f_min()?,
                products.last().expect("one block at least").f_norm()?,
            ],
            0,
        )?)?;
        let next = if scale[0] > SKETCH_REORTHOGONALIZE * scale[1] {
            next
        } else {
            Tensor::f_linalg_qr(&orthogonal_to(&next, &basis)?, "reduced")?.0
        };
        let (half, full) = gram_times(&next)?;
        basis = Tensor::f_cat(&[&basis, &next], 1)?;
        residual = orthogonal_to(&full, &basis)?;
        halves.push(half);
        products.push(full);
    }
    let g_basis = Tensor::f_cat(&products, 1)?;
    let k = basis.size()[1];

    // T = Kᵀ·G·K = (aᵀK)ᵀ(aᵀK) and Kᵀ·G²·K = (GK)ᵀ(GK), in float64.
    let w = Tensor::f_cat(&halves, 1)?.f_to_kind(Kind::Double)?;
    let projected = w.f_tr()?.f_matmul(&w)?;
    let g_wide = g_basis.f_to_kind(Kind::Double)?;
    let squares = g_wide.f_tr()?.f_matmul(&g_wide)?;
    let (theta, vectors) = projected.f_linalg_eigh("L")?;
    let theta_host = to_host(&theta)?;
    let vectors32 = vectors.f_to_kind(Kind::Float)?;
    let ritz = basis.f_matmul(&vectors32)?;
    let ritz_residual = g_basis
        .f_matmul(&vectors32)?
        .f_sub(&ritz.f_mul(&theta.f_to_kind(Kind::Float)?)?)?
        .f_to_kind(Kind::Double)?
        .f_square()?
        .f_sum_dim_intlist(0, false, Kind::Double)?
        .f_sqrt()?;
    // The start block as b orthonormal probes scaled to length √r (Q₀ is Haar-distributed):
    // Ritz vector K·y has weight (r / b)·‖y₀‖², y₀ the first block of y. The weights sum to
    // r exactly, which Gaussian probes' ‖Ωᵀ·K·y‖² / b do only on average.
    let weights_of = |v: &Tensor| -> Result<Tensor, TchError> {
        v.f_narrow(0, 0, b)?
            .f_square()?
            .f_sum_dim_intlist(0, false, Kind::Double)?
            .f_mul_scalar(r as f64 / b as f64)
    };
    let weight = weights_of(&vectors)?;

    // The pencil's top eigenvalue, on the Ritz directions T can divide by.
    let largest = theta_host.last().copied().unwrap_or(0.0);
    let skip = theta_host
        .iter()
        .take_while(|&&t| t <= SKETCH_PENCIL_FLOOR * largest)
        .count() as i64;
    let pencil_top = if largest > 0.0 && skip < k {
        let scaled = vectors
            .f_narrow(1, skip, k - skip)?
            .f_div(&theta.f_narrow(0, skip, k - skip)?.f_sqrt()?)?;
        let pencil = scaled.f_tr()?.f_matmul(&squares)?.f_matmul(&scaled)?;
        to_host(&pencil.f_linalg_eigvalsh("L")?)?
            .last()
            .copied()
            .unwrap_or(0.0)
    } else {
        0.0
    };

    // Gauss–Radau: T bordered by C (the residual R = V'·C, CᵀC = RᵀR = L·Lᵀ, C = Lᵀ) and
    // the diagonal block C·(Eᵀ·T⁻¹·E)·Cᵀ (E picks the last block), which makes 0 an
    // eigenvalue. Left out where T is (numerically) singular or the residual vanishes: then
    // 0 is already a node, or the space is exhausted, and the two rules agree.
    let smallest = theta_host.first().copied().unwrap_or(0.0);
    let (radau_theta, radau_weight) = if smallest > 1e-12 * largest {
        let rr = residual.f_to_kind(Kind::Double)?;
        let (lower, info) = rr
            .f_tr()?
            .f_matmul(&rr)?
            .f_linalg_cholesky_ex(false, false)?;
        if i64::try_from(&info.f_to_device(tch::Device::Cpu)?)? == 0 {
            let last = vectors.f_narrow(0, k - b, b)?;
            let inverse = last.f_div(&theta)?.f_matmul(&last.f_tr()?)?;
            let corner = lower.f_tr()?.f_matmul(&inverse)?.f_matmul(&lower)?;
            let zeros = |rows: i64, cols: i64| {
                Tensor::f_zeros([rows, cols], (Kind::Double, projected.device()))
            };
            let right = Tensor::f_cat(&[&zeros(k - b, b)?, &lower], 0)?;
            let bottom = Tensor::f_cat(&[&zeros(b, k - b)?, &lower.f_tr()?, &corner], 1)?;
            let bordered = Tensor::f_cat(&[&Tensor::f_cat(&[&projected, &right], 1)?, &bottom], 0)?;
            let (nodes, radau_vectors) = bordered.f_linalg_eigh("L")?;
            (to_host(&nodes)?, to_host(&weights_of(&radau_vectors)?)?)
        } else {
            (Vec::new(), Vec::new())
        }
    } else {
        (Vec::new(), Vec::new())
    };

    let inside = squares.f_trace()?;
    let outside = gz
        .f_sub(&g_basis.f_matmul(&basis.f_tr()?.f_matmul(&z)?)?)?
        .f_to_kind(Kind::Double)?
        .f_square()?
        .f_sum(Kind::Double)?
        .f_div_scalar(m as f64)?;
    let trace_sq = to_host(&inside.f_add(&outside)?.f_reshape([1])?)?[0];
    Ok(sketched(
        &Estimates {
            // In units of G / Σλ.
            trace: 1.0,
            trace_sq,
            top: pencil_top,
            theta: &theta_host,
            residual: &to_host(&ritz_residual)?,
            weight: &to_host(&weight)?,
            radau_theta: &radau_theta,
            radau_weight: &radau_weight,
        },
        n.min(d) as usize,
    ))
}

/// `y` with its components along the orthonormal columns of `basis` removed (classical
/// Gram–Schmidt, twice: once is not enough in floating point).
fn orthogonal_to(y: &Tensor, basis: &Tensor) -> Result<Tensor, TchError> {
    let basis_t = basis.f_tr()?;
    let once = y.f_sub(&basis.f_matmul(&basis_t.f_matmul(y)?)?)?;
    once.f_sub(&basis.f_matmul(&basis_t.f_matmul(&once)?)?)
}

/// What the sketch measured, in the units of G (eigenvalues of the smaller Gram matrix).
#[derive(Debug, Clone, Copy)]
pub struct Estimates<'a> {
    /// Σλ.
    pub trace: f64,
    /// Estimated Σλ².
    pub trace_sq: f64,
    /// A lower bound on λ₁ besides the largest Ritz value (0 for none).
    pub top: f64,
    /// Ritz values, their residual norms and their Gauss weights (any order, equal lengths).
    pub theta: &'a [f64],
    pub residual: &'a [f64],
    pub weight: &'a [f64],
    /// Nodes and weights of the Gauss–Radau rule with a node at 0 (equal lengths; empty
    /// when it was not formed, and then the Gauss rule stands alone).
    pub radau_theta: &'a [f64],
    pub radau_weight: &'a [f64],
}

/// The six spectral columns from the sketch's estimates, of a matrix whose smaller side is
/// `rank_bound`. Estimates are clamped to what the exact values satisfy (`docs/metrics.md`:
/// 1 ≤ stable_rank ≤ participation_ratio ≤ r, and so on).
pub fn sketched(e: &Estimates, rank_bound: usize) -> Spectral {
    let top = e.theta.iter().copied().fold(e.top, f64::max);
    let finite = [e.trace, e.trace_sq, top].iter().all(|v| v.is_finite())
        && e.theta
            .iter()
            .chain(e.residual)
            .chain(e.weight)
            .chain(e.radau_theta)
            .chain(e.radau_weight)
            .all(|v| v.is_finite());
    if !finite || e.trace <= 0.0 || top <= 0.0 {
        return if finite && e.trace == 0.0 {
            Spectral::zero()
        } else {
            Spectral::default()
        };
    }
    let r = rank_bound.max(1) as f64;
    // λ₁ ≤ Σλ always; the estimates can only fall short of λ₁.
    let top = top.min(e.trace);
    let sum_mu = e.trace / top;
    // Σλ² lies between Σθ² (inside the space, a lower bound) and λ₁·Σλ.
    let sum_mu_sq = (e.trace_sq / (top * top)).clamp(sum_mu * sum_mu / r, sum_mu);
    // (μ, Gauss weight, converged) with μ = θ/λ₁.
    let mut pairs: Vec<(f64, f64, bool)> = e
        .theta
        .iter()
        .zip(e.residual)
        .zip(e.weight)
        .map(|((&t, &res), &w)| {
            let t = t.max(0.0);
            let converged = t > 0.0 && res <= SKETCH_CONVERGED * t;
            ((t / top).min(1.0), w.max(0.0), converged)
        })
        .collect();
    pairs.sort_unstable_by(|x, y| y.0.total_cmp(&x.0));
    // (Σ√μ, Σ √μ·ln √μ) of nodes μ with weights w.
    let moments = |nodes: &mut dyn Iterator<Item = (f64, f64)>| {
        nodes
            .filter(|&(mu, _)| mu > 0.0)
            .fold((0.0, 0.0), |(s, sl), (mu, w)| {
                (s + w * mu.sqrt(), sl + w * mu.sqrt() * 0.5 * mu.ln())
            })
    };
    let counted = |&(mu, w, converged): &(f64, f64, bool)| (mu, if converged { 1.0 } else { w });
    let gauss = moments(&mut pairs.iter().map(counted));
    let (sum_s, sum_s_ln_s) = if e.radau_theta.is_empty() {
        gauss
    } else {
        // The Radau rule's nodes include the converged pairs with their Gauss weights;
        // those count once, as in the Gauss rule.
        let radau = moments(
            &mut e
                .radau_theta
                .iter()
                .zip(e.radau_weight)
                .map(|(&t, &w)| ((t.max(0.0) / top).min(1.0), w.max(0.0)))
                .chain(
                    pairs
                        .iter()
                        .filter(|p| p.2)
                        .map(|&(mu, w, _)| (mu, 1.0 - w)),
                ),
        );
        let share = SKETCH_RADAU_SHARE;
        (
            (1.0 - share) * gauss.0 + share * radau.0,
            (1.0 - share) * gauss.1 + share * radau.1,
        )
    };
    let sum_s = sum_s.clamp(1.0, r.sqrt() * sum_mu.sqrt());
    let effective = (sum_s.ln() - sum_s_ln_s / sum_s).exp().clamp(1.0, r);
    let threshold = 0.9 * sum_mu * (1.0 - CUM_ENERGY_REL_TOL);
    let (mut energy, mut count) = (0.0, 0.0);
    for (mu, w) in pairs.iter().map(counted) {
        energy += w * mu;
        count += w;
        if energy >= threshold {
            break;
        }
    }
    let count = count.round().clamp(1.0, r);
    Spectral {
        stable_rank: Some(sum_mu),
        participation_ratio: Some(sum_mu * sum_mu / sum_mu_sq),
        participation_ratio_sv: Some((sum_s * sum_s / sum_mu).clamp(1.0, r)),
        cum_energy_90: Some(count as u32),
        nuclear_norm_ratio: Some(sum_s),
        effective_rank: Some(effective),
    }
}
