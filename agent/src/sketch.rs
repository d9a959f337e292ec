//! The sketch: the six spectral columns of a large matrix from a randomized block Krylov
//! space, in float32 on the matrix's own device, instead of the exact float64 Gram and
//! eigen-solve. `docs/metrics.md` ("Sketch mode") states the method, the measured errors and
//! the bounds that this module's tests hold it to. [`crate::metrics`] chooses the method
//! ([`crate::metrics::SpectrumOptions::method`]) and computes the health sums and the Σλ
//! that the sketch takes as given.

use tch::{Kind, TchError, Tensor};

use crate::metrics::{CUM_ENERGY_REL_TOL, Spectral, SplitMix64, gaussian, to_host};

/// Below this many rows or columns the sketch would span most of the space, and the exact
/// path is cheap: `sketch` mode measures such a matrix exactly (and says so in `method`).
pub const SKETCH_MIN_SIDE: i64 = 512;
/// Gaussian start vectors of the block Krylov space (b).
const SKETCH_BLOCK: i64 = 32;
/// Block Krylov steps after the first block (q): the space has b·(q + 1) = 192 vectors.
const SKETCH_STEPS: usize = 5;
/// Rademacher probes for the part of Σλ² outside the Krylov space (m).
const SKETCH_PROBES: i64 = 32;
/// A Ritz pair whose residual ‖G·v − θ·v‖ is at most this fraction of θ counts as an
/// eigenpair (weight 1 in the trace estimates).
const SKETCH_CONVERGED: f64 = 1e-3;

/// The six spectral columns of a float32 matrix `x` (n × d, finite, not empty) whose
/// squared Frobenius norm is `trace`, by a randomized block Krylov method, in float32 on
/// `x`'s device. With G the Gram matrix of the smaller side (r × r, r = min(n, d)),
/// applied as A·(Aᵀ·V) and never formed:
///
/// - Σλ = `trace` = ‖x‖²_F, computed exactly in float64 by the caller.
/// - A block Krylov space K = span{Ω, GΩ, …, G^q Ω} from b Gaussian vectors Ω, orthonormal
///   (block Gram–Schmidt twice, then QR), with G·K kept from the products that built it.
///   Rayleigh–Ritz on K gives Ritz values θⱼ; λ₁ is θ₁.
/// - Σλ² = ‖G·K‖²_F + ‖G·(I − P)·Z‖²_F / m: exact inside K, Hutchinson with m Rademacher
///   probes Z outside it (P projects on K); the products G·Z ride along with the first block.
/// - Σσ and Σ σ ln σ: block Gauss quadrature from the same space. A Ritz pair that has
///   converged (residual ≤ 10⁻³·θ) counts once; any other Ritz value θⱼ counts with its
///   quadrature weight ‖Ωᵀ·vⱼ‖² / b (vⱼ its Ritz vector), which is 1 on average.
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
    // a is r × c with r ≤ c, so G = a·aᵀ is the smaller Gram matrix.
    // A transposed view: the products take it as it is, without a copy.
    let a = if n <= d { x.shallow_clone() } else { x.f_tr()? }.f_to_kind(Kind::Float)?;
    let at = a.f_tr()?;
    let r = a.size()[0];
    // (aᵀ·v, G·v): aᵀ·v is kept for the Rayleigh quotients, whose rounding it makes
    // quadratic (G's null directions get Ritz values of order ε², not ε).
    let gram_times = |v: &Tensor| -> Result<(Tensor, Tensor), TchError> {
        let half = at.f_matmul(v)?;
        let full = a.f_matmul(&half)?;
        Ok((half, full))
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
    let mut blocks = vec![q0];
    let mut halves = vec![half.f_narrow(1, 0, b)?];
    let mut products = vec![first.f_narrow(1, 0, b)?];
    for _ in 0..SKETCH_STEPS {
        let basis = Tensor::f_cat(&blocks, 1)?;
        let last = products.last().expect("one block at least");
        let (next, _) = Tensor::f_linalg_qr(&orthogonal_to(last, &basis)?, "reduced")?;
        // Once more: where the space is exhausted (rank below its size) the QR of a
        // near-zero block is not orthogonal to the basis by itself.
        let (next, _) = Tensor::f_linalg_qr(&orthogonal_to(&next, &basis)?, "reduced")?;
        let (half, full) = gram_times(&next)?;
        halves.push(half);
        products.push(full);
        blocks.push(next);
    }
    let basis = Tensor::f_cat(&blocks, 1)?;
    let g_basis = Tensor::f_cat(&products, 1)?;

    // Kᵀ·G·K = (aᵀK)ᵀ(aᵀK), in float64.
    let w = Tensor::f_cat(&halves, 1)?.f_to_kind(Kind::Double)?;
    let (theta, vectors) = w.f_tr()?.f_matmul(&w)?.f_linalg_eigh("L")?;
    let vectors = vectors.f_to_kind(Kind::Float)?;
    let ritz = basis.f_matmul(&vectors)?;
    let residual = g_basis
        .f_matmul(&vectors)?
        .f_sub(&ritz.f_mul(&theta.f_to_kind(Kind::Float)?)?)?;
    let residual = residual
        .f_to_kind(Kind::Double)?
        .f_square()?
        .f_sum_dim_intlist(0, false, Kind::Double)?
        .f_sqrt()?;
    let weight = omega
        .f_tr()?
        .f_matmul(&ritz)?
        .f_to_kind(Kind::Double)?
        .f_square()?
        .f_sum_dim_intlist(0, false, Kind::Double)?
        .f_div_scalar(b as f64)?;
    let inside = g_basis
        .f_to_kind(Kind::Double)?
        .f_square()?
        .f_sum(Kind::Double)?;
    let outside = gz
        .f_sub(&g_basis.f_matmul(&basis.f_tr()?.f_matmul(&z)?)?)?
        .f_to_kind(Kind::Double)?
        .f_square()?
        .f_sum(Kind::Double)?
        .f_div_scalar(m as f64)?;
    let trace_sq = to_host(&inside.f_add(&outside)?.f_reshape([1])?)?[0];
    Ok(sketched(
        trace,
        trace_sq,
        &to_host(&theta)?,
        &to_host(&residual)?,
        &to_host(&weight)?,
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

/// The six spectral columns from the sketch's estimates: Σλ (`trace`), Σλ² (`trace_sq`),
/// and the Ritz values with their residual norms and quadrature weights (any order, equal
/// lengths), of a matrix whose smaller side is `rank_bound`. Estimates are clamped to what
/// the exact values satisfy (`docs/metrics.md`: 1 ≤ stable_rank ≤ participation_ratio ≤ r,
/// and so on).
pub fn sketched(
    trace: f64,
    trace_sq: f64,
    theta: &[f64],
    residual: &[f64],
    weight: &[f64],
    rank_bound: usize,
) -> Spectral {
    let top = theta.iter().copied().fold(0.0f64, f64::max);
    let finite = [trace, trace_sq, top].iter().all(|v| v.is_finite())
        && theta
            .iter()
            .chain(residual)
            .chain(weight)
            .all(|v| v.is_finite());
    if !finite || trace <= 0.0 || top <= 0.0 {
        return if finite && trace == 0.0 {
            Spectral::zero()
        } else {
            Spectral::default()
        };
    }
    let r = rank_bound.max(1) as f64;
    // λ₁ ≤ Σλ always; the Ritz value can only fall short of λ₁.
    let top = top.min(trace);
    let sum_mu = trace / top;
    // Σλ² lies between Σθ² (inside the space, a lower bound) and λ₁·Σλ.
    let sum_mu_sq = (trace_sq / (top * top)).clamp(sum_mu * sum_mu / r, sum_mu);
    let mut pairs: Vec<(f64, f64)> = theta
        .iter()
        .zip(residual)
        .zip(weight)
        .map(|((&t, &res), &w)| {
            let t = t.max(0.0);
            let w = if t > 0.0 && res <= SKETCH_CONVERGED * t {
                1.0
            } else {
                w.max(0.0)
            };
            (t / top, w)
        })
        .collect();
    pairs.sort_unstable_by(|x, y| y.0.total_cmp(&x.0));
    let sum_s: f64 = pairs.iter().map(|&(mu, w)| w * mu.sqrt()).sum();
    let sum_s_ln_s: f64 = pairs
        .iter()
        .filter(|&&(mu, _)| mu > 0.0)
        .map(|&(mu, w)| w * mu.sqrt() * 0.5 * mu.ln())
        .sum();
    let sum_s = sum_s.clamp(1.0, r.sqrt() * sum_mu.sqrt());
    let effective = (sum_s.ln() - sum_s_ln_s / sum_s).exp().clamp(1.0, r);
    let threshold = 0.9 * sum_mu * (1.0 - CUM_ENERGY_REL_TOL);
    let (mut energy, mut count) = (0.0, 0.0);
    for &(mu, w) in &pairs {
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

#[cfg(test)]
mod tests {
    use tch::Device;

    use super::*;
    use crate::metrics::{
        ConvLayout, LayerMetrics, MatrixOptions, SpectrumMode, SpectrumOptions, compute,
    };

    fn with_spectrum(mode: SpectrumMode) -> MatrixOptions {
        MatrixOptions {
            max_rows: 1 << 20,
            centered: false,
            conv_layout: ConvLayout::Channelwise,
            spectrum: SpectrumOptions {
                mode,
                sketch_threshold: 1536,
            },
        }
    }

    /// Every spectral column of `metrics` within `tol` (relative) of `expected`.
    fn assert_matches(metrics: &LayerMetrics, expected: &Spectral, tol: f64, what: &str) {
        let pairs = metrics.spectral.named().into_iter().zip(expected.named());
        for ((name, actual), (_, expected)) in pairs {
            assert!(
                (actual - expected).abs() <= tol * expected.abs().max(1e-12),
                "{what}: {name} = {actual}, expected {expected}"
            );
        }
    }

    /// The sketch against the exact float64 path on every kind of spectrum, in both
    /// orientations. The bounds are the ones `docs/metrics.md` states for this size, which
    /// the measured errors stay under with a margin.
    #[test]
    fn sketch_is_within_its_stated_bounds() {
        use crate::spectra::SpectrumKind;
        let (rows, cols) = (768, 1536);
        for kind in SpectrumKind::ALL {
            let x = kind.matrix(rows, cols, 7).unwrap();
            // One kind in both orientations: the sketch works on the smaller side's Gram.
            let orientations = if kind == SpectrumKind::Flat {
                vec![x.tr(), x]
            } else {
                vec![x]
            };
            for x in orientations {
                let exact = compute(&x, &with_spectrum(SpectrumMode::Exact), 3);
                let sketch = compute(&x, &with_spectrum(SpectrumMode::Sketch), 3);
                assert_eq!((exact.method, sketch.method), ("exact", "sketch"));
                assert_eq!((sketch.mean, sketch.std), (exact.mean, exact.std));
                let error = |f: fn(&Spectral) -> Option<f64>| {
                    let (e, s) = (f(&exact.spectral).unwrap(), f(&sketch.spectral).unwrap());
                    (s - e).abs() / e
                };
                let what = format!("{} {:?}", kind.name(), x.size());
                let stable = error(|s| s.stable_rank);
                let pr = error(|s| s.participation_ratio);
                let effective = error(|s| s.effective_rank);
                let pr_sv = error(|s| s.participation_ratio_sv);
                let nuclear = error(|s| s.nuclear_norm_ratio);
                let cum = error(|s| s.cum_energy_90.map(f64::from));
                println!(
                    "{what}: stable_rank {stable:.4} participation_ratio {pr:.4} \
                     effective_rank {effective:.4} participation_ratio_sv {pr_sv:.4} \
                     nuclear_norm_ratio {nuclear:.4} cum_energy_90 {cum:.4}"
                );
                assert!(stable <= 0.02, "{what}: stable_rank off by {stable}");
                assert!(pr <= 0.02, "{what}: participation_ratio off by {pr}");
                // The steep power law (σᵢ ∝ 1/i) is the one kind the sketch misses by more.
                let bound = if kind == SpectrumKind::PowerLaw(2.0) {
                    0.15
                } else {
                    0.05
                };
                assert!(
                    effective <= bound,
                    "{what}: effective_rank off by {effective}"
                );
                assert!(
                    pr_sv <= 0.10,
                    "{what}: participation_ratio_sv off by {pr_sv}"
                );
                assert!(
                    nuclear <= 0.05,
                    "{what}: nuclear_norm_ratio off by {nuclear}"
                );
                assert!(cum <= 0.15, "{what}: cum_energy_90 off by {cum}");
            }
        }
    }

    #[test]
    fn sketch_is_reproducible_and_its_own_edge_cases_hold() {
        let x = crate::spectra::SpectrumKind::Flat
            .matrix(600, 700, 1)
            .unwrap();
        let opts = with_spectrum(SpectrumMode::Sketch);
        let first = compute(&x, &opts, 5);
        assert_eq!(first.method, "sketch");
        assert_eq!(compute(&x, &opts, 5), first);
        assert_eq!(
            first.clone().into_layer_row(0, 0, "l".into(), 0.0).method,
            "sketch"
        );
        // A rank-3 matrix: the Krylov space runs out, the estimates stay exact.
        let low = crate::spectra::SpectrumKind::Flat
            .matrix(600, 3, 2)
            .unwrap()
            .matmul(
                &crate::spectra::SpectrumKind::Flat
                    .matrix(3, 700, 3)
                    .unwrap(),
            );
        let exact = compute(&low, &with_spectrum(SpectrumMode::Exact), 5);
        let sketch = compute(&low, &opts, 5);
        assert_eq!(sketch.method, "sketch");
        assert_matches(&sketch, &exact.spectral, 1e-3, "rank 3 sketched");
        // The zero matrix spans no dimension whichever method measures it.
        let zero = compute(
            &Tensor::zeros([600, 700], (Kind::Float, Device::Cpu)),
            &opts,
            5,
        );
        assert_eq!((zero.spectral, zero.method), (Spectral::zero(), "sketch"));
        // Non-finite input: no spectrum, and no method.
        let bad = x.copy();
        let _ = bad.get(0).get(0).fill_(f64::NAN);
        let m = compute(&bad, &opts, 5);
        assert_eq!(
            (m.spectral, m.method, m.nonfinite),
            (Spectral::default(), "", 1)
        );
    }

    #[test]
    fn sketched_clamps_to_what_exact_values_satisfy() {
        // Estimates outside the bounds are pulled back in.
        let s = sketched(10.0, 1000.0, &[4.0, 1.0], &[0.0, 0.0], &[1.0, 1.0], 8);
        assert_eq!(s.stable_rank, Some(2.5));
        assert_eq!(s.participation_ratio, Some(2.5));
        assert!(s.effective_rank.unwrap() >= 1.0);
        assert_eq!(
            sketched(0.0, 0.0, &[0.0], &[0.0], &[1.0], 8),
            Spectral::zero()
        );
        assert_eq!(
            sketched(f64::NAN, 1.0, &[1.0], &[0.0], &[1.0], 8),
            Spectral::default()
        );
    }
}
