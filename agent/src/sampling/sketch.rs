//! The sketch: the six spectral columns of a large matrix from a randomized block Krylov
//! space, instead of the exact float64 Gram and eigen-solve, each with an estimate of its
//! own error ([`SpectralErrors`]). Pure Rust on host buffers: the products with G
//! ([`GramOperator`]) in float32, the small dense algebra on the space in float64 (faer,
//! one thread). `docs/metrics.md` ("Sketch mode") states the method, the estimates, the
//! bounds and why they hold. [`super::measure`](mod@super::measure) chooses the method
//! ([`super::options::SpectrumOptions::method`]), computes the Σλ that the sketch takes as
//! given, and falls back to the exact path for a sample the sketch cannot vouch for.

use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef, Par};

use super::gram::GramOperator;
use super::spectral::{Spectral, SpectralErrors, SplitMix64, gaussian};
use dense::{append, eigh, grown, mul, orthogonal_to, squared_rows, symmetrize, trace_of};
use quadrature::{Quadrature, radau};
use top::{lambda_bound, pencil_top};

mod dense;
mod quadrature;
#[cfg(test)]
mod tests;
mod top;

/// Below this many rows or columns the sketch would span most of the space, and the exact
/// path is cheap: `sketch` mode measures such a matrix exactly (and says so in `method`).
pub const SKETCH_MIN_SIDE: i64 = 512;
/// Gaussian start vectors of the block Krylov space (b): also the probes of the quadrature
/// and of the bound on λ₁. A product's CPU time grows less than its width (one thread,
/// 2,048 × 4,096: 15 ms for 16 columns, 21 ms for 32), and λ₁ needs depth more than width,
/// so the space is narrow and deep.
pub const SKETCH_BLOCK: usize = 16;
/// Krylov depths (block steps after the first) at which the estimates are checked, in
/// order: the space grows to the next one only while a column the sketch is asked for has
/// an error estimate above its bound. 6 steps (112 vectors) vouch for most spectra with a
/// clear top; 10 (176) for flat ones and moderate power laws; 15 (256) for steep ones.
pub const SKETCH_SCHEDULE: [usize; 3] = [6, 10, 15];
/// Rademacher probes for the part of Σλ² outside the Krylov space (m).
pub const SKETCH_PROBES: usize = 32;
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

/// The six spectral columns of the Gram matrix G that `op` applies (r × r, finite) whose
/// trace is `trace` (Σλ = ‖A‖²_F), with their error estimates, by a randomized block
/// Krylov method: products with G in float32, everything else in float64, on this thread.
/// Everything is in units of G / Σλ (eigenvalues summing to 1):
///
/// - A block Krylov space K = span{Q₀, GQ₀, …, G^q Q₀} from b orthonormalized Gaussian
///   vectors Q₀, grown along [`SKETCH_SCHEDULE`] while an estimate the goal needs exceeds
///   its bound. T = KᵀGK (from Aᵀ·K where A is given, else from Kᵀ·GK) gives Ritz pairs
///   (θⱼ, K·yⱼ).
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
/// Costs q + 1 products with G (the first b + m columns wide, the others b; two passes
/// over A each for a factored G) and small dense algebra per checked depth. Never panics:
/// input it cannot measure (non-finite values or products, a side too small for the
/// space, a non-square explicit G) gives no spectrum and `vouched` false, so the caller
/// measures exactly; a zero `trace` gives the zero spectrum.
pub fn sketch_spectral(op: &GramOperator<'_>, trace: f64, seed: u64, goal: SketchGoal) -> Sketch {
    if trace == 0.0 {
        return zero();
    }
    if !op.is_valid() || op.side() < DEEPEST_SIDE || !(trace.is_finite() && trace > 0.0) {
        return unmeasured(0);
    }
    let Some(mut krylov) = Krylov::start(op, trace, seed) else {
        return unmeasured(0);
    };
    along_schedule(SKETCH_SCHEDULE.len(), |i, known| {
        if !krylov.extend(SKETCH_SCHEDULE[i]) {
            return Err(krylov.steps);
        }
        let depth = krylov.depth();
        let view = View {
            r: krylov.r,
            projected: krylov.projected.as_ref(),
            squares: krylov.squares.as_ref(),
            depth: &depth,
        };
        Ok(analyse(&view, goal, known))
    })
}

/// The deepest space's size, K = (q + 1)·b at the schedule's last depth.
const DEEPEST_SPACE: usize = space_of(SKETCH_SCHEDULE.len());

/// The space's size K = (q + 1)·b when it holds the first `depths` depths of the schedule
/// (1 to its length), q the last of them.
const fn space_of(depths: usize) -> usize {
    (SKETCH_SCHEDULE[depths - 1] + 1) * SKETCH_BLOCK
}
/// The smallest r the sketch measures: the deepest space and the block after it must fit
/// in r dimensions.
const DEEPEST_SIDE: usize = DEEPEST_SPACE + SKETCH_BLOCK;

/// The zero spectrum (Σλ = 0), vouched for.
fn zero() -> Sketch {
    Sketch {
        spectral: Spectral::zero(),
        errors: SpectralErrors::default(),
        vouched: true,
        steps: 0,
    }
}

/// The analysis depth by depth (`stage(i, known)` for the i-th of `depths`, with the λ₁
/// estimate and bound of a smaller depth that vouched for `stable_rank`), stopping at
/// the first that vouches for the goal's columns; `Err(steps)`: no spectrum, measured to
/// `steps`.
fn along_schedule(
    depths: usize,
    mut stage: impl FnMut(usize, Option<Known>) -> Result<Stage, usize>,
) -> Sketch {
    let mut known = None;
    let mut last = None;
    for i in 0..depths {
        let found = match stage(i, known) {
            Ok(found) => found,
            Err(steps) => return unmeasured(steps),
        };
        known = found.known.filter(|_| found.stable_rank_vouched);
        let done = found.sketch.vouched;
        last = Some(found.sketch);
        if done {
            break;
        }
    }
    last.unwrap_or_else(|| unmeasured(0))
}

/// What one checked depth of the space gives the analysis besides T and (GK)ᵀ(GK): small
/// matrices and vectors only, so that a device that ran the Krylov process can hand
/// them over ([`KrylovSummary`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Depth {
    /// Block steps after the first ([`SKETCH_SCHEDULE`]).
    pub steps: usize,
    /// RᵀR (b × b), R = (I − P)·G·V the last block's residual.
    pub residual_gram: Mat<f64>,
    /// ‖GK − KT − R·E_qᵀ‖_F: the Krylov relation's round-off in the other blocks.
    pub off: f64,
    /// Per probe z (m): ‖G·(I − P)·z‖².
    pub probe_outside: Vec<f64>,
    /// Per probe z (m): zᵀ(I − P)·G·(I − P)z.
    pub probe_control: Vec<f64>,
}

/// The Krylov process of one sample, run by an adapter on its device in the sketch's
/// units (G / Σλ), with float32 products and the rest in float64: everything
/// [`sketch_summarized`] needs, a few hundred KiB where G itself can be 64 MiB. The start
/// block is b = [`SKETCH_BLOCK`] orthonormalized Gaussian vectors, the probes m =
/// [`SKETCH_PROBES`] Rademacher vectors.
#[derive(Debug, Clone, PartialEq)]
pub struct KrylovSummary {
    /// r: the order of G.
    pub side: usize,
    /// T = KᵀGK at the deepest depth ((q + 1)·b square, symmetric); a smaller depth's T
    /// is its leading block.
    pub projected: Mat<f64>,
    /// (GK)ᵀ(GK) at the deepest depth, likewise.
    pub squares: Mat<f64>,
    /// Each checked depth, in [`SKETCH_SCHEDULE`] order (a prefix of it, at least one).
    pub depths: Vec<Depth>,
}

impl KrylovSummary {
    /// The float64 values of a packed summary that checks the first `depths` depths of
    /// [`SKETCH_SCHEDULE`] (1 to its length): what an adapter's device writes into one
    /// host buffer, in this order (row-major):
    /// - T (K × K, K = (q + 1)·[`SKETCH_BLOCK`], q the last of those depths), then
    ///   (GK)ᵀ(GK) (K × K);
    /// - per depth, in order: RᵀR (b × b), the round-off (1), the probes'
    ///   ‖G·(I − P)·z‖² (m), their zᵀ(I − P)·G·(I − P)z (m).
    ///
    /// 0 for `depths` outside the schedule.
    pub const fn packed_len_of(depths: usize) -> usize {
        if depths == 0 || depths > SKETCH_SCHEDULE.len() {
            return 0;
        }
        let k = space_of(depths);
        2 * k * k + depths * (SKETCH_BLOCK * SKETCH_BLOCK + 1 + 2 * SKETCH_PROBES)
    }

    /// The packed length of a summary of every depth of the schedule: the largest.
    pub const fn packed_len() -> usize {
        Self::packed_len_of(SKETCH_SCHEDULE.len())
    }

    /// [`KrylovSummary::packed_len_of`] for 1 depth, 2, … to the schedule's.
    pub fn packed_lens() -> [usize; SKETCH_SCHEDULE.len()] {
        std::array::from_fn(|i| Self::packed_len_of(i + 1))
    }

    /// How many depths of the schedule a packed summary of `len` values checks, if
    /// `len` is one of [`KrylovSummary::packed_len_of`]'s lengths.
    pub fn depths_in(len: usize) -> Option<usize> {
        (1..=SKETCH_SCHEDULE.len()).find(|&depths| Self::packed_len_of(depths) == len)
    }

    /// The summary in `values` (in [`KrylovSummary::packed_len_of`]'s order, the number
    /// of depths told by their count); `None` for a length that is none of those.
    pub fn from_packed(side: usize, values: &[f64]) -> Option<KrylovSummary> {
        let depths = Self::depths_in(values.len())?;
        let (k, b, m) = (space_of(depths), SKETCH_BLOCK, SKETCH_PROBES);
        let mut rest = values;
        let mut take = |n: usize| {
            let (head, tail) = rest.split_at(n);
            rest = tail;
            head
        };
        let square = |v: &[f64], n: usize| Mat::from_fn(n, n, |i, j| v[i * n + j]);
        let projected = square(take(k * k), k);
        let squares = square(take(k * k), k);
        let depths = SKETCH_SCHEDULE[..depths]
            .iter()
            .map(|&steps| Depth {
                steps,
                residual_gram: square(take(b * b), b),
                off: take(1)[0],
                probe_outside: take(m).to_vec(),
                probe_control: take(m).to_vec(),
            })
            .collect();
        Some(KrylovSummary {
            side,
            projected,
            squares,
            depths,
        })
    }
}

/// [`sketch_spectral`] from a Krylov process an adapter ran on its device: the same
/// analysis, depth by depth along the schedule, stopping at the first that vouches for
/// the goal's columns. A summary of the wrong shape or with a value that is not finite
/// gives no spectrum (`vouched` false), never a panic; a zero `trace` (Σλ, which the
/// summary's units divide by) gives the zero spectrum.
pub fn sketch_summarized(summary: &KrylovSummary, trace: f64, goal: SketchGoal) -> Sketch {
    if trace == 0.0 {
        return zero();
    }
    if !(trace.is_finite() && trace > 0.0 && summary_is_valid(summary)) {
        return unmeasured(0);
    }
    along_schedule(summary.depths.len(), |i, known| {
        let depth = &summary.depths[i];
        let k = (depth.steps + 1) * SKETCH_BLOCK;
        let view = View {
            r: summary.side,
            projected: summary.projected.as_ref().submatrix(0, 0, k, k),
            squares: summary.squares.as_ref().submatrix(0, 0, k, k),
            depth,
        };
        Ok(analyse(&view, goal, known))
    })
}

/// Whether a summary has the shapes [`sketch_summarized`] reads, and finite values.
fn summary_is_valid(summary: &KrylovSummary) -> bool {
    let (b, m) = (SKETCH_BLOCK, SKETCH_PROBES);
    let depths = &summary.depths;
    let Some(last) = depths.last() else {
        return false;
    };
    let k = (last.steps + 1) * b;
    let square = |x: &Mat<f64>| x.nrows() == k && x.ncols() == k && x.is_all_finite();
    summary.side >= DEEPEST_SIDE
        && depths.len() <= SKETCH_SCHEDULE.len()
        && depths.iter().zip(SKETCH_SCHEDULE).all(|(d, steps)| {
            d.steps == steps
                && d.residual_gram.nrows() == b
                && d.residual_gram.ncols() == b
                && d.residual_gram.is_all_finite()
                && d.off.is_finite()
                && d.probe_outside.len() == m
                && d.probe_control.len() == m
                && d.probe_outside
                    .iter()
                    .chain(&d.probe_control)
                    .all(|v| v.is_finite())
        })
        && square(&summary.projected)
        && square(&summary.squares)
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

/// The growing Krylov space of one matrix and what the estimates need from it (float64).
struct Krylov<'a> {
    op: GramOperator<'a>,
    r: usize,
    /// 1/‖A‖_F: the products are of G / Σλ.
    inverse_norm: f32,
    /// K: r × k, orthonormal columns, the start block Q₀ first.
    basis: Mat<f64>,
    /// aᵀ·K (c × k) for a factored G: T is its Gram matrix.
    halves: Option<Mat<f64>>,
    /// G·K (r × k).
    products: Mat<f64>,
    /// ‖G·V‖_F of the last block V.
    last_product_norm: f64,
    /// T = KᵀGK and (GK)ᵀ(GK), grown a block at a time.
    projected: Mat<f64>,
    squares: Mat<f64>,
    /// (I − P)·G·V for the last block V: the next block, and the border of the Radau rule.
    residual: Mat<f64>,
    /// The Rademacher probes Z and G·Z (r × m).
    z: Mat<f64>,
    gz: Mat<f64>,
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

impl<'a> Krylov<'a> {
    /// The start block and the probes from `seed` (the same random stream as before the
    /// sketch left libtorch: Gaussian Ω row-major, then the probes' signs), and their
    /// products; `None` where a product is not finite.
    fn start(op: &GramOperator<'a>, trace: f64, seed: u64) -> Option<Krylov<'a>> {
        let r = op.side();
        let (b, m) = (SKETCH_BLOCK, SKETCH_PROBES);
        let mut rng = SplitMix64(seed ^ 0x5ce7_c4b0_0000_0001);
        let omega = gaussian(&mut rng, r * b);
        let omega = Mat::from_fn(r, b, |i, j| f64::from(omega[i * b + j]));
        let signs: Vec<f64> = (0..r * m)
            .map(|_| if rng.next_u64() >> 63 == 0 { 1.0 } else { -1.0 })
            .collect();
        let z = Mat::from_fn(r, m, |i, j| signs[i * m + j]);
        let q0 = omega.qr().compute_thin_Q();
        let mut krylov = Krylov {
            op: *op,
            r,
            // The products are divided by ‖A‖_F: the sketch works on G / Σλ, whose
            // eigenvalues sum to 1, so float32 neither overflows for large activations
            // nor underflows for tiny ones.
            inverse_norm: (1.0 / trace.sqrt()) as f32,
            basis: Mat::zeros(r, 0),
            halves: None,
            products: Mat::zeros(r, 0),
            last_product_norm: 0.0,
            projected: Mat::zeros(0, 0),
            squares: Mat::zeros(0, 0),
            residual: Mat::zeros(r, b),
            z,
            gz: Mat::zeros(r, m),
            steps: 0,
        };
        let first = Mat::from_fn(r, b + m, |i, j| {
            if j < b {
                q0[(i, j)]
            } else {
                krylov.z[(i, j - b)]
            }
        });
        let (half, full) = krylov.gram_times(first.as_ref())?;
        krylov.gz = full.subcols(b, m).to_owned();
        krylov.push(
            q0.as_ref(),
            half.as_ref().map(|h| h.subcols(0, b)),
            full.subcols(0, b),
        );
        krylov.residual = orthogonal_to(full.subcols(0, b), krylov.basis.as_ref());
        Some(krylov)
    }

    /// (aᵀ·v, G·v) in float64, divided by ‖A‖_F and Σλ, from float32 products; `None`
    /// where a value is not finite.
    fn gram_times(&self, v: MatRef<'_, f64>) -> Option<(Option<Mat<f64>>, Mat<f64>)> {
        let v32 = Mat::from_fn(v.nrows(), v.ncols(), |i, j| v[(i, j)] as f32);
        let product = self.op.apply(v32.as_ref(), self.inverse_norm);
        let widen = |m: &Mat<f32>| Mat::from_fn(m.nrows(), m.ncols(), |i, j| f64::from(m[(i, j)]));
        let full = widen(&product.full);
        let half = product.half.as_ref().map(widen);
        let finite = full.is_all_finite() && half.as_ref().is_none_or(|h| h.is_all_finite());
        finite.then_some((half, full))
    }

    /// Adds a block V (r × b) of the basis with its products, growing T and (GK)ᵀ(GK) by
    /// its rows and columns.
    fn push(
        &mut self,
        next: MatRef<'_, f64>,
        half: Option<MatRef<'_, f64>>,
        full: MatRef<'_, f64>,
    ) {
        let k = self.basis.ncols();
        let b = next.ncols();
        // T's new columns: (aᵀK)ᵀ(aᵀV) for a factored G, else Kᵀ(GV) (symmetrized).
        let block = match half {
            Some(half) => {
                let halves = self
                    .halves
                    .get_or_insert_with(|| Mat::zeros(half.nrows(), 0));
                append(halves, half);
                mul(halves.transpose(), half)
            }
            None => {
                let mut block = Mat::zeros(k + b, b);
                matmul(
                    block.as_mut().subrows_mut(0, k),
                    Accum::Replace,
                    self.basis.transpose(),
                    full,
                    1.0,
                    Par::Seq,
                );
                matmul(
                    block.as_mut().subrows_mut(k, b),
                    Accum::Replace,
                    next.transpose(),
                    full,
                    1.0,
                    Par::Seq,
                );
                symmetrize(block.as_mut().subrows_mut(k, b));
                block
            }
        };
        append(&mut self.basis, next);
        append(&mut self.products, full);
        let squares = mul(self.products.transpose(), full);
        self.projected = grown(&self.projected, block.as_ref());
        self.squares = grown(&self.squares, squares.as_ref());
        self.last_product_norm = full.norm_l2();
    }

    /// Grows the space to `steps` block steps after the first; false where a product is
    /// not finite.
    fn extend(&mut self, steps: usize) -> bool {
        while self.steps < steps {
            let qr = self.residual.qr();
            let mut next = qr.compute_thin_Q();
            // The residual keeps round-off components along the basis of about ε·‖G·V‖,
            // which the QR scales up by ‖G·V‖ / |Rᵢᵢ|. Where the projection took most of
            // the block (the space nearly exhausted: rank below its size, or a steep
            // spectrum) they would not be small any more, so the block is orthogonalized
            // once more.
            let upper = qr.thin_R();
            let pivot = (0..upper.ncols())
                .map(|i| upper[(i, i)].abs())
                .fold(f64::INFINITY, f64::min);
            if pivot <= SKETCH_REORTHOGONALIZE * self.last_product_norm {
                next = orthogonal_to(next.as_ref(), self.basis.as_ref())
                    .qr()
                    .compute_thin_Q();
            }
            let Some((half, full)) = self.gram_times(next.as_ref()) else {
                return false;
            };
            self.push(next.as_ref(), half.as_ref().map(Mat::as_ref), full.as_ref());
            self.residual = orthogonal_to(full.as_ref(), self.basis.as_ref());
            self.steps += 1;
        }
        true
    }

    /// What the analysis of the space as it is needs besides T and (GK)ᵀ(GK): the last
    /// block's residual Gram matrix, the other blocks' round-off, and the probes' parts
    /// outside the space.
    fn depth(&self) -> Depth {
        let k = self.basis.ncols();
        let b = SKETCH_BLOCK;
        // R_off = GK − KT − R·E_qᵀ: the Krylov relation's round-off, measured.
        let mut off_blocks = self.products.clone();
        matmul(
            off_blocks.as_mut(),
            Accum::Add,
            self.basis.as_ref(),
            self.projected.as_ref(),
            -1.0,
            Par::Seq,
        );
        let mut tail = off_blocks.as_mut().subcols_mut(k - b, b);
        for j in 0..b {
            for i in 0..self.r {
                tail[(i, j)] -= self.residual[(i, j)];
            }
        }
        // The probes outside the space, (I − P)·Z, and G·(I − P)·Z.
        let coefficients = mul(self.basis.transpose(), self.z.as_ref());
        let mut g_outside = self.gz.clone();
        matmul(
            g_outside.as_mut(),
            Accum::Add,
            self.products.as_ref(),
            coefficients.as_ref(),
            -1.0,
            Par::Seq,
        );
        let mut outside = self.z.clone();
        matmul(
            outside.as_mut(),
            Accum::Add,
            self.basis.as_ref(),
            coefficients.as_ref(),
            -1.0,
            Par::Seq,
        );
        let m = SKETCH_PROBES;
        Depth {
            steps: self.steps,
            residual_gram: mul(self.residual.transpose(), self.residual.as_ref()),
            off: off_blocks.norm_l2(),
            probe_outside: (0..m).map(|j| g_outside.col(j).squared_norm_l2()).collect(),
            probe_control: (0..m)
                .map(|j| {
                    g_outside
                        .col(j)
                        .iter()
                        .zip(outside.col(j).iter())
                        .map(|(x, y)| x * y)
                        .sum()
                })
                .collect(),
        }
    }
}

/// One checked depth of the space as the analysis reads it: r, T = KᵀGK and (GK)ᵀ(GK)
/// (k × k, k = (steps + 1)·b), and the rest in [`Depth`].
struct View<'s> {
    r: usize,
    projected: MatRef<'s, f64>,
    squares: MatRef<'s, f64>,
    depth: &'s Depth,
}

/// The columns and their error estimates from one depth of the space. `known`: the λ₁
/// estimate and bound of a smaller depth that vouched for `stable_rank`.
fn analyse(view: &View<'_>, goal: SketchGoal, known: Option<Known>) -> Stage {
    let steps = view.depth.steps;
    let failed = || Stage {
        sketch: unmeasured(steps),
        known: None,
        stable_rank_vouched: false,
    };
    let (r, b) = (view.r, SKETCH_BLOCK);
    let k = view.projected.nrows();
    let Some((theta, vectors)) = eigh(view.projected) else {
        return failed();
    };
    let largest = theta.last().copied().unwrap_or(0.0);
    // A smaller depth's λ₁ estimate is a Rayleigh quotient too: the pencil is not needed
    // again once `stable_rank` is vouched for.
    let pencil = match known {
        Some(known) => known.top,
        None => pencil_top(&theta, vectors.as_ref(), view.squares),
    };
    let top = largest.max(pencil).min(1.0);
    let finite = theta.iter().all(|t| t.is_finite()) && pencil.is_finite();
    if !finite || top <= 0.0 {
        return failed();
    }

    // Ritz residual norms ‖G·K·y − θ·K·y‖ = ‖R·y_q‖ (R the last block's residual, y_q
    // the last block of y): the Krylov relation, up to round-off.
    let residual_gram = view.depth.residual_gram.as_ref();
    let last = vectors.subrows(k - b, b);
    let reach = mul(residual_gram, last);
    let residual_norm: Vec<f64> = (0..k)
        .map(|j| {
            let s: f64 = (0..b).map(|i| last[(i, j)] * reach[(i, j)]).sum();
            s.max(0.0).sqrt()
        })
        .collect();

    // λ₁ and `stable_rank`.
    let bound = match known {
        Some(known) => known.bound.max(top),
        None => lambda_bound(
            r,
            &theta,
            vectors.as_ref(),
            residual_gram,
            view.depth.off,
            top,
        ),
    };
    let stable_rank_err = (bound / top - 1.0).max(SKETCH_ERROR_FLOOR);

    // Σλ² and `participation_ratio`.
    let (trace_sq, trace_sq_se) = trace_sq(view);
    // Σλ² is at least what K holds (and (Σλ)² / r), and at most λ₁·Σλ.
    let inside = trace_of(view.squares);
    let trace_sq = clamped(trace_sq, (1.0 / r as f64).max(inside), bound);
    let margin = SKETCH_Z * trace_sq_se;
    let participation_err = if trace_sq > margin {
        (margin / (trace_sq - margin)).max(SKETCH_ERROR_FLOOR)
    } else {
        f64::INFINITY
    };

    // The quadrature for Σσ and Σ σ ln σ.
    let converged: Vec<bool> = theta
        .iter()
        .zip(&residual_norm)
        .map(|(&t, &res)| t > 0.0 && res <= SKETCH_CONVERGED * t)
        .collect();
    let first_block = squared_rows(vectors.subrows(0, b));
    let radau = radau(view.projected, residual_gram, &theta, vectors.as_ref());
    let quadrature = Quadrature::new(r, top, &theta, &converged, &first_block, radau.as_ref());
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
    Stage {
        sketch: Sketch {
            spectral,
            errors,
            vouched,
            steps,
        },
        known: Some(Known { bound, top }),
        stable_rank_vouched,
    }
}

/// Σλ² (units of (Σλ)²) and its standard error: ‖G·K‖²_F exactly, plus ‖G·(I − P)‖²_F
/// by Hutchinson's estimator over the probes Z, with zᵀ(I − P)G(I − P)z, whose mean
/// 1 − tr T is known exactly, as a control variate.
fn trace_sq(view: &View<'_>) -> (f64, f64) {
    let a = &view.depth.probe_outside;
    let c = &view.depth.probe_control;
    let m = a.len();
    let trace_outside = 1.0 - trace_of(view.projected);
    let (mean_a, mean_c) = (mean(a), mean(c));
    let var_c = c.iter().map(|v| (v - mean_c).powi(2)).sum::<f64>();
    let beta = if var_c > 0.0 {
        a.iter()
            .zip(c)
            .map(|(x, y)| (x - mean_a) * (y - mean_c))
            .sum::<f64>()
            / var_c
    } else {
        0.0
    };
    let adjusted: Vec<f64> = a
        .iter()
        .zip(c)
        .map(|(x, y)| x - beta * (y - trace_outside))
        .collect();
    let estimate = mean(&adjusted);
    let spread = adjusted.iter().map(|v| (v - estimate).powi(2)).sum::<f64>() / (m as f64 - 2.0);
    let inside = trace_of(view.squares);
    (inside + estimate, (spread / m as f64).sqrt())
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
        .map(|(&(_, bound), &(_, err))| err <= bound)
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
