//! The spectral and health metrics of one activation, exactly as `docs/metrics.md` defines
//! them.
//!
//! The pipeline ([`compute`]) has two typed steps. [`prepare`]: activation → matrix
//! ([`to_matrix`]) → row sample ([`sample_rows`]), giving a [`Sample`]; in the agent it runs
//! once, on the training thread, which hands the sample to the metrics thread. [`measure`]:
//! float64 on the sample's own device → health metrics → optional centring → the spectrum
//! → [`spectral`]; the metrics thread runs only this. The spectrum is [`Method::Exact`]
//! (eigenvalues of the Gram matrix of the smaller side: one Gram product and one symmetric
//! eigen-solve serve all six columns; no SVD, which is two orders of magnitude slower on CPU)
//! or, for matrices with at least [`SpectrumOptions::sketch_threshold`] rows and columns,
//! [`Method::Sketch`] ([`sketch_spectral`]: randomized block Krylov estimates, whose errors
//! `docs/metrics.md` states).
//! [`LayerMetrics::into_layer_row`] is the one place the metrics become a `layers` row.
//!
//! # From an activation to a matrix A (n rows = samples, d columns = features)
//!
//! | activation | matrix |
//! |---|---|
//! | `()` (a scalar) | `(1, 1)` |
//! | `(D)` | `(1, D)` |
//! | `(B, D)` | as is |
//! | `(B, T, D)` | `(B·T, D)` |
//! | `(B, C, H, W)` | [`ConvLayout::Channelwise`]: `(B·H·W, C)`; [`ConvLayout::Flatten`]: `(B, C·H·W)` |
//! | anything else | `(B, product of the rest)` |
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
//! - **Non-finite input** (any NaN or ±Inf in the sample): the spectral columns are `None`,
//!   `nonfinite` counts the bad elements, and mean / std / zero_fraction are computed over the
//!   finite elements only (`None` if there are none).
//! - **Empty input** (n = 0 or d = 0): every metric is `None`; `rows` and `cols` say why.
//! - `std` is the population standard deviation; `zero_fraction` counts exact zeros (dead
//!   ReLU units).
//!
//! # Row sampling
//!
//! Beyond `max_rows` rows, rows are drawn uniformly without replacement (a partial
//! Fisher–Yates shuffle driven by splitmix64) with a seed from [`sample_seed`], a FNV-1a hash
//! of (run, rank, step, layer). The same run therefore gives the same numbers on every
//! machine and in every process, which Rust's randomly keyed `std` hasher would not.

use std::collections::HashMap;

use rankscope_proto::v1::LayerRow;
use tch::{Device, Kind, TchError, Tensor};

pub use crate::sketch::SKETCH_MIN_SIDE;
use crate::sketch::sketch_spectral;

pub use crate::config::SpectrumMode;

/// How a 4-D (B, C, H, W) activation becomes a matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ConvLayout {
    /// Every spatial position is a sample of the C channel features: (B·H·W, C).
    #[default]
    Channelwise,
    /// One row per example, NDT's convention: (B, C·H·W).
    Flatten,
}

impl ConvLayout {
    /// The name used in configuration and in the `conv_layout` column.
    pub fn label(self) -> &'static str {
        match self {
            ConvLayout::Channelwise => "channelwise",
            ConvLayout::Flatten => "flatten",
        }
    }

    /// The inverse of [`ConvLayout::label`]; anything else is `None`.
    pub fn parse(s: &str) -> Option<ConvLayout> {
        match s {
            "channelwise" => Some(ConvLayout::Channelwise),
            "flatten" => Some(ConvLayout::Flatten),
            _ => None,
        }
    }
}

/// Options of the activation → matrix step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MatrixOptions {
    /// Row cap; rows beyond it are sampled. 0 means no cap.
    pub max_rows: usize,
    /// Subtract column means before the spectrum (covariance convention) or not (NDT's).
    pub centered: bool,
    /// How 4-D activations become matrices.
    pub conv_layout: ConvLayout,
    /// Exact or sketched spectrum.
    pub spectrum: SpectrumOptions,
}

/// Which computation gives the spectral columns (see `docs/metrics.md`, "Sketch mode").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpectrumOptions {
    pub mode: SpectrumMode,
    /// `auto` sketches a matrix whose rows and columns are both at least this many.
    pub sketch_threshold: usize,
}

impl Default for SpectrumOptions {
    fn default() -> Self {
        SpectrumOptions {
            mode: SpectrumMode::Auto,
            sketch_threshold: crate::config::DEFAULT_SKETCH_THRESHOLD,
        }
    }
}

/// The computation that produced a row's spectral columns (the `method` column).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// The Gram matrix of the smaller side and a symmetric eigen-solve, in float64.
    Exact,
    /// Randomized block Krylov in float32 ([`sketch_spectral`]).
    Sketch,
}

impl Method {
    /// The value of the `method` column.
    pub fn label(self) -> &'static str {
        match self {
            Method::Exact => "exact",
            Method::Sketch => "sketch",
        }
    }
}

/// Elements per block of the float64 health sums: a 2 MiB float64 copy, which stays in
/// cache for the sum and the dot product that read it (2¹⁸ elements took a third of the CPU
/// time of 2²⁰ at 2,048 × 4,096, where each block was also squared into a second copy).
const HEALTH_BLOCK: i64 = 1 << 18;

impl SpectrumOptions {
    /// The method for a matrix of `rows` × `cols`.
    pub fn method(&self, rows: i64, cols: i64) -> Method {
        let side = rows.min(cols);
        let threshold = i64::try_from(self.sketch_threshold).unwrap_or(i64::MAX);
        match self.mode {
            _ if side < SKETCH_MIN_SIDE => Method::Exact,
            SpectrumMode::Exact => Method::Exact,
            SpectrumMode::Sketch => Method::Sketch,
            SpectrumMode::Auto if side >= threshold => Method::Sketch,
            SpectrumMode::Auto => Method::Exact,
        }
    }
}

/// Everything one layers row needs besides identity and timing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerMetrics {
    /// Rows of the matrix actually measured (after sampling), saturating at `u32::MAX`.
    pub rows: u32,
    /// Columns of the matrix, saturating at `u32::MAX`.
    pub cols: u32,
    /// Whether column means were subtracted before the spectrum.
    pub centered: bool,
    /// `"channelwise"` or `"flatten"` for a 4-D activation, `""` otherwise.
    pub conv_layout: &'static str,
    /// `"exact"` or `"sketch"`: what computed the spectral columns; `""` when they are null.
    pub method: &'static str,
    /// The six spectral columns.
    pub spectral: Spectral,
    pub mean: Option<f64>,
    /// Population standard deviation.
    pub std: Option<f64>,
    /// Exact zeros over the number of (finite) elements.
    pub zero_fraction: Option<f64>,
    /// NaN and ±Inf elements in the sample.
    pub nonfinite: u64,
}

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

/// Relative slack on the 90 % energy threshold, so that summation rounding cannot push the
/// answer one eigenvalue further.
pub(crate) const CUM_ENERGY_REL_TOL: f64 = 1e-12;

/// Reshapes an activation into the matrix the metrics are defined on (see the module table)
/// and returns it with the `conv_layout` label used (`""` unless the input is 4-D). An
/// undefined tensor gives an empty (0, 0) matrix. A libtorch failure (out of memory while
/// copying a permuted tensor) is returned, never a panic.
pub fn to_matrix(
    activation: &Tensor,
    layout: ConvLayout,
) -> Result<(Tensor, &'static str), TchError> {
    if !activation.defined() {
        return Ok((Tensor::f_zeros([0, 0], (Kind::Float, Device::Cpu))?, ""));
    }
    // Explicit sizes rather than -1: reshape cannot infer -1 for an empty tensor.
    let matrix = match activation.size().as_slice() {
        [] => activation.f_reshape([1, 1])?,
        &[d] => activation.f_reshape([1, d])?,
        [_, _] => activation.shallow_clone(),
        &[b, t, d] => activation.f_reshape([b * t, d])?,
        &[b, c, h, w] => {
            return Ok(match layout {
                ConvLayout::Channelwise => (
                    activation
                        .f_permute([0, 2, 3, 1])?
                        .f_reshape([b * h * w, c])?,
                    layout.label(),
                ),
                ConvLayout::Flatten => (activation.f_reshape([b, c * h * w])?, layout.label()),
            });
        }
        [b, rest @ ..] => activation.f_reshape([*b, rest.iter().product()])?,
    };
    Ok((matrix, ""))
}

/// The sampling seed of one (run, rank, step, layer): FNV-1a 64 over length-prefixed fields,
/// so it is the same in every process and on every platform, and `("ab", "c")` differs from
/// `("a", "bc")`. Changing this function changes every sampled metric: don't.
pub fn sample_seed(run_id: &str, rank: u32, step: u64, layer: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET;
    let mut feed = |bytes: &[u8]| {
        for &byte in bytes {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(PRIME);
        }
    };
    feed(&(run_id.len() as u64).to_le_bytes());
    feed(run_id.as_bytes());
    feed(&rank.to_le_bytes());
    feed(&step.to_le_bytes());
    feed(&(layer.len() as u64).to_le_bytes());
    feed(layer.as_bytes());
    hash
}

/// Keeps `max_rows` rows drawn uniformly without replacement (in their original order) when
/// the matrix has more; otherwise returns it unchanged. `max_rows == 0` means no cap. The
/// selection runs on the tensor's own device; a libtorch failure (out of memory) is returned.
pub fn sample_rows(matrix: &Tensor, max_rows: usize, seed: u64) -> Result<Tensor, TchError> {
    if !matrix.defined() || matrix.dim() == 0 {
        return Ok(matrix.shallow_clone());
    }
    let n = matrix.size()[0].max(0) as u64;
    if max_rows == 0 || n <= max_rows as u64 {
        return Ok(matrix.shallow_clone());
    }
    let indices = choose_rows(n, max_rows as u64, seed);
    let index = Tensor::f_from_slice(&indices)?.f_to_device(matrix.device())?;
    matrix.f_index_select(0, &index)
}

/// `k` distinct indices of `0..n`, sorted, uniformly: a partial Fisher–Yates shuffle of the
/// virtual array `0..n` that stores only the displaced entries, so it costs O(k) however
/// large n is.
fn choose_rows(n: u64, k: u64, seed: u64) -> Vec<i64> {
    let k = k.min(n);
    let mut rng = SplitMix64(seed);
    let mut displaced: HashMap<u64, u64> = HashMap::with_capacity(k as usize);
    let mut chosen = Vec::with_capacity(k as usize);
    for i in 0..k {
        let j = i + rng.below(n - i);
        let at_i = displaced.get(&i).copied().unwrap_or(i);
        let at_j = displaced.get(&j).copied().unwrap_or(j);
        chosen.push(at_j as i64);
        // Position i is never read again; position j now holds what was at i.
        displaced.insert(j, at_i);
    }
    chosen.sort_unstable();
    chosen
}

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

    /// Uniform in `0..bound` (bound > 0), without modulo bias (Lemire's method).
    fn below(&mut self, bound: u64) -> u64 {
        let threshold = bound.wrapping_neg() % bound;
        loop {
            let product = u128::from(self.next_u64()) * u128::from(bound);
            if (product as u64) >= threshold {
                return (product >> 64) as u64;
            }
        }
    }
}

/// An activation made ready for [`measure`]: the matrix of the module table, its rows
/// sampled down to the cap.
#[derive(Debug)]
pub struct Sample {
    /// At most `max_rows` rows.
    pub matrix: Tensor,
    /// `"channelwise"` or `"flatten"` for a 4-D activation, `""` otherwise.
    pub conv_layout: &'static str,
    /// The sampling seed; the sketch draws its random vectors from it too.
    pub seed: u64,
}

impl Sample {
    /// A detached copy of the sample's own, so later in-place changes to the
    /// activation (by training) cannot reach it.
    pub fn to_owned_copy(&self) -> Result<Sample, TchError> {
        Ok(Sample {
            matrix: self.matrix.f_detach_copy()?,
            conv_layout: self.conv_layout,
            seed: self.seed,
        })
    }
}

/// The first step: activation → matrix → row sample, on the activation's own device.
pub fn prepare(
    activation: &Tensor,
    options: &MatrixOptions,
    seed: u64,
) -> Result<Sample, TchError> {
    let (matrix, conv_layout) = to_matrix(activation, options.conv_layout)?;
    let matrix = sample_rows(&matrix, options.max_rows, seed)?;
    Ok(Sample {
        matrix,
        conv_layout,
        seed,
    })
}

/// The second step: the metrics of a prepared sample, on its own device, with or without
/// centring, with the spectrum method `spectrum` picks. Never panics: a libtorch failure
/// (which valid input does not cause) is logged and leaves the columns it prevented at `None`.
pub fn measure(sample: &Sample, centered: bool, spectrum: &SpectrumOptions) -> LayerMetrics {
    let _guard = tch::no_grad_guard();
    let mut metrics = LayerMetrics {
        centered,
        conv_layout: sample.conv_layout,
        ..LayerMetrics::default()
    };
    if let Err(error) = measure_matrix(
        &sample.matrix,
        centered,
        spectrum,
        sample.seed,
        &mut metrics,
    ) {
        tracing::warn!(%error, "activation metrics failed");
        metrics.spectral = Spectral::default();
        metrics.method = "";
    }
    metrics
}

/// Both steps, [`prepare`] and [`measure`], for callers that hold the whole activation (the
/// `spectrum` command, the benchmarks). Never panics: a failure to prepare gives the empty
/// metrics, logged.
pub fn compute(activation: &Tensor, options: &MatrixOptions, seed: u64) -> LayerMetrics {
    let _guard = tch::no_grad_guard();
    match prepare(activation, options, seed) {
        Ok(sample) => measure(&sample, options.centered, &options.spectrum),
        Err(error) => {
            tracing::warn!(%error, "activation metrics failed");
            LayerMetrics {
                centered: options.centered,
                ..LayerMetrics::default()
            }
        }
    }
}

impl LayerMetrics {
    /// The `layers` row of these metrics: the one place the two are mapped.
    pub fn into_layer_row(self, step: u64, time: i64, layer: String, compute_ms: f64) -> LayerRow {
        let Spectral {
            stable_rank,
            participation_ratio,
            participation_ratio_sv,
            cum_energy_90,
            nuclear_norm_ratio,
            effective_rank,
        } = self.spectral;
        LayerRow {
            step,
            time,
            layer,
            rows: self.rows,
            cols: self.cols,
            centered: self.centered,
            stable_rank,
            participation_ratio,
            participation_ratio_sv,
            cum_energy_90,
            nuclear_norm_ratio,
            effective_rank,
            mean: self.mean,
            std: self.std,
            zero_fraction: self.zero_fraction,
            nonfinite: self.nonfinite,
            compute_ms,
            conv_layout: self.conv_layout.to_string(),
            method: self.method.to_string(),
        }
    }
}

fn measure_matrix(
    matrix: &Tensor,
    centered: bool,
    spectrum: &SpectrumOptions,
    seed: u64,
    out: &mut LayerMetrics,
) -> Result<(), TchError> {
    let (n, d) = match matrix.size().as_slice() {
        &[n, d] => (n, d),
        _ => return Ok(()),
    };
    out.rows = u32::try_from(n).unwrap_or(u32::MAX);
    out.cols = u32::try_from(d).unwrap_or(u32::MAX);
    if n == 0 || d == 0 {
        return Ok(());
    }
    let numel = matrix.numel() as u64;
    // Σx and Σx² in float64, over blocks of about 2¹⁸ elements cast one at a
    // time (a float64 copy of the whole matrix costs more than the sums), with one
    // device → host transfer for all. A NaN or ±Inf anywhere makes Σx non-finite (in
    // float64 the sum of finite float32 values cannot overflow), so finite input needs no
    // isfinite pass.
    let block_rows = (HEALTH_BLOCK / d).max(1);
    let mut partial = Vec::new();
    for start in (0..n).step_by(block_rows as usize) {
        let block = matrix.f_narrow(0, start, block_rows.min(n - start))?;
        let wide = block.f_to_kind(Kind::Double)?.f_reshape([-1])?;
        partial.push(Tensor::f_stack(
            &[
                wide.f_sum(Kind::Double)?,
                // A float64 dot product: no squared copy of the block.
                wide.f_dot(&wide)?,
            ],
            0,
        )?);
    }
    // The zeros in one pass over the whole matrix: per block it cost twice as much.
    let health = to_host(&Tensor::f_cat(
        &[
            Tensor::f_stack(&partial, 0)?.f_sum_dim_intlist(0, false, Kind::Double)?,
            matrix
                .f_count_nonzero(None::<i64>)?
                .f_to_kind(Kind::Double)?
                .f_reshape([1])?,
        ],
        0,
    )?)?;
    let (sum, sum_sq, nonzero) = (health[0], health[1], health[2]);
    if !(sum.is_finite() && sum_sq.is_finite()) {
        return measure_nonfinite(&matrix.f_to_kind(Kind::Double)?, out);
    }
    let n_values = numel as f64;
    let mean = sum / n_values;
    out.mean = Some(mean);
    // Population variance as E[x²] − mean², in float64: exact enough unless the
    // mean exceeds the spread by about 10⁶, far beyond any activation's.
    out.std = Some((sum_sq / n_values - mean * mean).max(0.0).sqrt());
    out.zero_fraction = Some((n_values - nonzero) / n_values);

    let method = spectrum.method(n, d);
    out.spectral = match method {
        Method::Exact => {
            let x = matrix.f_to_kind(Kind::Double)?;
            let x = if centered {
                x.f_sub(&x.f_mean_dim(0i64, true, Kind::Double)?)?
            } else {
                x
            };
            // The Gram matrix of the smaller side has the same non-zero eigenvalues and
            // costs less.
            let gram = if d <= n {
                x.f_tr()?.f_matmul(&x)?
            } else {
                x.f_matmul(&x.f_tr()?)?
            };
            spectral(&to_host(&gram.f_linalg_eigvalsh("L")?)?)
        }
        Method::Sketch => {
            let a = matrix.f_to_kind(Kind::Float)?;
            if centered {
                let a = a.f_sub(&a.f_mean_dim(0i64, true, Kind::Float)?)?;
                let trace = to_host(&a.f_norm()?.f_square()?.f_reshape([1])?)?[0];
                sketch_spectral(&a, trace, seed)?
            } else {
                sketch_spectral(&a, sum_sq, seed)?
            }
        }
    };
    out.method = method.label();
    Ok(())
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

/// Health over the finite values of a matrix that holds NaN or ±Inf; no spectrum.
fn measure_nonfinite(x: &Tensor, out: &mut LayerMetrics) -> Result<(), TchError> {
    let finite = x.f_isfinite()?;
    let values = x.f_masked_select(&finite)?;
    let finite_count = values.numel() as u64;
    out.nonfinite = (x.numel() as u64).saturating_sub(finite_count);
    if finite_count > 0 {
        let health = to_host(&Tensor::f_stack(
            &[
                values.f_mean(Kind::Double)?,
                values.f_std(false)?,
                values.f_eq(0.0)?.f_sum(Kind::Double)?,
            ],
            0,
        )?)?;
        out.mean = Some(health[0]);
        out.std = Some(health[1]);
        out.zero_fraction = Some(health[2] / finite_count as f64);
    }
    Ok(())
}

/// A small 1-D float64 tensor's values on the host.
pub(crate) fn to_host(t: &Tensor) -> Result<Vec<f64>, TchError> {
    Vec::<f64>::try_from(&t.f_to_device(Device::Cpu)?.f_to_kind(Kind::Double)?)
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

#[cfg(test)]
mod tests;
