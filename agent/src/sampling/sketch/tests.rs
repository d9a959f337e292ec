//! The sketch on host buffers, without libtorch: an explicit G and its factor give the
//! same estimates, an explicit G with a known spectrum meets the stated bounds, and the
//! input it cannot measure gives no spectrum instead of a panic.

use faer::{Mat, MatRef};

use super::{
    Depth, Krylov, KrylovSummary, SKETCH_BLOCK, SKETCH_BOUNDS, SKETCH_SCHEDULE, Sketch, SketchGoal,
    sketch_spectral, sketch_summarized,
};
use crate::sampling::gram::GramOperator;
use crate::sampling::spectral::{Spectral, SpectralErrors, SplitMix64, gaussian, spectral};

fn random(rows: usize, cols: usize, seed: u64) -> Mat<f64> {
    let values = gaussian(&mut SplitMix64(seed), rows * cols);
    Mat::from_fn(rows, cols, |i, j| f64::from(values[i * cols + j]))
}

fn to_f32(m: &Mat<f64>) -> Mat<f32> {
    Mat::from_fn(m.nrows(), m.ncols(), |i, j| m[(i, j)] as f32)
}

/// G = Q·diag(λ)·Qᵀ with Q a random orthogonal matrix: a Gram matrix with exactly the
/// spectrum λ, in float32.
fn with_spectrum(lambda: &[f64], seed: u64) -> Mat<f32> {
    let r = lambda.len();
    let q = random(r, r, seed).qr().compute_thin_Q();
    let scaled = Mat::from_fn(r, r, |i, j| q[(i, j)] * lambda[j]);
    to_f32(&(scaled * q.transpose()))
}

/// What is wrong with a sketch against the exact columns: a stored value beyond its bound
/// or its own estimate, a value without an estimate, or one left out within its bound.
fn misses(what: &str, sketch: &Sketch, exact: &Spectral) -> Vec<String> {
    let mut out = Vec::new();
    let rows = sketch
        .spectral
        .named()
        .into_iter()
        .zip(exact.named())
        .zip(sketch.errors.named().into_iter().zip(&SKETCH_BOUNDS));
    for (((name, value), (_, truth)), ((_, estimate), &(_, bound))) in rows {
        let error = (value - truth).abs() / truth.abs().max(1e-300);
        if estimate.is_nan() {
            out.push(format!("{what}: {name} has no error estimate"));
        } else if value.is_nan() {
            if estimate <= bound {
                out.push(format!("{what}: {name} left out at {estimate} <= {bound}"));
            }
        } else if error > bound || error > estimate {
            out.push(format!(
                "{what}: {name} = {value}, exact {truth}: off by {error:.5}, estimate {estimate:.5}"
            ));
        }
    }
    out
}

/// Spectra with a known answer, over r directions: a power law over all of them, a
/// steeper one over a third, a gap of 16 directions above a flat bulk, and rank 24 above a
/// low floor.
fn known_spectra(r: usize) -> Vec<(&'static str, Vec<f64>)> {
    let power = |alpha: f64, over: usize| -> Vec<f64> {
        (0..r)
            .map(|i| {
                if i < over {
                    ((i + 1) as f64).powf(-alpha)
                } else {
                    0.0
                }
            })
            .collect()
    };
    let gap: Vec<f64> = (0..r)
        .map(|i| {
            if i < 16 {
                9.0 + i as f64
            } else {
                1.0 + 0.5 * (i as f64 / r as f64)
            }
        })
        .collect();
    // Rank 24 above a sloping floor of 10⁻³–2·10⁻³: an exactly rank-deficient float32 G
    // has eigenvalues of its round-off (about 10⁻⁷·λ₁, of either sign) where the zeros
    // were, which the σ-based columns see; and a floor of one repeated eigenvalue defeats
    // the count of converged Ritz pairs (each is counted once, the space holds at most b
    // copies of it).
    let low: Vec<f64> = (0..r)
        .map(|i| {
            if i < 24 {
                1.0 + i as f64
            } else {
                1e-3 * (2.0 - i as f64 / r as f64)
            }
        })
        .collect();
    vec![
        ("power law α=1", power(1.0, r)),
        ("power law α=1.5 over a third", power(1.5, r / 3)),
        ("gap", gap),
        ("rank 24 above a floor", low),
    ]
}

/// The bounds are read by position beside the error estimates (`mark_unvouched`): the
/// two lists name the same columns in the same order.
#[test]
fn the_bounds_name_the_columns_in_their_order() {
    let bounds: Vec<&str> = SKETCH_BOUNDS.iter().map(|&(name, _)| name).collect();
    let estimates: Vec<&str> = SpectralErrors::default()
        .named()
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    let columns: Vec<&str> = Spectral::default()
        .named()
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    assert_eq!(bounds, estimates);
    assert_eq!(bounds, columns);
}

#[test]
fn an_explicit_gram_with_a_known_spectrum_meets_the_bounds() {
    let r = 640;
    let (mut problems, mut vouched) = (Vec::new(), 0);
    for (i, (name, lambda)) in known_spectra(r).into_iter().enumerate() {
        let g = with_spectrum(&lambda, 10 + i as u64);
        let trace: f64 = (0..r).map(|j| f64::from(g[(j, j)])).sum();
        let sketch = sketch_spectral(
            &GramOperator::Explicit(g.as_ref()),
            trace,
            3,
            SketchGoal::AllColumns,
        );
        vouched += usize::from(sketch.vouched);
        // The exact columns of the float32 G the sketch was given (its round-off lifts the
        // zero eigenvalues to about 10⁻⁷·λ₁).
        let g64 = Mat::from_fn(r, r, |a, b| f64::from(g[(a, b)]));
        let eigenvalues = g64.self_adjoint_eigenvalues(faer::Side::Lower).unwrap();
        let exact = spectral(&eigenvalues);
        let intended = spectral(&lambda);
        assert!((exact.stable_rank.unwrap() / intended.stable_rank.unwrap() - 1.0).abs() < 1e-4);
        problems.extend(misses(name, &sketch, &exact));
    }
    assert!(problems.is_empty(), "{problems:#?}");
    // Only the bulk of 616 directions under rank 24 leaves `effective_rank` open.
    assert!(vouched >= 3, "{vouched} of 4 vouched for");
}

/// The two forms of one G give the same numbers to the products' round-off, and the same
/// depth; the estimates agree as closely.
#[test]
fn explicit_and_factored_give_the_same_estimates() {
    // A tall A (700 × 600, so G = AᵀA) with a power-law spectrum, and a wide one.
    for (n, d) in [(700, 600), (600, 900)] {
        let a = Mat::from_fn(n, d, {
            let x = random(n, d, 5);
            move |i, j| x[(i, j)] * ((j + 1) as f64).powf(-0.5)
        });
        let g = if d <= n {
            a.transpose() * &a
        } else {
            &a * a.transpose()
        };
        let trace = a.squared_norm_l2();
        let (a, g) = (to_f32(&a), to_f32(&g));
        let goal = SketchGoal::AllColumns;
        let factored = sketch_spectral(&GramOperator::Factored(a.as_ref()), trace, 9, goal);
        let explicit = sketch_spectral(&GramOperator::Explicit(g.as_ref()), trace, 9, goal);
        assert_eq!(factored.steps, explicit.steps, "{n} x {d}");
        assert_eq!(factored.vouched, explicit.vouched, "{n} x {d}");
        let pairs = factored
            .spectral
            .named()
            .into_iter()
            .zip(explicit.spectral.named());
        for ((name, f), (_, e)) in pairs {
            let same = (f.is_nan() && e.is_nan()) || (f - e).abs() <= 1e-3 * f.abs();
            assert!(same, "{n} x {d}: {name}: {f} against {e}");
        }
        let pairs = factored
            .errors
            .named()
            .into_iter()
            .zip(explicit.errors.named());
        for ((name, f), (_, e)) in pairs {
            assert!(
                (f - e).abs() <= 0.05 * f.abs() + 1e-4,
                "{n} x {d}: {name}'s estimate: {f} against {e}"
            );
        }
        // Row-major storage of A is the same operator.
        let row_major: Vec<f32> = (0..n * d).map(|e| a[(e / d, e % d)]).collect();
        let strided = GramOperator::Factored(MatRef::from_row_major_slice(&row_major, n, d));
        let again = sketch_spectral(&strided, trace, 9, goal);
        assert_eq!(again.steps, factored.steps);
        let pairs = factored
            .spectral
            .named()
            .into_iter()
            .zip(again.spectral.named());
        for ((name, f), (_, e)) in pairs {
            let same = (f.is_nan() && e.is_nan()) || (f - e).abs() <= 1e-5 * f.abs();
            assert!(same, "{n} x {d} row-major: {name}: {f} against {e}");
        }
    }
}

#[test]
fn the_same_seed_gives_the_same_numbers_at_any_scale() {
    let lambda: Vec<f64> = (0..600).map(|i| ((i + 1) as f64).powf(-0.7)).collect();
    let g = with_spectrum(&lambda, 4);
    let trace: f64 = (0..600).map(|j| f64::from(g[(j, j)])).sum();
    let op = GramOperator::Explicit(g.as_ref());
    let first = sketch_spectral(&op, trace, 5, SketchGoal::AllColumns);
    assert_eq!(
        sketch_spectral(&op, trace, 5, SketchGoal::AllColumns),
        first
    );
    assert_ne!(
        sketch_spectral(&op, trace, 6, SketchGoal::AllColumns),
        first
    );
    // G scaled by 10⁻³⁰ or 10³⁰ (still float32): the same columns.
    for scale in [1e-30f32, 1e30] {
        let scaled = Mat::from_fn(600, 600, |i, j| g[(i, j)] * scale);
        let trace = trace * f64::from(scale);
        let sketch = sketch_spectral(
            &GramOperator::Explicit(scaled.as_ref()),
            trace,
            5,
            SketchGoal::AllColumns,
        );
        for ((name, want), (_, got)) in first
            .spectral
            .named()
            .into_iter()
            .zip(sketch.spectral.named())
        {
            let same = (want.is_nan() && got.is_nan()) || (want - got).abs() <= 1e-4 * want.abs();
            assert!(same, "× {scale:e}: {name}: {got} against {want}");
        }
    }
}

#[test]
fn what_it_cannot_measure_gives_no_spectrum() {
    let goal = SketchGoal::AllColumns;
    let unmeasured = |s: &Sketch| s.spectral == Spectral::default() && !s.vouched;
    // The zero matrix spans no dimension.
    let zero = Mat::<f32>::zeros(600, 700);
    let sketch = sketch_spectral(&GramOperator::Factored(zero.as_ref()), 0.0, 1, goal);
    assert_eq!((sketch.spectral, sketch.vouched), (Spectral::zero(), true));
    // Non-finite values, in A or in G.
    let mut bad = to_f32(&random(600, 700, 1));
    bad[(3, 4)] = f32::NAN;
    assert!(unmeasured(&sketch_spectral(
        &GramOperator::Factored(bad.as_ref()),
        1.0,
        1,
        goal
    )));
    let mut g = to_f32(&random(600, 600, 2));
    g[(5, 5)] = f32::INFINITY;
    assert!(unmeasured(&sketch_spectral(
        &GramOperator::Explicit(g.as_ref()),
        1.0,
        1,
        goal
    )));
    // A non-square G, a side too small for the space, a non-finite trace.
    let wide = to_f32(&random(600, 601, 3));
    assert!(unmeasured(&sketch_spectral(
        &GramOperator::Explicit(wide.as_ref()),
        1.0,
        1,
        goal
    )));
    let small = to_f32(&random(200, 3000, 4));
    assert!(unmeasured(&sketch_spectral(
        &GramOperator::Factored(small.as_ref()),
        1.0,
        1,
        goal
    )));
    let fine = to_f32(&random(600, 700, 5));
    let op = GramOperator::Factored(fine.as_ref());
    assert!(unmeasured(&sketch_spectral(&op, f64::NAN, 1, goal)));
    assert!(unmeasured(&sketch_spectral(&op, -1.0, 1, goal)));
}

/// The summary a device would hand over, made here by the host's own Krylov process:
/// every depth of the schedule.
fn host_summary(op: &GramOperator<'_>, trace: f64, seed: u64) -> KrylovSummary {
    let mut krylov = Krylov::start(op, trace, seed).expect("finite products");
    let depths: Vec<Depth> = SKETCH_SCHEDULE
        .iter()
        .map(|&steps| {
            assert!(krylov.extend(steps));
            krylov.depth()
        })
        .collect();
    KrylovSummary {
        side: krylov.r,
        projected: krylov.projected.clone(),
        squares: krylov.squares.clone(),
        depths,
    }
}

/// The analysis reads only the summary: from the host's own Krylov process it gives what
/// the host's sketch gives, bit for bit, at whichever depth that stopped.
#[test]
fn a_summary_gives_what_the_host_sketch_gives() {
    let r = 640;
    for (i, (name, lambda)) in known_spectra(r).into_iter().enumerate() {
        let g = with_spectrum(&lambda, 10 + i as u64);
        let trace: f64 = (0..r).map(|j| f64::from(g[(j, j)])).sum();
        let op = GramOperator::Explicit(g.as_ref());
        let goal = SketchGoal::AllColumns;
        let sketch = sketch_spectral(&op, trace, 3, goal);
        let summarized = sketch_summarized(&host_summary(&op, trace, 3), trace, goal);
        assert_eq!(sketch, summarized, "{name}");
    }
}

/// A summary of the wrong shape, with a value that is not finite, or with depths off
/// the schedule gives no spectrum; a zero trace the zero spectrum.
#[test]
fn a_summary_it_cannot_read_gives_no_spectrum() {
    let r = 640;
    let lambda: Vec<f64> = (0..r).map(|j| 1.0 / (j + 1) as f64).collect();
    let g = with_spectrum(&lambda, 4);
    let trace: f64 = (0..r).map(|j| f64::from(g[(j, j)])).sum();
    let good = host_summary(&GramOperator::Explicit(g.as_ref()), trace, 2);
    let goal = SketchGoal::AllColumns;
    assert!(
        sketch_summarized(&good, trace, goal)
            .spectral
            .stable_rank
            .is_some()
    );
    assert_eq!(
        sketch_summarized(&good, 0.0, goal).spectral,
        Spectral::zero()
    );
    let mut broken: Vec<KrylovSummary> = Vec::new();
    let mut edit = |f: &dyn Fn(&mut KrylovSummary)| {
        let mut s = good.clone();
        f(&mut s);
        broken.push(s);
    };
    edit(&|s| s.depths.clear());
    edit(&|s| s.depths[0].steps = 5);
    edit(&|s| s.depths.swap(0, 1));
    edit(&|s| s.depths[1].off = f64::NAN);
    edit(&|s| s.depths[2].probe_outside.pop().map(drop).unwrap_or(()));
    edit(&|s| s.depths[0].residual_gram = Mat::zeros(3, 3));
    edit(&|s| s.projected[(5, 7)] = f64::INFINITY);
    edit(&|s| s.squares = Mat::zeros(10, 10));
    edit(&|s| s.side = 100);
    for (i, summary) in broken.iter().enumerate() {
        let sketch = sketch_summarized(summary, trace, goal);
        assert!(
            !sketch.vouched && sketch.spectral == Spectral::default(),
            "{i}: {sketch:?}"
        );
    }
    assert!(!sketch_summarized(&good, f64::NAN, goal).vouched);
}

/// `summary`'s first `depths` depths in [`KrylovSummary::from_packed`]'s order, as a
/// device that ran its Krylov process that far packs them.
fn packed(summary: &KrylovSummary, depths: usize) -> Vec<f64> {
    let k = (SKETCH_SCHEDULE[depths - 1] + 1) * SKETCH_BLOCK;
    let mut out = Vec::new();
    for m in [&summary.projected, &summary.squares] {
        out.extend((0..k).flat_map(|i| (0..k).map(move |j| m[(i, j)])));
    }
    for d in &summary.depths[..depths] {
        let b = d.residual_gram.nrows();
        out.extend((0..b).flat_map(|i| (0..b).map(move |j| d.residual_gram[(i, j)])));
        out.push(d.off);
        out.extend(&d.probe_outside);
        out.extend(&d.probe_control);
    }
    out
}

/// A device that stops its Krylov process at a depth of the schedule packs a shorter
/// summary: read back, it gives what the host's sketch gives wherever that stopped at or
/// before that depth, bit for bit, and otherwise the same estimates it had there,
/// unvouched. A length of none of the schedule's prefixes is refused.
#[test]
fn a_summary_of_fewer_depths_gives_what_those_depths_give() {
    let r = 640;
    let goal = SketchGoal::AllColumns;
    let mut stopped_early = 0;
    for (i, (name, lambda)) in known_spectra(r).into_iter().enumerate() {
        let g = with_spectrum(&lambda, 20 + i as u64);
        let trace: f64 = (0..r).map(|j| f64::from(g[(j, j)])).sum();
        let op = GramOperator::Explicit(g.as_ref());
        let full = host_summary(&op, trace, 5);
        let sketch = sketch_spectral(&op, trace, 5, goal);
        for depths in 1..=SKETCH_SCHEDULE.len() {
            let values = packed(&full, depths);
            assert_eq!(values.len(), KrylovSummary::packed_len_of(depths));
            assert_eq!(KrylovSummary::depths_in(values.len()), Some(depths));
            let read = KrylovSummary::from_packed(r, &values).expect("a schedule prefix");
            assert_eq!(read.depths.len(), depths);
            let summarized = sketch_summarized(&read, trace, goal);
            if sketch.steps <= SKETCH_SCHEDULE[depths - 1] {
                assert_eq!(summarized, sketch, "{name} at {depths} depths");
            } else {
                stopped_early += 1;
                assert!(!summarized.vouched, "{name} at {depths} depths");
                assert_eq!(summarized.steps, SKETCH_SCHEDULE[depths - 1]);
            }
        }
    }
    assert!(
        stopped_early > 0,
        "some spectrum needs more than the first depth"
    );
    let full = KrylovSummary::packed_len();
    assert_eq!(full, KrylovSummary::packed_len_of(SKETCH_SCHEDULE.len()));
    for len in [0, 1, full - 1, full + 1] {
        assert_eq!(
            KrylovSummary::from_packed(r, &vec![0.0; len]),
            None,
            "{len}"
        );
    }
    assert_eq!(KrylovSummary::packed_len_of(0), 0);
    assert_eq!(KrylovSummary::packed_len_of(SKETCH_SCHEDULE.len() + 1), 0);
}
