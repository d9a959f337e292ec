//! What the exact path and the sketch share: the six spectral columns ([`Spectral`]) and
//! how they follow from eigenvalues ([`spectral`]), the seeded random source
//! (`SplitMix64`, `gaussian`). It imports nothing else of the agent.
//!
//! # Spectral metrics
//!
//! With λ₁ ≥ … ≥ λ_r ≥ 0 the eigenvalues of AᵀA (r = min(n, d)) and σᵢ = √λᵢ:
//! `stable_rank` = Σλ/λ₁, `participation_ratio` = (Σλ)²/Σλ², `participation_ratio_sv` =
//! (Σσ)²/Σσ², `cum_energy_90` = the smallest k with Σ_{i≤k} λᵢ ≥ 0.9·Σλ, `nuclear_norm_ratio`
//! = Σσ/σ₁, `effective_rank` = exp(−Σ pᵢ ln pᵢ) with pᵢ = σᵢ/Σσ.
//!
//! # Conventions (defined, not accidental)
//!
//! - **Round-off.** Eigenvalues are clamped at 0, and those at or below λ₁·r·ε (ε the float64
//!   machine epsilon) are treated as exactly 0: a Gram eigen-solve cannot resolve them, and
//!   their square roots would otherwise add noise of order √ε to the σ-based columns.
//! - **`cum_energy_90` tolerance.** The threshold is 0.9·Σλ·(1 − 10⁻¹²), so that a spectrum
//!   whose first k eigenvalues hold exactly 90 % of the energy gives k, not k + 1, whatever
//!   the summation rounding.
//! - **All-zero matrix** (Σλ = 0, e.g. a dead layer, or a single row after centring): every
//!   ratio is 0.0 and `cum_energy_90` is 0. A zero activation spans no dimension, and that is
//!   a signal worth plotting; nulls are kept for input that cannot be measured.
//! - **Rank 1** (one non-zero row, d = 1, an outer product): every ratio is 1 and
//!   `cum_energy_90` is 1.

/// The six spectral columns; all `None` when the spectrum cannot be measured.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Spectral {
    pub stable_rank: Option<f64>,
    pub participation_ratio: Option<f64>,
    pub participation_ratio_sv: Option<f64>,
    pub cum_energy_90: Option<u32>,
    pub nuclear_norm_ratio: Option<f64>,
    pub effective_rank: Option<f64>,
}

impl Spectral {
    /// The six columns by name, in table order, as f64 (`None` as NaN).
    pub fn named(&self) -> Vec<(&'static str, f64)> {
        let v = |x: Option<f64>| x.unwrap_or(f64::NAN);
        vec![
            ("stable_rank", v(self.stable_rank)),
            ("participation_ratio", v(self.participation_ratio)),
            ("effective_rank", v(self.effective_rank)),
            ("participation_ratio_sv", v(self.participation_ratio_sv)),
            ("nuclear_norm_ratio", v(self.nuclear_norm_ratio)),
            ("cum_energy_90", v(self.cum_energy_90.map(f64::from))),
        ]
    }

    /// The all-zero matrix: it spans no dimension (see the module conventions).
    pub(crate) fn zero() -> Spectral {
        Spectral {
            stable_rank: Some(0.0),
            participation_ratio: Some(0.0),
            participation_ratio_sv: Some(0.0),
            cum_energy_90: Some(0),
            nuclear_norm_ratio: Some(0.0),
            effective_rank: Some(0.0),
        }
    }
}

/// The sketch's error estimates of the six spectral columns (`docs/metrics.md`, "Sketch
/// mode"): each bounds the relative error |sketched − exact| / exact of its column, as the
/// sketch estimates it from its own data. `None` where no estimate applies: rows measured by
/// the exact path (the value is the definition) and null spectra. A column the sketch could
/// not vouch for is `None` in [`Spectral`] while its estimate stays here: that pair is the
/// marker of a value left out.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SpectralErrors {
    pub stable_rank: Option<f64>,
    pub participation_ratio: Option<f64>,
    pub participation_ratio_sv: Option<f64>,
    pub cum_energy_90: Option<f64>,
    pub nuclear_norm_ratio: Option<f64>,
    pub effective_rank: Option<f64>,
}

impl SpectralErrors {
    /// The six estimates by their column's name, in [`Spectral::named`] order (`None` as NaN).
    pub fn named(&self) -> Vec<(&'static str, f64)> {
        let v = |x: Option<f64>| x.unwrap_or(f64::NAN);
        vec![
            ("stable_rank", v(self.stable_rank)),
            ("participation_ratio", v(self.participation_ratio)),
            ("effective_rank", v(self.effective_rank)),
            ("participation_ratio_sv", v(self.participation_ratio_sv)),
            ("nuclear_norm_ratio", v(self.nuclear_norm_ratio)),
            ("cum_energy_90", v(self.cum_energy_90)),
        ]
    }
}

/// Relative slack on the 90 % energy threshold, so that summation rounding cannot push the
/// answer one eigenvalue further.
pub(crate) const CUM_ENERGY_REL_TOL: f64 = 1e-12;

/// Vigna's splitmix64: tiny, fast, and good enough to pick rows.
pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..bound` (bound > 0), without modulo bias (Lemire's method). The
    /// threshold (a division) is only needed where the low half falls below `bound`,
    /// which it exceeds: the same draws as computing it first, without the division
    /// almost every time.
    pub(crate) fn below(&mut self, bound: u64) -> u64 {
        let mut threshold = None;
        loop {
            let product = u128::from(self.next_u64()) * u128::from(bound);
            let low = product as u64;
            if low >= bound || low >= *threshold.get_or_insert(bound.wrapping_neg() % bound) {
                return (product >> 64) as u64;
            }
        }
    }
}

/// `len` standard normal values (Box–Muller), reproducible from `rng`.
pub(crate) fn gaussian(rng: &mut SplitMix64, len: usize) -> Vec<f32> {
    let mut uniform = || ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    (0..len)
        .map(|_| {
            let (u, v) = (uniform(), uniform());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        })
        .collect()
}

/// The six spectral metrics from the eigenvalues of AᵀA (or AAᵀ), in any order, following
/// the module conventions: clamped at 0 and at the round-off floor, 0.0 for the zero matrix,
/// all `None` for an empty slice or non-finite eigenvalues. Every quantity is computed on
/// λ/λ₁, which changes none of the (scale-free) metrics and cannot overflow.
pub fn spectral(eigenvalues: &[f64]) -> Spectral {
    if eigenvalues.is_empty() || eigenvalues.iter().any(|l| !l.is_finite()) {
        return Spectral::default();
    }
    let mut lambda: Vec<f64> = eigenvalues.iter().map(|&l| l.max(0.0)).collect();
    lambda.sort_unstable_by(|a, b| b.total_cmp(a));
    let top = lambda[0];
    if top == 0.0 {
        return Spectral::zero();
    }
    let floor = top * lambda.len() as f64 * f64::EPSILON;
    // μᵢ = λᵢ/λ₁ ∈ [0, 1], μ₁ = 1; sᵢ = √μᵢ = σᵢ/σ₁.
    let mu: Vec<f64> = lambda
        .iter()
        .enumerate()
        .map(|(i, &l)| if i > 0 && l <= floor { 0.0 } else { l / top })
        .collect();
    let sum_mu: f64 = mu.iter().sum();
    let sum_mu_sq: f64 = mu.iter().map(|m| m * m).sum();
    let s: Vec<f64> = mu.iter().map(|m| m.sqrt()).collect();
    let sum_s: f64 = s.iter().sum();

    let entropy: f64 = s
        .iter()
        .map(|&si| si / sum_s)
        .filter(|&p| p > 0.0)
        .map(|p| -p * p.ln())
        .sum();

    let threshold = 0.9 * sum_mu * (1.0 - CUM_ENERGY_REL_TOL);
    let mut cumulative = 0.0;
    let mut k = mu.len();
    for (i, m) in mu.iter().enumerate() {
        cumulative += m;
        if cumulative >= threshold {
            k = i + 1;
            break;
        }
    }

    Spectral {
        stable_rank: Some(sum_mu),
        participation_ratio: Some(sum_mu * sum_mu / sum_mu_sq),
        participation_ratio_sv: Some(sum_s * sum_s / sum_mu),
        cum_energy_90: Some(u32::try_from(k).unwrap_or(u32::MAX)),
        nuclear_norm_ratio: Some(sum_s),
        effective_rank: Some(entropy.exp()),
    }
}
