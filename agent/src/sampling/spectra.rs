//! Seeded matrices with the kinds of spectra the sketch is measured on (its tests and
//! `rankscope bench --spectrum`): the same matrix for the same seed on every machine.

use tch::{Kind, TchError, Tensor};

use super::measure::measure;
use super::options::{SpectrumMode, SpectrumOptions};
use super::prepare::Sample;
use super::spectral::{SplitMix64, gaussian};

/// A kind of singular-value spectrum.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SpectrumKind {
    /// Independent standard normal entries: a flat (Marchenko–Pastur) spectrum.
    Flat,
    /// Column j (from 1) scaled by j^(−α/2): eigenvalues decaying about as i^(−α).
    PowerLaw(f64),
    /// A rank-r signal (entries of variance 9) plus standard normal noise scaled by 0.3.
    LowRankPlusNoise(i64),
    /// Power law with α = 0.5 and three columns 50× larger: the outlier features of
    /// transformer activations.
    Outliers,
}

impl SpectrumKind {
    /// The kinds reported in `docs/metrics.md`.
    pub const ALL: [SpectrumKind; 7] = [
        SpectrumKind::Flat,
        SpectrumKind::PowerLaw(0.5),
        SpectrumKind::PowerLaw(1.0),
        SpectrumKind::PowerLaw(2.0),
        SpectrumKind::LowRankPlusNoise(16),
        SpectrumKind::LowRankPlusNoise(256),
        SpectrumKind::Outliers,
    ];

    /// A short name for tables.
    pub fn name(self) -> String {
        match self {
            SpectrumKind::Flat => "flat".into(),
            SpectrumKind::PowerLaw(a) => format!("power law α={a}"),
            SpectrumKind::LowRankPlusNoise(r) => format!("rank {r} + noise"),
            SpectrumKind::Outliers => "outlier features".into(),
        }
    }

    /// A float32 `rows` × `cols` matrix of this kind on the CPU, from `seed`.
    pub fn matrix(self, rows: i64, cols: i64, seed: u64) -> Result<Tensor, TchError> {
        let mut rng = SplitMix64(seed);
        let mut normal = |r: i64, c: i64| -> Result<Tensor, TchError> {
            Tensor::f_from_slice(&gaussian(&mut rng, (r * c) as usize))?.f_reshape([r, c])
        };
        let noise = normal(rows, cols)?;
        let column_scale = |alpha: f64| -> Result<Tensor, TchError> {
            Tensor::f_arange_start(1, cols + 1, (Kind::Float, tch::Device::Cpu))?
                .f_pow_tensor_scalar(-alpha / 2.0)
        };
        match self {
            SpectrumKind::Flat => Ok(noise),
            SpectrumKind::PowerLaw(alpha) => noise.f_mul(&column_scale(alpha)?),
            SpectrumKind::LowRankPlusNoise(rank) => {
                let left = normal(rows, rank)?;
                let right = normal(rank, cols)?;
                left.f_matmul(&right)?
                    .f_mul_scalar(3.0 / (rank as f64).sqrt())?
                    .f_add(&noise.f_mul_scalar(0.3)?)
            }
            SpectrumKind::Outliers => {
                let scale = column_scale(0.5)?;
                for column in [7, 100, 900].into_iter().filter(|&c| c < cols) {
                    let _ = scale.f_get(column)?.f_mul_scalar_(50.0)?;
                }
                noise.f_mul(&scale)
            }
        }
    }
}

/// One side-by-side measurement of the exact and the sketched spectrum of one matrix.
#[derive(Debug, Clone)]
pub struct Comparison {
    pub kind: SpectrumKind,
    /// Median CPU seconds of this thread for [`measure`] with each method.
    pub exact_cpu_s: f64,
    pub sketch_cpu_s: f64,
    /// Exact values and relative errors of the sketch, in [`super::spectral::Spectral::named`] order.
    pub exact: Vec<(&'static str, f64)>,
    pub relative_error: Vec<f64>,
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
    let sample = Sample {
        matrix: kind.matrix(rows, cols, 11)?,
        conv_layout: "",
        seed: 11,
    };
    let options = |mode| SpectrumOptions {
        mode,
        sketch_threshold: 0,
    };
    let (mut exact_s, mut sketch_s) = (Vec::new(), Vec::new());
    let (mut exact, mut sketch) = (None, None);
    for _ in 0..repeats.max(1) {
        for (mode, times, out) in [
            (SpectrumMode::Exact, &mut exact_s, &mut exact),
            (SpectrumMode::Sketch, &mut sketch_s, &mut sketch),
        ] {
            let started = Clock::now();
            *out = Some(measure(&sample, false, &options(mode)));
            times.push(started.elapsed());
        }
    }
    let (exact, sketch) = (
        exact.expect("measured").spectral,
        sketch.expect("measured").spectral,
    );
    let exact = exact.named();
    let relative_error = exact
        .iter()
        .zip(sketch.named())
        .map(|(&(_, e), (_, s))| (s - e).abs() / e.abs().max(f64::MIN_POSITIVE))
        .collect();
    Ok(Comparison {
        kind,
        exact_cpu_s: median(exact_s),
        sketch_cpu_s: median(sketch_s),
        exact,
        relative_error,
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

/// The comparison as Markdown table rows: kind, both CPU times, the ratio, and the
/// sketch's relative error on every spectral column.
pub fn markdown(rows: i64, cols: i64, comparisons: &[Comparison]) -> String {
    let mut out = format!(
        "Spectrum of a {rows} × {cols} matrix, exact (float64 Gram + eigvalsh) against sketch, \
         one intra-op thread, median CPU time; errors relative to exact.\n\n\
         | spectrum | exact s | sketch s | less CPU |"
    );
    let names: Vec<&str> = comparisons
        .first()
        .map(|c| c.exact.iter().map(|&(n, _)| n).collect())
        .unwrap_or_default();
    for name in &names {
        out.push_str(&format!(" {name} |"));
    }
    out.push_str("\n|---|---|---|---|");
    out.push_str(&"---|".repeat(names.len()));
    out.push('\n');
    for c in comparisons {
        out.push_str(&format!(
            "| {} | {:.3} | {:.3} | {:.1}× |",
            c.kind.name(),
            c.exact_cpu_s,
            c.sketch_cpu_s,
            c.exact_cpu_s / c.sketch_cpu_s
        ));
        for (&(_, value), error) in c.exact.iter().zip(&c.relative_error) {
            out.push_str(&format!(" {:.2} % (of {value:.4}) |", 100.0 * error));
        }
        out.push('\n');
    }
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
        crate::sampling::threads::limit_this_thread(1);
        let comparisons: Vec<Comparison> = SpectrumKind::ALL
            .into_iter()
            .map(|kind| compare(kind, rows, cols, rounds).unwrap())
            .collect();
        println!("{}", markdown(rows, cols, &comparisons));
    }
}
