//! Seeded matrices with the kinds of spectra the sketch is measured on (its tests and
//! `rankscope bench --spectrum`): the same matrix for the same seed on every machine;
//! [`oracle_family`], a seeded random draw of them; and the exact-against-sketch
//! comparison ([`compare`]).

use tch::{Kind, TchError, Tensor};

use super::gram::GramOperator;
use super::measure::measure_with;
use super::options::{SketchPolicy, SpectrumMode, SpectrumOptions};
use super::sketch::{SketchGoal, sketch_spectral};
use super::spectral::{SplitMix64, gaussian};

/// A kind of singular-value spectrum.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SpectrumKind {
    /// Independent standard normal entries: a flat (Marchenko–Pastur) spectrum.
    Flat,
    /// Column j (from 1) scaled by j^(−α/2): eigenvalues decaying about as i^(−α).
    PowerLaw(f64),
    /// Exactly `directions` non-zero singular values σᵢ = i^(−α/2) (eigenvalues i^(−α)),
    /// along random orthonormal directions: a power law over that many directions, rank
    /// `directions`.
    PowerLawOver { directions: i64, alpha: f64 },
    /// A rank-r signal (entries of variance 9) plus standard normal noise scaled by 0.3.
    LowRankPlusNoise(i64),
    /// `directions` singular values `ratio` to 2·`ratio` times the top of a flat bulk
    /// (standard normal noise), along random orthonormal directions: a spectrum with a gap.
    Gap { directions: i64, ratio: f64 },
    /// The ReLU of a random projection of `inputs`-dimensional Gaussian data: ReLU(X·W),
    /// X (rows × inputs) and W (inputs × cols) standard normal, W scaled by 1/√inputs.
    ReluProjection(i64),
    /// Power law with α = 0.5 and three columns 50× larger: the outlier features of
    /// transformer activations.
    Outliers,
}

impl SpectrumKind {
    /// The kinds reported in `docs/metrics.md` before the error estimates.
    pub const ALL: [SpectrumKind; 7] = [
        SpectrumKind::Flat,
        SpectrumKind::PowerLaw(0.5),
        SpectrumKind::PowerLaw(1.0),
        SpectrumKind::PowerLaw(2.0),
        SpectrumKind::LowRankPlusNoise(16),
        SpectrumKind::LowRankPlusNoise(256),
        SpectrumKind::Outliers,
    ];

    /// The four kinds of the issue that asked for the error estimates, at 2,048 × 4,096: a
    /// flat spectrum, a power law over 512 directions, low rank plus noise, and the ReLU of a
    /// random projection.
    pub const ISSUE: [SpectrumKind; 4] = [
        SpectrumKind::Flat,
        SpectrumKind::PowerLawOver {
            directions: 512,
            alpha: 2.0,
        },
        SpectrumKind::LowRankPlusNoise(64),
        SpectrumKind::ReluProjection(256),
    ];

    /// What `rankscope bench --spectrum` measures: [`SpectrumKind::ALL`], then the kinds of
    /// [`SpectrumKind::ISSUE`] not among them, and a spectrum with a gap.
    pub const BENCH: [SpectrumKind; 11] = [
        SpectrumKind::Flat,
        SpectrumKind::PowerLaw(0.5),
        SpectrumKind::PowerLaw(1.0),
        SpectrumKind::PowerLaw(2.0),
        SpectrumKind::LowRankPlusNoise(16),
        SpectrumKind::LowRankPlusNoise(256),
        SpectrumKind::Outliers,
        SpectrumKind::PowerLawOver {
            directions: 512,
            alpha: 2.0,
        },
        SpectrumKind::LowRankPlusNoise(64),
        SpectrumKind::ReluProjection(256),
        SpectrumKind::Gap {
            directions: 32,
            ratio: 3.0,
        },
    ];

    /// A short name for tables.
    pub fn name(self) -> String {
        match self {
            SpectrumKind::Flat => "flat".into(),
            SpectrumKind::PowerLaw(a) => format!("power law α={a}"),
            SpectrumKind::PowerLawOver { directions, alpha } => {
                format!("power law α={alpha} over {directions} directions")
            }
            SpectrumKind::LowRankPlusNoise(r) => format!("rank {r} + noise"),
            SpectrumKind::Gap { directions, ratio } => {
                format!("gap: {directions} directions {ratio}× the bulk")
            }
            SpectrumKind::ReluProjection(k) => format!("ReLU of a {k}-dim projection"),
            SpectrumKind::Outliers => "outlier features".into(),
        }
    }

    /// A float32 `rows` × `cols` matrix of this kind on the CPU, from `seed`.
    pub fn matrix(self, rows: i64, cols: i64, seed: u64) -> Result<Tensor, TchError> {
        let mut rng = SplitMix64(seed);
        let mut normal = |r: i64, c: i64| -> Result<Tensor, TchError> {
            Tensor::f_from_slice(&gaussian(&mut rng, (r * c) as usize))?.f_reshape([r, c])
        };
        let column_scale = |alpha: f64| -> Result<Tensor, TchError> {
            Tensor::f_arange_start(1, cols + 1, (Kind::Float, tch::Device::Cpu))?
                .f_pow_tensor_scalar(-alpha / 2.0)
        };
        // U·diag(σ)·Vᵀ with U, V random orthonormal (float64 QR), as float32.
        let orthonormal_product =
            |sigma: &Tensor, u: Tensor, v: Tensor| -> Result<Tensor, TchError> {
                let u = Tensor::f_linalg_qr(&u.f_to_kind(Kind::Double)?, "reduced")?.0;
                let v = Tensor::f_linalg_qr(&v.f_to_kind(Kind::Double)?, "reduced")?.0;
                u.f_mul(sigma)?.f_matmul(&v.f_tr()?)?.f_to_kind(Kind::Float)
            };
        match self {
            SpectrumKind::Flat => normal(rows, cols),
            SpectrumKind::PowerLaw(alpha) => normal(rows, cols)?.f_mul(&column_scale(alpha)?),
            SpectrumKind::PowerLawOver { directions, alpha } => {
                let k = directions.clamp(1, rows.min(cols));
                let sigma = Tensor::f_arange_start(1, k + 1, (Kind::Double, tch::Device::Cpu))?
                    .f_pow_tensor_scalar(-alpha / 2.0)?;
                orthonormal_product(&sigma, normal(rows, k)?, normal(cols, k)?)
            }
            SpectrumKind::LowRankPlusNoise(rank) => {
                let noise = normal(rows, cols)?;
                let left = normal(rows, rank)?;
                let right = normal(rank, cols)?;
                left.f_matmul(&right)?
                    .f_mul_scalar(3.0 / (rank as f64).sqrt())?
                    .f_add(&noise.f_mul_scalar(0.3)?)
            }
            SpectrumKind::Gap { directions, ratio } => {
                let noise = normal(rows, cols)?;
                let k = directions.clamp(1, rows.min(cols));
                // The bulk's top singular value is about √rows + √cols.
                let edge = (rows as f64).sqrt() + (cols as f64).sqrt();
                let sigma = Tensor::f_linspace(
                    2.0 * ratio * edge,
                    ratio * edge,
                    k,
                    (Kind::Double, tch::Device::Cpu),
                )?;
                orthonormal_product(&sigma, normal(rows, k)?, normal(cols, k)?)?.f_add(&noise)
            }
            SpectrumKind::ReluProjection(inputs) => {
                let x = normal(rows, inputs)?;
                let w = normal(inputs, cols)?.f_mul_scalar(1.0 / (inputs as f64).sqrt())?;
                x.f_matmul(&w)?.f_relu()
            }
            SpectrumKind::Outliers => {
                let noise = normal(rows, cols)?;
                let scale = column_scale(0.5)?;
                for column in [7, 100, 900].into_iter().filter(|&c| c < cols) {
                    let _ = scale.f_get(column)?.f_mul_scalar_(50.0)?;
                }
                noise.f_mul(&scale)
            }
        }
    }
}

/// `count` kinds drawn from `seed` for matrices whose smaller side is `side`: power laws
/// over 64 to min(1,024, `side`) directions (log-uniform) with exponents 0.3 to 2, spectra
/// with a gap (4 to 256 directions, 1.5 to 30 times the bulk), and full-rank power laws,
/// low rank plus noise and ReLU projections with random parameters, in turn.
pub fn oracle_family(count: usize, seed: u64, side: i64) -> Vec<SpectrumKind> {
    let mut rng = SplitMix64(seed ^ 0x0a1c_1e00_0000_0001);
    let mut uniform = |low: f64, high: f64| {
        low + (high - low) * ((rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    };
    let round2 = |x: f64| (x * 100.0).round() / 100.0;
    (0..count)
        .map(|i| match i % 4 {
            0 | 1 => SpectrumKind::PowerLawOver {
                directions: uniform(64f64.ln(), (1024.min(side) as f64).ln())
                    .exp()
                    .round() as i64,
                alpha: round2(uniform(0.3, 2.0)),
            },
            2 => SpectrumKind::Gap {
                directions: uniform(4.0, 256.0).round() as i64,
                ratio: round2(uniform(1.5, 30.0)),
            },
            _ => match (uniform(0.0, 3.0) as usize).min(2) {
                0 => SpectrumKind::PowerLaw(round2(uniform(0.3, 2.0))),
                1 => SpectrumKind::LowRankPlusNoise(uniform(8.0, 512.0).round() as i64),
                _ => SpectrumKind::ReluProjection(uniform(64.0, 2048.0).round() as i64),
            },
        })
        .collect()
}

/// One side-by-side measurement of the exact and the sketched spectrum of one matrix.
#[derive(Debug, Clone)]
pub struct Comparison {
    pub kind: SpectrumKind,
    /// Median CPU seconds of this thread for [`super::measure::measure`] with each method:
    /// the exact path; the sketch as the agent runs it (every column, deep enough to vouch
    /// for each, the exact path where it cannot), the fallback included; and the sketch run
    /// only as deep as `stable_rank` and `participation_ratio` need.
    pub exact_cpu_s: f64,
    pub sketch_cpu_s: f64,
    pub ranks_cpu_s: f64,
    /// The agent's `method` for this matrix (`sketch` or `fallback`), and the Krylov depth
    /// the sketch reached (block steps after the first).
    pub method: &'static str,
    pub steps: usize,
    /// Exact values, the relative errors of the values the agent stores (NaN where null),
    /// and the sketch's error estimates (NaN where none), in
    /// [`super::spectral::Spectral::named`] order.
    pub exact: Vec<(&'static str, f64)>,
    pub relative_error: Vec<f64>,
    pub estimate: Vec<f64>,
}

/// Measures `kind` at `rows` × `cols` with both methods `repeats` times each, interleaved,
/// on the calling thread with its current intra-op thread count. Times are this thread's
/// CPU time ([`thread_cpu_seconds`]; wall time where that cannot be read).
pub fn compare(
    kind: SpectrumKind,
    rows: i64,
    cols: i64,
    repeats: usize,
) -> Result<Comparison, TchError> {
    let matrix = kind.matrix(rows, cols, 11)?;
    let mut sample = crate::torch::host_sample(&matrix, 11)?;
    let options = |mode| SpectrumOptions {
        mode,
        sketch_threshold: 0,
        device_sketch_threshold: 0,
    };
    let ranks = SketchPolicy {
        goal: SketchGoal::StableRankAndParticipation,
        ..SketchPolicy::default()
    };
    let runs = [
        (SpectrumMode::Exact, SketchPolicy::default()),
        (SpectrumMode::Sketch, SketchPolicy::default()),
        (SpectrumMode::Sketch, ranks),
    ];
    let mut times = vec![Vec::new(); runs.len()];
    let mut results = vec![None; runs.len()];
    for round in 0..repeats.max(1) {
        // Each round starts with the next run, so none always runs right after another.
        for i in (0..runs.len()).map(|i| (i + round) % runs.len()) {
            let (mode, policy) = runs[i];
            let started = Clock::now();
            let m = measure_with(&mut sample, false, &options(mode), &policy);
            times[i].push(started.elapsed());
            results[i] = Some(m);
        }
    }
    let exact = results[0].take().expect("measured").spectral.named();
    let sketch = results[1].take().expect("measured");
    let relative_error = exact
        .iter()
        .zip(sketch.spectral.named())
        .map(|(&(_, e), (_, s))| (s - e).abs() / e.abs().max(f64::MIN_POSITIVE))
        .collect();
    let trace = matrix.f_square()?.f_sum(Kind::Double)?.double_value(&[]);
    let host = Vec::<f32>::try_from(&matrix.f_to_kind(Kind::Float)?.f_reshape([-1])?)?;
    let x = faer::MatRef::from_row_major_slice(&host, rows as usize, cols as usize);
    let steps = sketch_spectral(
        &GramOperator::Factored(x),
        trace,
        11,
        SketchGoal::AllColumns,
    )
    .steps;
    Ok(Comparison {
        kind,
        exact_cpu_s: median(std::mem::take(&mut times[0])),
        sketch_cpu_s: median(std::mem::take(&mut times[1])),
        ranks_cpu_s: median(std::mem::take(&mut times[2])),
        method: sketch.method,
        steps,
        exact,
        relative_error,
        estimate: sketch.errors.named().into_iter().map(|(_, e)| e).collect(),
    })
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_unstable_by(f64::total_cmp);
    values[values.len() / 2]
}

/// This thread's CPU time in seconds (Linux: `/proc/thread-self/schedstat`).
pub fn thread_cpu_seconds() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: f64 = text.split_whitespace().next()?.parse().ok()?;
    Some(ns * 1e-9)
}

/// CPU time of this thread where it can be read, else wall time.
struct Clock(Option<f64>, std::time::Instant);

impl Clock {
    fn now() -> Clock {
        Clock(thread_cpu_seconds(), std::time::Instant::now())
    }

    fn elapsed(&self) -> f64 {
        match (self.0, thread_cpu_seconds()) {
            (Some(start), Some(now)) => now - start,
            _ => self.1.elapsed().as_secs_f64(),
        }
    }
}

/// The comparison as Markdown table rows: kind, the CPU times and ratios, the method and
/// depth, and per column the relative error of the stored value with the sketch's own
/// estimate in brackets.
pub fn markdown(rows: i64, cols: i64, comparisons: &[Comparison]) -> String {
    let mut out = format!(
        "Spectrum of a {rows} × {cols} matrix, exact (float64 Gram + eigvalsh) against sketch, \
         one intra-op thread, median CPU time. \"ranks\": the sketch only as deep as \
         stable_rank and participation_ratio need; \"all\": as the agent runs it, every \
         column, the exact path included where it falls back. Per column: the stored value's \
         error relative to exact [the sketch's own estimate]; \"null\" where the sketch left \
         it out.\n\n\
         | spectrum | exact s | ranks s | less CPU | all s | less CPU | method | vectors |"
    );
    let names: Vec<&str> = comparisons
        .first()
        .map(|c| c.exact.iter().map(|&(n, _)| n).collect())
        .unwrap_or_default();
    for name in &names {
        out.push_str(&format!(" {name} |"));
    }
    out.push_str("\n|---|---|---|---|---|---|---|---|");
    out.push_str(&"---|".repeat(names.len()));
    out.push('\n');
    for c in comparisons {
        out.push_str(&format!(
            "| {} | {:.3} | {:.3} | {:.1}× | {:.3} | {:.1}× | {} | {} |",
            c.kind.name(),
            c.exact_cpu_s,
            c.ranks_cpu_s,
            c.exact_cpu_s / c.ranks_cpu_s,
            c.sketch_cpu_s,
            c.exact_cpu_s / c.sketch_cpu_s,
            c.method,
            16 * (c.steps + 1),
        ));
        for ((_, error), estimate) in c
            .exact
            .iter()
            .zip(&c.relative_error)
            .map(|(e, r)| (e, *r))
            .zip(&c.estimate)
        {
            let value = if error.is_nan() {
                "null".to_string()
            } else {
                format!("{:.2} %", 100.0 * error)
            };
            if estimate.is_nan() {
                out.push_str(&format!(" {value} |"));
            } else {
                out.push_str(&format!(" {value} [{:.2} %] |", 100.0 * estimate));
            }
        }
        out.push('\n');
    }
    out
}

/// The issue's targets, side by side per kind: `stable_rank` and `participation_ratio`
/// within 2 % at ≥ 10× less CPU (the sketch as deep as they need, "ranks"), and
/// `effective_rank` within 5 % at ≥ 5× less CPU (the sketch as the agent runs it, the
/// exact path included where it falls back, "all"); with whether each is met.
pub fn targets(comparisons: &[Comparison]) -> String {
    let error_of = |c: &Comparison, name: &str| {
        c.exact
            .iter()
            .zip(&c.relative_error)
            .find(|((n, _), _)| *n == name)
            .map_or(f64::NAN, |(_, &e)| e)
    };
    let mut out = String::from(
        "| spectrum | stable_rank error | participation_ratio error | less CPU (ranks) | ≤ 2 % at ≥ 10× | effective_rank error | less CPU (all) | ≤ 5 % at ≥ 5× |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    let (mut ranks_met, mut effective_met) = (0, 0);
    for c in comparisons {
        let (sr, pr, er) = (
            error_of(c, "stable_rank"),
            error_of(c, "participation_ratio"),
            error_of(c, "effective_rank"),
        );
        let (ranks_ratio, all_ratio) = (
            c.exact_cpu_s / c.ranks_cpu_s,
            c.exact_cpu_s / c.sketch_cpu_s,
        );
        let ranks_ok = sr <= 0.02 && pr <= 0.02 && ranks_ratio >= 10.0;
        let effective_ok = er <= 0.05 && all_ratio >= 5.0;
        ranks_met += usize::from(ranks_ok);
        effective_met += usize::from(effective_ok);
        let verdict = |ok: bool| if ok { "met" } else { "**not met**" };
        out.push_str(&format!(
            "| {} | {:.2} % | {:.2} % | {:.1}× | {} | {:.2} %{} | {:.1}× | {} |\n",
            c.kind.name(),
            100.0 * sr,
            100.0 * pr,
            ranks_ratio,
            verdict(ranks_ok),
            100.0 * er,
            if c.method == "fallback" {
                " (exact: fallback)"
            } else {
                ""
            },
            all_ratio,
            verdict(effective_ok),
        ));
    }
    out.push_str(&format!(
        "\nstable_rank and participation_ratio ≤ 2 % at ≥ 10× less CPU: met on {ranks_met} of {n} kinds; \
         effective_rank ≤ 5 % at ≥ 5× less CPU: met on {effective_met} of {n} kinds.\n",
        n = comparisons.len()
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The benchmark table, at the target size (2,048 × 4,096) or at `SPECTRUM_TABLE_SHAPE`
    /// (`ROWSxCOLS`), median of 3 rounds or of `SPECTRUM_TABLE_ROUNDS`: `cargo test -p
    /// rankscope-agent spectrum_table -- --ignored --nocapture`. It prints times and asserts
    /// nothing about them.
    #[test]
    #[ignore = "a benchmark: minutes of CPU"]
    fn spectrum_table() {
        let shape = std::env::var("SPECTRUM_TABLE_SHAPE").unwrap_or_else(|_| "2048x4096".into());
        let (rows, cols) = shape
            .split_once('x')
            .and_then(|(r, c)| Some((r.parse().ok()?, c.parse().ok()?)))
            .expect("SPECTRUM_TABLE_SHAPE is ROWSxCOLS, e.g. 2048x4096");
        let rounds = std::env::var("SPECTRUM_TABLE_ROUNDS").map_or(3, |r| {
            r.parse()
                .expect("SPECTRUM_TABLE_ROUNDS is a whole number, e.g. 5")
        });
        let comparisons: Vec<Comparison> = SpectrumKind::BENCH
            .into_iter()
            .map(|kind| compare(kind, rows, cols, rounds).unwrap())
            .collect();
        println!("{}", markdown(rows, cols, &comparisons));
        println!("{}", targets(&comparisons));
    }
}
