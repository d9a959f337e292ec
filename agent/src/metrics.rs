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
mod tests {
    use super::*;

    const REL_TOL: f64 = 1e-5;

    fn options(max_rows: usize, centered: bool, conv_layout: ConvLayout) -> MatrixOptions {
        MatrixOptions {
            max_rows,
            centered,
            conv_layout,
            spectrum: SpectrumOptions::default(),
        }
    }

    /// Deterministic standard normals (Box–Muller), independent of libtorch's global RNG so
    /// parallel tests cannot disturb each other.
    fn gaussian(len: usize, seed: u64) -> Vec<f32> {
        super::gaussian(&mut SplitMix64(seed), len)
    }

    fn tensor(data: &[f32], shape: &[i64]) -> Tensor {
        Tensor::from_slice(data).reshape(shape)
    }

    fn close(actual: f64, expected: f64, tol: f64) -> bool {
        (actual - expected).abs() <= tol * expected.abs().max(1e-12)
    }

    /// The six metrics straight from the singular values of a float64 SVD, written out
    /// independently of [`spectral`].
    fn reference(matrix: &[f64], n: usize, d: usize, center: bool) -> Spectral {
        let mut a = matrix.to_vec();
        if center {
            for j in 0..d {
                let mean = (0..n).map(|i| a[i * d + j]).sum::<f64>() / n as f64;
                (0..n).for_each(|i| a[i * d + j] -= mean);
            }
        }
        let t = Tensor::from_slice(&a).reshape([n as i64, d as i64]);
        assert_eq!(t.kind(), Kind::Double);
        let (_, sv, _) = t.svd(true, false);
        let sv = Vec::<f64>::try_from(&sv).unwrap();
        let s1 = sv[0];
        let sum_s: f64 = sv.iter().sum();
        let sum_s2: f64 = sv.iter().map(|s| s * s).sum();
        let sum_s4: f64 = sv.iter().map(|s| s.powi(4)).sum();
        let mut acc = 0.0;
        let k = sv
            .iter()
            .position(|s| {
                acc += s * s;
                acc >= 0.9 * sum_s2
            })
            .unwrap()
            + 1;
        let entropy: f64 = sv
            .iter()
            .map(|s| s / sum_s)
            .filter(|&p| p > 0.0)
            .map(|p| -p * p.ln())
            .sum();
        Spectral {
            stable_rank: Some(sum_s2 / (s1 * s1)),
            participation_ratio: Some(sum_s2 * sum_s2 / sum_s4),
            participation_ratio_sv: Some(sum_s * sum_s / sum_s2),
            cum_energy_90: Some(k as u32),
            nuclear_norm_ratio: Some(sum_s / s1),
            effective_rank: Some(entropy.exp()),
        }
    }

    fn assert_matches(metrics: &LayerMetrics, expected: &Spectral, tol: f64, what: &str) {
        let pairs = [
            (
                "stable_rank",
                metrics.spectral.stable_rank,
                expected.stable_rank,
            ),
            (
                "participation_ratio",
                metrics.spectral.participation_ratio,
                expected.participation_ratio,
            ),
            (
                "participation_ratio_sv",
                metrics.spectral.participation_ratio_sv,
                expected.participation_ratio_sv,
            ),
            (
                "nuclear_norm_ratio",
                metrics.spectral.nuclear_norm_ratio,
                expected.nuclear_norm_ratio,
            ),
            (
                "effective_rank",
                metrics.spectral.effective_rank,
                expected.effective_rank,
            ),
        ];
        for (name, actual, expected) in pairs {
            let (actual, expected) = (actual.unwrap(), expected.unwrap());
            assert!(
                close(actual, expected, tol),
                "{what}: {name} = {actual}, expected {expected}"
            );
        }
        assert_eq!(
            metrics.spectral.cum_energy_90, expected.cum_energy_90,
            "{what}: cum_energy_90"
        );
    }

    fn assert_all(metrics: &LayerMetrics, value: f64, k: u32, tol: f64, what: &str) {
        let expected = Spectral {
            stable_rank: Some(value),
            participation_ratio: Some(value),
            participation_ratio_sv: Some(value),
            cum_energy_90: Some(k),
            nuclear_norm_ratio: Some(value),
            effective_rank: Some(value),
        };
        if value == 0.0 {
            assert_eq!(metrics.spectral, expected, "{what}");
        } else {
            assert_matches(metrics, &expected, tol, what);
        }
    }

    fn widen(data: &[f32]) -> Vec<f64> {
        data.iter().map(|&v| f64::from(v)).collect()
    }

    #[test]
    fn spectrum_method_follows_mode_threshold_and_size() {
        let auto = SpectrumOptions {
            mode: SpectrumMode::Auto,
            sketch_threshold: 1536,
        };
        assert_eq!(auto.method(4096, 1535), Method::Exact);
        assert_eq!(auto.method(4096, 1536), Method::Sketch);
        assert_eq!(auto.method(1536, 8192), Method::Sketch);
        assert_eq!(auto.method(64, 8192), Method::Exact);
        let sketch = SpectrumOptions {
            mode: SpectrumMode::Sketch,
            ..auto
        };
        assert_eq!(sketch.method(512, 512), Method::Sketch);
        assert_eq!(sketch.method(511, 4096), Method::Exact);
        let exact = SpectrumOptions {
            mode: SpectrumMode::Exact,
            ..auto
        };
        assert_eq!(exact.method(8192, 8192), Method::Exact);
        assert_eq!(
            (Method::Exact.label(), Method::Sketch.label()),
            ("exact", "sketch")
        );
        // Small matrices keep the exact path in auto mode.
        let m = compute(
            &Tensor::from_slice(&gaussian(64 * 32, 1)).reshape([64, 32]),
            &options(4096, false, ConvLayout::Channelwise),
            0,
        );
        assert_eq!(m.method, "exact");
    }

    #[test]
    fn matches_svd_for_2d_input() {
        for (seed, n, d) in [(1, 64, 12), (2, 10, 40), (3, 17, 17)] {
            let data = gaussian(n * d, seed);
            for center in [false, true] {
                let m = compute(
                    &tensor(&data, &[n as i64, d as i64]),
                    &options(4096, center, ConvLayout::Channelwise),
                    0,
                );
                assert_eq!(
                    (m.rows, m.cols, m.centered, m.conv_layout),
                    (n as u32, d as u32, center, "")
                );
                let expected = reference(&widen(&data), n, d, center);
                assert_matches(
                    &m,
                    &expected,
                    REL_TOL,
                    &format!("2-D {n}x{d} center={center}"),
                );
            }
        }
    }

    #[test]
    fn matches_svd_for_3d_input() {
        // (B, T, D) → (B·T, D): row-major, so the data is already in matrix order.
        for (seed, b, t, d) in [(4, 4, 16, 10), (5, 2, 3, 30)] {
            let data = gaussian(b * t * d, seed);
            for center in [false, true] {
                let m = compute(
                    &tensor(&data, &[b as i64, t as i64, d as i64]),
                    &options(4096, center, ConvLayout::Channelwise),
                    0,
                );
                assert_eq!(
                    (m.rows, m.cols, m.conv_layout),
                    ((b * t) as u32, d as u32, "")
                );
                let expected = reference(&widen(&data), b * t, d, center);
                assert_matches(
                    &m,
                    &expected,
                    REL_TOL,
                    &format!("3-D {b}x{t}x{d} center={center}"),
                );
            }
        }
    }

    #[test]
    fn matches_svd_for_4d_input_in_both_layouts() {
        for (seed, b, c, h, w) in [(6, 2, 6, 4, 5), (7, 3, 20, 2, 2), (8, 16, 2, 2, 2)] {
            let data = gaussian(b * c * h * w, seed);
            let at = |bi: usize, ci: usize, hi: usize, wi: usize| {
                f64::from(data[((bi * c + ci) * h + hi) * w + wi])
            };
            // Channelwise, built element by element rather than with permute.
            let mut channelwise = Vec::with_capacity(data.len());
            for bi in 0..b {
                for hi in 0..h {
                    for wi in 0..w {
                        for ci in 0..c {
                            channelwise.push(at(bi, ci, hi, wi));
                        }
                    }
                }
            }
            let activation = tensor(&data, &[b as i64, c as i64, h as i64, w as i64]);
            for center in [false, true] {
                let what = format!("4-D {b}x{c}x{h}x{w} center={center}");
                let m = compute(
                    &activation,
                    &options(4096, center, ConvLayout::Channelwise),
                    0,
                );
                assert_eq!(
                    (m.rows, m.cols, m.conv_layout),
                    ((b * h * w) as u32, c as u32, "channelwise")
                );
                assert_matches(
                    &m,
                    &reference(&channelwise, b * h * w, c, center),
                    REL_TOL,
                    &what,
                );

                let m = compute(&activation, &options(4096, center, ConvLayout::Flatten), 0);
                assert_eq!(
                    (m.rows, m.cols, m.conv_layout),
                    (b as u32, (c * h * w) as u32, "flatten")
                );
                assert_matches(
                    &m,
                    &reference(&widen(&data), b, c * h * w, center),
                    REL_TOL,
                    &what,
                );
            }
        }
    }

    #[test]
    fn zero_matrix_spans_no_dimension() {
        let m = compute(
            &Tensor::zeros([5, 3], (Kind::Float, Device::Cpu)),
            &options(4096, false, ConvLayout::Channelwise),
            0,
        );
        assert_all(&m, 0.0, 0, 0.0, "zero matrix");
        assert_eq!(
            (m.mean, m.std, m.zero_fraction, m.nonfinite),
            (Some(0.0), Some(0.0), Some(1.0), 0)
        );
    }

    #[test]
    fn rank_one_outer_product_is_one() {
        let u = Tensor::from_slice(&[1.0f32, -2.0, 0.5, 3.0, 1.5, -1.0, 2.0, 0.25]);
        let v = Tensor::from_slice(&[0.3f32, -1.2, 2.0, 0.7, -0.4]);
        let outer = u.unsqueeze(1).matmul(&v.unsqueeze(0));
        let m = compute(&outer, &options(4096, false, ConvLayout::Channelwise), 0);
        assert_eq!((m.rows, m.cols), (8, 5));
        assert_all(&m, 1.0, 1, 1e-6, "outer product");
        // Transposed, so that the Gram matrix of the other side is used.
        let m = compute(
            &outer.tr(),
            &options(4096, false, ConvLayout::Channelwise),
            0,
        );
        assert_all(&m, 1.0, 1, 1e-6, "outer product transposed");
    }

    #[test]
    fn single_row_is_rank_one_and_zero_once_centred() {
        let row = Tensor::from_slice(&[1.0f32, 2.0, -3.0, 0.5, 4.0, 0.0, -1.0]);
        let m = compute(&row, &options(4096, false, ConvLayout::Channelwise), 0);
        assert_eq!((m.rows, m.cols, m.conv_layout), (1, 7, ""));
        assert_all(&m, 1.0, 1, 1e-12, "one row");
        // Centring a single row leaves the zero matrix.
        let m = compute(&row, &options(4096, true, ConvLayout::Channelwise), 0);
        assert_all(&m, 0.0, 0, 0.0, "one row centred");
    }

    #[test]
    fn single_column_is_rank_one() {
        let column = Tensor::from_slice(&gaussian(9, 11)).reshape([9, 1]);
        let m = compute(&column, &options(4096, false, ConvLayout::Channelwise), 0);
        assert_eq!((m.rows, m.cols), (9, 1));
        assert_all(&m, 1.0, 1, 1e-12, "d = 1");
    }

    #[test]
    fn non_finite_input_has_no_spectrum_and_health_over_finite_values() {
        let x = Tensor::from_slice(&[1.0f32, f32::NAN, f32::INFINITY, 3.0, 0.0, f32::NEG_INFINITY])
            .reshape([3, 2]);
        let m = compute(&x, &options(4096, false, ConvLayout::Channelwise), 0);
        assert_eq!(m.spectral, Spectral::default());
        assert_eq!(m.nonfinite, 3);
        let (mean, var) = (
            4.0 / 3.0,
            ((1.0f64 - 4.0 / 3.0).powi(2) + (3.0f64 - 4.0 / 3.0).powi(2) + (4.0f64 / 3.0).powi(2))
                / 3.0,
        );
        assert!(close(m.mean.unwrap(), mean, 1e-12));
        assert!(close(m.std.unwrap(), var.sqrt(), 1e-12));
        assert!(close(m.zero_fraction.unwrap(), 1.0 / 3.0, 1e-12));

        let all_bad = Tensor::from_slice(&[f32::NAN, f32::INFINITY]).reshape([1, 2]);
        let m = compute(&all_bad, &options(4096, false, ConvLayout::Channelwise), 0);
        assert_eq!(m.nonfinite, 2);
        assert_eq!((m.mean, m.std, m.zero_fraction), (None, None, None));
        assert_eq!(m.spectral, Spectral::default());
    }

    #[test]
    fn empty_input_has_no_metrics() {
        for shape in [[0i64, 4], [3, 0]] {
            let m = compute(
                &Tensor::zeros(shape, (Kind::Float, Device::Cpu)),
                &options(4096, true, ConvLayout::Channelwise),
                0,
            );
            assert_eq!((m.rows as i64, m.cols as i64), (shape[0], shape[1]));
            assert_eq!(m.spectral, Spectral::default());
            assert_eq!(
                (m.mean, m.std, m.zero_fraction, m.nonfinite),
                (None, None, None, 0)
            );
        }
        let m = compute(
            &Tensor::new(),
            &options(4096, false, ConvLayout::Channelwise),
            0,
        );
        assert_eq!((m.rows, m.cols, m.mean), (0, 0, None));
    }

    #[test]
    fn health_on_a_known_tensor() {
        let x = Tensor::from_slice(&[0.0f32, 1.0, 2.0, -3.0]).reshape([2, 2]);
        let m = compute(&x, &options(4096, false, ConvLayout::Channelwise), 0);
        assert_eq!(m.mean, Some(0.0));
        // Population: sqrt((0 + 1 + 4 + 9) / 4).
        assert!(close(m.std.unwrap(), 3.5f64.sqrt(), 1e-15));
        assert_eq!(m.zero_fraction, Some(0.25));
        assert_eq!(m.nonfinite, 0);
    }

    #[test]
    fn row_cap_samples_reproducibly() {
        let data = gaussian(200 * 6, 21);
        let x = tensor(&data, &[200, 6]);
        let opts = options(50, false, ConvLayout::Channelwise);
        let seed = sample_seed("run-a", 0, 10, "encoder.0");
        let first = compute(&x, &opts, seed);
        assert_eq!((first.rows, first.cols), (50, 6));
        assert_eq!(compute(&x, &opts, seed), first);
        let other = compute(&x, &opts, sample_seed("run-a", 0, 11, "encoder.0"));
        assert_eq!(other.rows, 50);
        assert_ne!(other.spectral.stable_rank, first.spectral.stable_rank);
        // At or under the cap nothing is sampled.
        assert_eq!(
            compute(&x, &options(200, false, ConvLayout::Channelwise), seed).rows,
            200
        );
        assert_eq!(
            compute(&x, &options(0, false, ConvLayout::Channelwise), seed).rows,
            200
        );
    }

    #[test]
    fn sample_rows_picks_distinct_rows_in_order() {
        let n = 1000;
        let x = Tensor::arange(n, (Kind::Int64, Device::Cpu)).unsqueeze(1);
        let picked =
            Vec::<i64>::try_from(&sample_rows(&x, 100, 7).unwrap().squeeze_dim(1)).unwrap();
        assert_eq!(picked.len(), 100);
        assert!(
            picked.windows(2).all(|w| w[0] < w[1]),
            "sorted and distinct"
        );
        assert!(picked.iter().all(|&i| (0..n).contains(&i)));
        assert_eq!(sample_rows(&x, 1000, 7).unwrap().size(), [1000, 1]);
    }

    #[test]
    fn row_choice_is_uniform() {
        let (n, k, trials) = (10u64, 3u64, 30_000u64);
        let mut counts = vec![0u64; n as usize];
        for seed in 0..trials {
            for i in choose_rows(n, k, seed) {
                counts[i as usize] += 1;
            }
        }
        let expected = (trials * k / n) as f64;
        for (row, &count) in counts.iter().enumerate() {
            assert!(
                (count as f64 - expected).abs() < 0.05 * expected,
                "row {row}: {count} vs {expected}"
            );
        }
        assert_eq!(choose_rows(5, 5, 1), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn sample_seed_is_stable() {
        assert_eq!(
            sample_seed("run-a", 3, 1200, "encoder.layers.0.mlp"),
            SAMPLE_SEED_FIXTURE
        );
        assert_ne!(sample_seed("ab", 0, 0, "c"), sample_seed("a", 0, 0, "bc"));
        assert_ne!(sample_seed("run", 0, 1, "x"), sample_seed("run", 1, 0, "x"));
    }

    // Checked against an independent FNV-1a implementation.
    const SAMPLE_SEED_FIXTURE: u64 = 16_571_397_616_691_456_807;

    #[test]
    fn spectral_of_known_spectra() {
        // λ = (4, 1): σ = (2, 1).
        let s = spectral(&[1.0, 4.0]);
        assert!(close(s.stable_rank.unwrap(), 1.25, 1e-15));
        assert!(close(s.participation_ratio.unwrap(), 25.0 / 17.0, 1e-15));
        assert!(close(s.participation_ratio_sv.unwrap(), 9.0 / 5.0, 1e-15));
        assert_eq!(s.cum_energy_90, Some(2));
        assert!(close(s.nuclear_norm_ratio.unwrap(), 1.5, 1e-15));
        let (p, q) = (2.0f64 / 3.0, 1.0f64 / 3.0);
        assert!(close(
            s.effective_rank.unwrap(),
            (-(p * p.ln()) - q * q.ln()).exp(),
            1e-15
        ));
        // Equal eigenvalues: every ratio is their count.
        let s = spectral(&[2.0; 4]);
        assert!(close(s.stable_rank.unwrap(), 4.0, 1e-15));
        assert!(close(s.effective_rank.unwrap(), 4.0, 1e-12));
        assert_eq!(s.cum_energy_90, Some(4));
    }

    #[test]
    fn spectral_edge_cases() {
        assert_eq!(spectral(&[]), Spectral::default());
        assert_eq!(spectral(&[1.0, f64::NAN]), Spectral::default());
        assert_eq!(spectral(&[f64::INFINITY]), Spectral::default());
        assert_eq!(spectral(&[0.0, 0.0, -1e-300]), Spectral::zero());
        // Round-off negatives and noise are zero; order does not matter.
        assert_eq!(spectral(&[-1e-17, 3.0, 1e-17]), spectral(&[3.0, 0.0, 0.0]));
        let one = spectral(&[3.0, 0.0, 0.0]);
        assert_eq!(one.stable_rank, Some(1.0));
        assert_eq!(one.effective_rank, Some(1.0));
        assert_eq!(one.cum_energy_90, Some(1));
        // Exactly 90 % in the first three: 0.9·Σ rounds above the cumulative sum without the
        // tolerance.
        assert_eq!(spectral(&[0.3, 0.3, 0.3, 0.1]).cum_energy_90, Some(3));
        assert_eq!(spectral(&[9.0, 1.0]).cum_energy_90, Some(1));
    }

    #[test]
    fn matrix_shapes_and_layout_labels() {
        let shape = |t: &Tensor, layout| {
            let (m, label) = to_matrix(t, layout).unwrap();
            (m.size(), label)
        };
        let zeros = |s: &[i64]| Tensor::zeros(s, (Kind::Float, Device::Cpu));
        assert_eq!(
            shape(&zeros(&[]), ConvLayout::Channelwise),
            (vec![1, 1], "")
        );
        assert_eq!(
            shape(&zeros(&[7]), ConvLayout::Channelwise),
            (vec![1, 7], "")
        );
        assert_eq!(
            shape(&zeros(&[3, 7]), ConvLayout::Flatten),
            (vec![3, 7], "")
        );
        assert_eq!(
            shape(&zeros(&[2, 3, 7]), ConvLayout::Channelwise),
            (vec![6, 7], "")
        );
        assert_eq!(
            shape(&zeros(&[2, 3, 4, 5]), ConvLayout::Channelwise),
            (vec![40, 3], "channelwise")
        );
        assert_eq!(
            shape(&zeros(&[2, 3, 4, 5]), ConvLayout::Flatten),
            (vec![2, 60], "flatten")
        );
        assert_eq!(
            shape(&zeros(&[2, 3, 4, 5, 6]), ConvLayout::Channelwise),
            (vec![2, 360], "")
        );
        assert_eq!(
            shape(&zeros(&[0, 3, 4, 5, 6]), ConvLayout::Flatten),
            (vec![0, 360], "")
        );
        for layout in [ConvLayout::Channelwise, ConvLayout::Flatten] {
            assert_eq!(ConvLayout::parse(layout.label()), Some(layout));
        }
        assert_eq!(ConvLayout::parse("Flatten"), None);
        assert_eq!(ConvLayout::default(), ConvLayout::Channelwise);
    }
}
