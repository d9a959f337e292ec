//! The sketch: the six spectral columns of a large matrix from a randomized block Krylov
//! space, in float32 on the matrix's own device, instead of the exact float64 Gram and
//! eigen-solve, each with an estimate of its own error ([`SpectralErrors`]).
//! `docs/metrics.md` ("Sketch mode") states the method, the estimates, the bounds and why
//! they hold. [`super::measure`] chooses the method
//! ([`super::options::SpectrumOptions::method`]), computes the Σλ that the sketch takes as
//! given, and falls back to the exact path for a sample the sketch cannot vouch for.

use tch::{Device, Kind, TchError, Tensor};

use super::gram;
use super::spectral::{Spectral, SpectralErrors, SplitMix64, gaussian, to_host};
use quadrature::Quadrature;
use top::pencil_top;

mod quadrature;
mod top;

/// Below this many rows or columns the sketch would span most of the space, and the exact
/// path is cheap: `sketch` mode measures such a matrix exactly (and says so in `method`).
pub const SKETCH_MIN_SIDE: i64 = 512;
/// Gaussian start vectors of the block Krylov space (b): also the probes of the quadrature
/// and of the bound on λ₁. A product's CPU time grows less than its width (one thread,
/// 2,048 × 4,096: 15 ms for 16 columns, 21 ms for 32), and λ₁ needs depth more than width,
/// so the space is narrow and deep.
const SKETCH_BLOCK: i64 = 16;
/// Krylov depths (block steps after the first) at which the estimates are checked, in
/// order: the space grows to the next one only while a column the sketch is asked for has
/// an error estimate above its bound. 6 steps (112 vectors) vouch for most spectra with a
/// clear top; 10 (176) for flat ones and moderate power laws; 15 (256) for steep ones.
const SKETCH_SCHEDULE: [usize; 3] = [6, 10, 15];
/// Rademacher probes for the part of Σλ² outside the Krylov space (m).
const SKETCH_PROBES: i64 = 32;
/// A Ritz pair whose residual ‖G·v − θ·v‖ is at most this fraction of θ counts as an
/// eigenpair (weight 1 in the trace estimates).
const SKETCH_CONVERGED: f64 = 1e-3;
/// A new block is orthogonalized a second time when its smallest QR pivot is at most this
/// fraction of the product it came from.
const SKETCH_REORTHOGONALIZE: f64 = 1e-2;
/// The probability that the bound on λ₁ fails: that the b Gaussian start vectors all but
/// miss λ₁'s eigenvector.
pub const SKETCH_FAILURE: f64 = 1e-6;
/// Standard errors in the sampling part of an error estimate (the probes' spread).
pub const SKETCH_Z: f64 = 4.0;
/// No error estimate is below this (float32 products and accumulation).
const SKETCH_ERROR_FLOOR: f64 = 1e-4;
/// Below this share of Σλ outside the converged Ritz pairs, the space holds the whole
/// spectrum and the quadrature is exact.
const SKETCH_EXHAUSTED: f64 = 1e-6;

/// The bound `docs/metrics.md` states for each column, in [`Spectral::named`] order. A
/// sketched value whose error estimate exceeds its bound is not stored as such.
pub const SKETCH_BOUNDS: [(&str, f64); 6] = [
    ("stable_rank", 0.02),
    ("participation_ratio", 0.02),
    ("effective_rank", 0.05),
    ("participation_ratio_sv", 0.10),
    ("nuclear_norm_ratio", 0.05),
    ("cum_energy_90", 0.15),
];

/// Which columns decide how deep the sketch goes (and whether it vouches for the sample).
/// `cum_energy_90` never does: a count the sketch cannot vouch for is left out (null).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SketchGoal {
    /// Every column but `cum_energy_90`: what the agent stores.
    #[default]
    AllColumns,
    /// `stable_rank` and `participation_ratio` alone (the benchmark's CPU time for them).
    StableRankAndParticipation,
}

impl SketchGoal {
    /// Whether the column at `index` of [`SKETCH_BOUNDS`] decides.
    fn drives(self, index: usize) -> bool {
        match self {
            SketchGoal::AllColumns => index < 5,
            SketchGoal::StableRankAndParticipation => index < 2,
        }
    }
}

/// What the sketch measured: the columns, their error estimates, and whether every column
/// its goal names is within its bound. A column over its bound is `None` in `spectral`
/// (its estimate stays in `errors`).
#[derive(Debug, Clone, PartialEq)]
pub struct Sketch {
    pub spectral: Spectral,
    pub errors: SpectralErrors,
    pub vouched: bool,
    /// Krylov block steps after the first that ran (a [`SKETCH_SCHEDULE`] depth).
    pub steps: usize,
}

/// The six spectral columns of a float32 matrix `x` (n × d, finite, not empty) whose
/// squared Frobenius norm is `trace`, with their error estimates, by a randomized block
/// Krylov method in float32 on `x`'s device. With G the Gram matrix of the smaller side
/// (r × r, r = min(n, d)), applied as A·(Aᵀ·V) and never formed, and everything in units of
/// G / Σλ (eigenvalues summing to 1):
///
/// - A block Krylov space K = span{Q₀, GQ₀, …, G^q Q₀} from b orthonormalized Gaussian
///   vectors Q₀, grown along [`SKETCH_SCHEDULE`] while an estimate the goal needs exceeds
///   its bound. T = KᵀGK (from Aᵀ·K, in float64) gives Ritz pairs (θⱼ, K·yⱼ).
/// - λ₁ ≥ θ̂ = the larger of θ₁ and the top of the pencil (Kᵀ·G²·K, Kᵀ·G·K), both Rayleigh
///   quotients. Its bound: for an eigenpair (λ, u), Kᵀu = (λ − T)⁻¹ (GK − KT)ᵀ u, so the
///   start block's share of u, ‖Q₀ᵀu‖², is at most ‖E₀ᵀ(λ − T)⁻¹ (GK − KT)ᵀ‖², which falls
///   fast as λ moves above θ̂; and ‖Q₀ᵀu₁‖² is at least a χ² quantile over r except with
///   probability [`SKETCH_FAILURE`]. The largest λ that allows it bounds λ₁.
/// - Σλ² = ‖G·K‖²_F + ‖G·(I − P)‖²_F, the second by Hutchinson's estimator with m
///   Rademacher probes Z, its known-mean companion Zᵀ(I − P)G(I − P)Z (mean 1 − tr T) as a
///   control variate; the error estimate is [`SKETCH_Z`] standard errors.
/// - Σσ and Σ σ ln σ: the converged Ritz pairs once each, and the rest by the block Gauss
///   rule (nodes θⱼ, weights r·‖(yⱼ)₀‖² per probe) and the block Gauss–Radau rule with a node
///   at 0, which bound each probe's value from above and below; a control variate on the
///   exactly known energy outside the converged pairs. The estimate is the geometric middle
///   of the two rules, its error half their spread plus [`SKETCH_Z`] jackknife standard
///   errors over the b probes.
/// - `cum_energy_90`: the Gauss nodes counted to 0.9·Σλ (exact where the count ends among
///   converged pairs), its error the weight of the node where it ends plus the jackknife
///   term.
///
/// Costs 2(q + 1) passes over x (the first with b + m columns, the others with b) and small
/// dense algebra per checked depth.
pub fn sketch_spectral(
    x: &Tensor,
    trace: f64,
    seed: u64,
    goal: SketchGoal,
) -> Result<Sketch, TchError> {
    if x.dim() != 2 {
        return Ok(unmeasured(0));
    }
    if trace == 0.0 {
        return Ok(Sketch {
            spectral: Spectral::zero(),
            errors: SpectralErrors::default(),
            vouched: true,
            steps: 0,
        });
    }
    let mut krylov = Krylov::start(x, trace, seed)?;
    let mut known = None;
    let mut stage = None;
    for steps in SKETCH_SCHEDULE {
        krylov.extend(steps)?;
        let found = krylov.analyse(goal, known)?;
        known = found.known.filter(|_| found.stable_rank_vouched);
        let done = found.sketch.vouched;
        stage = Some(found.sketch);
        if done {
            break;
        }
    }
    Ok(stage.unwrap_or_else(|| unmeasured(krylov.steps)))
}

/// No spectrum, and nothing vouched for (the caller measures exactly).
fn unmeasured(steps: usize) -> Sketch {
    Sketch {
        spectral: Spectral::default(),
        errors: SpectralErrors::default(),
        vouched: false,
        steps,
    }
}

/// The growing Krylov space of one matrix and what the estimates need from it.
struct Krylov {
    x: Tensor,
    r: i64,
    inverse_norm: f64,
    /// K: r × k, orthonormal columns, the start block Q₀ first.
    basis: Tensor,
    /// Per block V: aᵀ·V (c × b) and G·V (r × b), float32, and their float64 copies.
    halves: Vec<Tensor>,
    halves64: Vec<Tensor>,
    products: Vec<Tensor>,
    products64: Vec<Tensor>,
    /// T = KᵀGK = (aᵀK)ᵀ(aᵀK) and (GK)ᵀ(GK), float64, grown a block at a time.
    projected: Tensor,
    squares: Tensor,
    /// (I − P)·G·V for the last block V: the next block, and the border of the Radau rule.
    residual: Tensor,
    /// The Rademacher probes Z and G·Z.
    z: Tensor,
    gz: Tensor,
    /// Block steps after the first so far.
    steps: usize,
}

/// One checked depth: the sketch's result, and its λ₁ estimate and bound for the next.
struct Stage {
    sketch: Sketch,
    known: Option<Known>,
    stable_rank_vouched: bool,
}

/// A depth's estimate θ̂ of λ₁ (a Rayleigh quotient) and its upper bound on λ₁, both in
/// units of Σλ; they hold for any larger space.
#[derive(Debug, Clone, Copy)]
struct Known {
    bound: f64,
    top: f64,
}

impl Krylov {
    fn start(x: &Tensor, trace: f64, seed: u64) -> Result<Krylov, TchError> {
        let (n, d) = (x.size()[0], x.size()[1]);
        let device = x.device();
        let r = n.min(d);
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
        let mut krylov = Krylov {
            x: x.f_to_kind(Kind::Float)?,
            r,
            // The products are divided by ‖x‖_F: the sketch works on G / Σλ, whose
            // eigenvalues sum to 1, so float32 neither overflows for large activations
            // nor underflows for tiny ones.
            inverse_norm: 1.0 / trace.sqrt(),
            basis: Tensor::new(),
            halves: Vec::new(),
            halves64: Vec::new(),
            products: Vec::new(),
            products64: Vec::new(),
            projected: Tensor::new(),
            squares: Tensor::new(),
            residual: Tensor::new(),
            z,
            gz: Tensor::new(),
            steps: 0,
        };
        let (q0, _) = Tensor::f_linalg_qr(&omega, "reduced")?;
        let (half, first) = krylov.gram_times(&Tensor::f_cat(&[&q0, &krylov.z], 1)?)?;
        krylov.gz = first.f_narrow(1, b, m)?;
        krylov.basis = q0;
        krylov.push(half.f_narrow(1, 0, b)?, first.f_narrow(1, 0, b)?)?;
        krylov.residual = orthogonal_to(&krylov.products[0], &krylov.basis)?;
        Ok(krylov)
    }

    /// (aᵀ·v, G·v), both divided by ‖x‖_F, with a the r × c orientation of x (r ≤ c, so
    /// G = a·aᵀ is the smaller Gram matrix).
    fn gram_times(&self, v: &Tensor) -> Result<(Tensor, Tensor), TchError> {
        gram::gram_times(&self.x, v, self.inverse_norm)
    }

    /// Adds a block's products, growing T and (GK)ᵀ(GK) by its rows and columns.
    fn push(&mut self, half: Tensor, full: Tensor) -> Result<(), TchError> {
        let half64 = half.f_to_kind(Kind::Double)?;
        let full64 = full.f_to_kind(Kind::Double)?;
        self.projected = grow(&self.projected, &self.halves64, &half64)?;
        self.squares = grow(&self.squares, &self.products64, &full64)?;
        self.halves.push(half);
        self.halves64.push(half64);
        self.products.push(full);
        self.products64.push(full64);
        Ok(())
    }

    /// Grows the space to `steps` block steps after the first.
    fn extend(&mut self, steps: usize) -> Result<(), TchError> {
        while self.steps < steps {
            let (next, upper) = Tensor::f_linalg_qr(&self.residual, "reduced")?;
            // The residual keeps round-off components along the basis of about ε·‖G·V‖,
            // which the QR scales up by ‖G·V‖ / |Rᵢᵢ|. Where the projection took most of
            // the block (the space nearly exhausted: rank below its size, or a steep
            // spectrum) they would not be small any more, so the block is orthogonalized
            // once more.
            let scale = to_host(&Tensor::f_stack(
                &[
                    upper.f_diagonal(0, 0, 1)?.f_abs()?.f_min()?,
                    self.products.last().expect("one block at least").f_norm()?,
                ],
                0,
            )?)?;
            let next = if scale[0] > SKETCH_REORTHOGONALIZE * scale[1] {
                next
            } else {
                Tensor::f_linalg_qr(&orthogonal_to(&next, &self.basis)?, "reduced")?.0
            };
            let (half, full) = self.gram_times(&next)?;
            self.basis = Tensor::f_cat(&[&self.basis, &next], 1)?;
            self.residual = orthogonal_to(&full, &self.basis)?;
            self.push(half, full)?;
            self.steps += 1;
        }
        Ok(())
    }

    /// The columns and their error estimates from the space as it is. `known`: the λ₁
    /// estimate and bound of a smaller depth that vouched for `stable_rank`.
    fn analyse(&self, goal: SketchGoal, known: Option<Known>) -> Result<Stage, TchError> {
        let r = self.r as usize;
        let b = SKETCH_BLOCK;
        let k = self.basis.size()[1];
        let g_basis = Tensor::f_cat(&self.products, 1)?;
        let (theta, vectors) = self.projected.f_linalg_eigh("L")?;
        let theta_host = to_host(&theta)?;
        let largest = theta_host.last().copied().unwrap_or(0.0);
        // A smaller depth's λ₁ estimate is a Rayleigh quotient too: the pencil is not needed
        // again once `stable_rank` is vouched for.
        let pencil = match known {
            Some(known) => known.top,
            None => pencil_top(&theta, &theta_host, &vectors, &self.squares)?,
        };
        let top = largest.max(pencil).min(1.0);
        let finite = theta_host.iter().all(|t| t.is_finite()) && pencil.is_finite();
        if !finite || top <= 0.0 {
            return Ok(Stage {
                sketch: unmeasured(self.steps),
                known: None,
                stable_rank_vouched: false,
            });
        }

        // Ritz residual norms ‖G·K·y − θ·K·y‖ = ‖R·y_q‖ (R the last block's residual, y_q
        // the last block of y): the Krylov relation, up to round-off.
        let residual = self.residual.f_to_kind(Kind::Double)?;
        let residual_gram = residual.f_tr()?.f_matmul(&residual)?;
        let last = vectors.f_narrow(0, k - b, b)?;
        let residual_norm = to_host(
            &last
                .f_mul(&residual_gram.f_matmul(&last)?)?
                .f_sum_dim_intlist(0, false, Kind::Double)?
                .f_clamp_min(0.0)?
                .f_sqrt()?,
        )?;

        // λ₁ and `stable_rank`.
        let bound = match known {
            Some(known) => known.bound.max(top),
            None => {
                self.lambda_bound(&g_basis, &theta, &theta_host, &vectors, &residual_gram, top)?
            }
        };
        let stable_rank_err = (bound / top - 1.0).max(SKETCH_ERROR_FLOOR);

        // Σλ² and `participation_ratio`.
        let (trace_sq, trace_sq_se) = self.trace_sq(&g_basis)?;
        // Σλ² is at least what K holds (and (Σλ)² / r), and at most λ₁·Σλ.
        let inside = self.squares.f_trace()?.double_value(&[]);
        let trace_sq = clamped(trace_sq, (1.0 / r as f64).max(inside), bound);
        let margin = SKETCH_Z * trace_sq_se;
        let participation_err = if trace_sq > margin {
            (margin / (trace_sq - margin)).max(SKETCH_ERROR_FLOOR)
        } else {
            f64::INFINITY
        };

        // The quadrature for Σσ and Σ σ ln σ.
        let converged: Vec<bool> = theta_host
            .iter()
            .zip(&residual_norm)
            .map(|(&t, &res)| t > 0.0 && res <= SKETCH_CONVERGED * t)
            .collect();
        let first_block = to_host(&vectors.f_narrow(0, 0, b)?.f_square()?.f_reshape([-1])?)?;
        let radau = self.radau(&theta_host, &theta, &vectors)?;
        let quadrature = Quadrature::new(
            r,
            top,
            &theta_host,
            &converged,
            &first_block,
            radau.as_ref(),
        );
        let [effective, ratio_sv, nuclear] = quadrature.values();
        let nuclear_err = (1.0 + nuclear.1) * (bound / top).sqrt() - 1.0;
        let (count, count_err) = quadrature.count90();

        let mut spectral = Spectral {
            stable_rank: Some(1.0 / top),
            participation_ratio: Some(clamped(1.0 / trace_sq, 1.0 / top, r as f64)),
            participation_ratio_sv: Some(ratio_sv.0),
            cum_energy_90: Some(count),
            nuclear_norm_ratio: Some(nuclear.0),
            effective_rank: Some(effective.0),
        };
        let floor = |e: f64| {
            if e.is_nan() {
                f64::INFINITY
            } else {
                e.max(SKETCH_ERROR_FLOOR)
            }
        };
        let errors = SpectralErrors {
            stable_rank: Some(stable_rank_err),
            participation_ratio: Some(participation_err),
            participation_ratio_sv: Some(floor(ratio_sv.1)),
            cum_energy_90: Some(if count_err.is_nan() {
                f64::INFINITY
            } else {
                count_err
            }),
            nuclear_norm_ratio: Some(floor(nuclear_err)),
            effective_rank: Some(floor(effective.1)),
        };
        let (vouched, stable_rank_vouched) = mark_unvouched(&mut spectral, &errors, goal);
        Ok(Stage {
            sketch: Sketch {
                spectral,
                errors,
                vouched,
                steps: self.steps,
            },
            known: Some(Known { bound, top }),
            stable_rank_vouched,
        })
    }

    /// Σλ² (units of (Σλ)²) and its standard error: ‖G·K‖²_F exactly, plus ‖G·(I − P)‖²_F
    /// by Hutchinson's estimator over the probes Z, with zᵀ(I − P)G(I − P)z, whose mean
    /// 1 − tr T is known exactly, as a control variate.
    fn trace_sq(&self, g_basis: &Tensor) -> Result<(f64, f64), TchError> {
        let m = SKETCH_PROBES as usize;
        let coefficients = self.basis.f_tr()?.f_matmul(&self.z)?;
        let g_outside = self
            .gz
            .f_sub(&g_basis.f_matmul(&coefficients)?)?
            .f_to_kind(Kind::Double)?;
        let outside = self
            .z
            .f_sub(&self.basis.f_matmul(&coefficients)?)?
            .f_to_kind(Kind::Double)?;
        let a = to_host(
            &g_outside
                .f_square()?
                .f_sum_dim_intlist(0, false, Kind::Double)?,
        )?;
        let c = to_host(
            &outside
                .f_mul(&g_outside)?
                .f_sum_dim_intlist(0, false, Kind::Double)?,
        )?;
        let trace_outside = 1.0 - self.projected.f_trace()?.double_value(&[]);
        let (mean_a, mean_c) = (mean(&a), mean(&c));
        let var_c = c.iter().map(|v| (v - mean_c).powi(2)).sum::<f64>();
        let beta = if var_c > 0.0 {
            a.iter()
                .zip(&c)
                .map(|(x, y)| (x - mean_a) * (y - mean_c))
                .sum::<f64>()
                / var_c
        } else {
            0.0
        };
        let adjusted: Vec<f64> = a
            .iter()
            .zip(&c)
            .map(|(x, y)| x - beta * (y - trace_outside))
            .collect();
        let estimate = mean(&adjusted);
        let spread =
            adjusted.iter().map(|v| (v - estimate).powi(2)).sum::<f64>() / (m as f64 - 2.0);
        let inside = self.squares.f_trace()?.double_value(&[]);
        Ok((inside + estimate, (spread / m as f64).sqrt()))
    }

    /// The Gauss–Radau rule with a node at 0: T bordered by C (the last residual
    /// R = V'·C, CᵀC = RᵀR = L·Lᵀ, C = Lᵀ) and the diagonal block C·(Eᵀ·T⁻¹·E)·Cᵀ (E picks
    /// the last block), which makes 0 an eigenvalue. Its nodes and the start block's
    /// squared components of their vectors (b × (k + b), row-major); `None` where the
    /// residual vanishes (the space holds the whole spectrum).
    fn radau(
        &self,
        theta_host: &[f64],
        theta: &Tensor,
        vectors: &Tensor,
    ) -> Result<Option<RadauRule>, TchError> {
        let b = SKETCH_BLOCK;
        let k = theta.size()[0];
        let largest = theta_host[theta_host.len() - 1];
        if largest <= 0.0 {
            return Ok(None);
        }
        let rr = self.residual.f_to_kind(Kind::Double)?;
        let (lower, info) = rr
            .f_tr()?
            .f_matmul(&rr)?
            .f_linalg_cholesky_ex(false, false)?;
        if i64::try_from(&info.f_to_device(Device::Cpu)?)? != 0 {
            return Ok(None);
        }
        let last = vectors.f_narrow(0, k - b, b)?;
        // Eᵀ·T⁺·E: Ritz values at round-off level are G's null directions inside K (a
        // rank below the space's size), already nodes at 0; their Ritz vectors have no
        // last-block component (G·K·y = 0 leaves no residual), so they drop out.
        let null = theta.f_le(1e-12 * largest)?;
        let inverse_theta = theta.f_reciprocal()?.f_masked_fill(&null, 0.0)?;
        let inverse = last.f_mul(&inverse_theta)?.f_matmul(&last.f_tr()?)?;
        let corner = lower.f_tr()?.f_matmul(&inverse)?.f_matmul(&lower)?;
        let zeros =
            |rows: i64, cols: i64| Tensor::f_zeros([rows, cols], (Kind::Double, theta.device()));
        let right = Tensor::f_cat(&[&zeros(k - b, b)?, &lower], 0)?;
        let bottom = Tensor::f_cat(&[&zeros(b, k - b)?, &lower.f_tr()?, &corner], 1)?;
        let bordered = Tensor::f_cat(
            &[&Tensor::f_cat(&[&self.projected, &right], 1)?, &bottom],
            0,
        )?;
        let (nodes, radau_vectors) = bordered.f_linalg_eigh("L")?;
        let first = radau_vectors
            .f_narrow(0, 0, b)?
            .f_square()?
            .f_reshape([-1])?;
        Ok(Some((to_host(&nodes)?, to_host(&first)?)))
    }
}

/// The Gauss–Radau rule's nodes, and per probe (b rows) the squared start-block components
/// of their vectors (row-major).
type RadauRule = (Vec<f64>, Vec<f64>);

/// `gram` (the Gram matrix of `olds`' columns) grown by the columns of `new`.
fn grow(gram: &Tensor, olds: &[Tensor], new: &Tensor) -> Result<Tensor, TchError> {
    let diagonal = new.f_tr()?.f_matmul(new)?;
    if olds.is_empty() {
        return Ok(diagonal);
    }
    let cross = Tensor::f_cat(
        &olds
            .iter()
            .map(|old| old.f_tr()?.f_matmul(new))
            .collect::<Result<Vec<_>, _>>()?,
        0,
    )?;
    let upper = Tensor::f_cat(&[gram, &cross], 1)?;
    let lower = Tensor::f_cat(&[&cross.f_tr()?, &diagonal], 1)?;
    Tensor::f_cat(&[&upper, &lower], 0)
}

/// `y` with its components along the orthonormal columns of `basis` removed (classical
/// Gram–Schmidt, twice: once is not enough in floating point).
fn orthogonal_to(y: &Tensor, basis: &Tensor) -> Result<Tensor, TchError> {
    let basis_t = basis.f_tr()?;
    let once = y.f_sub(&basis.f_matmul(&basis_t.f_matmul(y)?)?)?;
    once.f_sub(&basis.f_matmul(&basis_t.f_matmul(&once)?)?)
}

/// `value` within [low, high], `high` winning where the two cross (rounding).
fn clamped(value: f64, low: f64, high: f64) -> f64 {
    value.max(low).min(high)
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

/// Nulls every column whose estimate exceeds its bound; whether every column `goal`
/// drives, and `stable_rank`, are within theirs.
fn mark_unvouched(
    spectral: &mut Spectral,
    errors: &SpectralErrors,
    goal: SketchGoal,
) -> (bool, bool) {
    let estimates = errors.named();
    let mut vouched = true;
    let within: Vec<bool> = SKETCH_BOUNDS
        .iter()
        .zip(&estimates)
        .map(|(&(name, bound), &(named, err))| {
            debug_assert_eq!(name, named);
            err <= bound
        })
        .collect();
    for (index, &ok) in within.iter().enumerate() {
        if ok {
            continue;
        }
        if goal.drives(index) {
            vouched = false;
        }
        match index {
            0 => spectral.stable_rank = None,
            1 => spectral.participation_ratio = None,
            2 => spectral.effective_rank = None,
            3 => spectral.participation_ratio_sv = None,
            4 => spectral.nuclear_norm_ratio = None,
            _ => spectral.cum_energy_90 = None,
        }
    }
    (vouched, within[0])
}
