//! The metrics' tests.

use tch::{Device, Kind, Tensor};

use crate::sampling::measure::LayerMetrics;
use crate::sampling::options::{ConvLayout, MatrixOptions, Method, SpectrumMode, SpectrumOptions};
use crate::sampling::prepare::{choose_rows, sample_seed};
use crate::sampling::spectral::{self, Spectral, SplitMix64, spectral};
use crate::torch::{compute, device_sample};

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
    spectral::gaussian(&mut SplitMix64(seed), len)
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
        device_sketch_threshold: 1024,
    };
    assert_eq!(auto.method(4096, 1535), Method::Exact);
    // Where a device runs the Krylov process, from its own threshold.
    assert_eq!(auto.method_on_device(4096, 1023), Method::Exact);
    assert_eq!(auto.method_on_device(4096, 1024), Method::Sketch);
    assert_eq!(auto.method_on_device(511, 4096), Method::Exact);
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
fn device_samples_pick_the_rows_the_host_reads() {
    // The tch adapter's device path (here on the CPU) draws the same rows, in order,
    // as the core's host read.
    let n = 1000;
    let x = Tensor::arange(n, (Kind::Float, Device::Cpu)).unsqueeze(1);
    let (picked, _) = device_sample(&x, ConvLayout::Channelwise, 100, 7).unwrap();
    let picked = Vec::<f32>::try_from(&picked.squeeze_dim(1)).unwrap();
    let expected: Vec<f32> = choose_rows(n as u64, 100, 7)
        .iter()
        .map(|&r| r as f32)
        .collect();
    assert_eq!(picked, expected);
    assert!(
        picked.windows(2).all(|w| w[0] < w[1]),
        "sorted and distinct"
    );
    let (all, _) = device_sample(&x, ConvLayout::Channelwise, 1000, 7).unwrap();
    assert_eq!(all.size(), [1000, 1]);
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

/// Both of [`choose_rows`]'s forms, the shuffled array and the displaced entries, draw
/// the rows the partial Fisher–Yates shuffle defines (written out here with a map of
/// every position), on either side of the switch between them.
#[test]
fn row_choice_is_the_same_shuffle_whatever_its_form() {
    let reference = |n: u64, k: u64, seed: u64| -> Vec<i64> {
        let mut rng = crate::sampling::spectral::SplitMix64(seed);
        let mut at = std::collections::BTreeMap::new();
        let mut chosen: Vec<i64> = (0..k.min(n))
            .map(|i| {
                let j = i + rng.below(n - i);
                let at_i = *at.get(&i).unwrap_or(&i);
                let at_j = *at.get(&j).unwrap_or(&j);
                at.insert(j, at_i);
                at_j as i64
            })
            .collect();
        chosen.sort_unstable();
        chosen
    };
    let factor = crate::sampling::prepare::DENSE_ROWS_FACTOR;
    for (n, k) in [
        (8192, 4096),
        (10, 3),
        (16 * 64, 64),
        (16 * 64 + 1, 64),
        (100_000, 4096),
        (1 << 33, 50),
        (7, 0),
    ] {
        for seed in [0, 1, 0x5eed, u64::MAX] {
            assert_eq!(
                choose_rows(n, k, seed),
                reference(n, k, seed),
                "n {n}, k {k}, seed {seed} (dense up to {factor}·k)"
            );
        }
    }
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
        let (m, label) = device_sample(t, layout, 0, 0).unwrap();
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
