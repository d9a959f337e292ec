//! The jump detector's validity harness, modelled on NDT's (`ndt.validity`):
//! fixtures with known ground truth, several seeds each, scored by recall on
//! planted jumps and false positives per 1,000 steps.
//!
//! Fixture families (Gaussian noise σ = 0.3 as in NDT's; sizes in units of σ;
//! positions as shares u of the run):
//! - `planted_single`: 400 points, one level shift of 3–10σ (either sign) at
//!   u in 0.25–0.75 (NDT: 400 steps, 10 → 20 at step 200, i.e. 33σ);
//! - `planted_multi`: 600 points, three shifts of 4–10σ, at least 0.1 of the run
//!   apart (NDT: 600 steps, shifts at 150, 350, 450 of 10–30σ);
//! - `pure_noise`: 1,000 points of noise (NDT: 400);
//! - `drift`: 1,000 points of linear drift of 10–60σ end to end, no jump (NDT:
//!   10 → 20 over 400 steps, i.e. 33σ);
//! - `decay_drop`: 1,000 points of a + 40σ·exp(−u/τ) with τ in 0.1–0.3 (a
//!   loss-like curve), plus one drop of 4–10σ at u in 0.3–0.8.
//!
//! Each family runs on three samplings: every step, every 10th step (sampled
//! layers: the same number of points over ten times the steps) and uneven gaps of
//! 1–3 steps. A detection counts when it is within 5 steps of a planted change
//! (NDT's tolerance), matched one to one; with every 10th step that means the
//! exact sampled step.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::jumps::{JumpConfig, detect};

/// A series with its planted jump steps.
pub struct Fixture {
    pub points: Vec<(u64, f64)>,
    pub truth: Vec<u64>,
    /// The steps the series spans (last − first + 1), for rates per 1,000 steps.
    pub steps: u64,
}

#[derive(Clone, Copy, Debug)]
pub enum Family {
    PlantedSingle,
    PlantedMulti,
    PureNoise,
    Drift,
    DecayDrop,
}

impl Family {
    pub const ALL: [Family; 5] = [
        Family::PlantedSingle,
        Family::PlantedMulti,
        Family::PureNoise,
        Family::Drift,
        Family::DecayDrop,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Family::PlantedSingle => "planted_single",
            Family::PlantedMulti => "planted_multi",
            Family::PureNoise => "pure_noise",
            Family::Drift => "drift",
            Family::DecayDrop => "decay_drop",
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub enum Sampling {
    Every,
    Tenth,
    Uneven,
}

impl Sampling {
    pub const ALL: [Sampling; 3] = [Sampling::Every, Sampling::Tenth, Sampling::Uneven];

    pub fn name(self) -> &'static str {
        match self {
            Sampling::Every => "every step",
            Sampling::Tenth => "every 10th",
            Sampling::Uneven => "gaps 1-3",
        }
    }

    /// `points` sampled steps from 0, and the span of steps they cover.
    fn steps(self, points: u64, rng: &mut SmallRng) -> (Vec<u64>, u64) {
        let steps: Vec<u64> = match self {
            Sampling::Every => (0..points).collect(),
            Sampling::Tenth => (0..points).map(|i| 10 * i).collect(),
            Sampling::Uneven => {
                let mut s = vec![0];
                while (s.len() as u64) < points {
                    s.push(s[s.len() - 1] + rng.random_range(1..=3));
                }
                s
            }
        };
        let span = steps[steps.len() - 1]
            + match self {
                Sampling::Tenth => 10,
                _ => 1,
            };
        (steps, span)
    }
}

pub fn normal(rng: &mut SmallRng) -> f64 {
    // Box–Muller.
    let u1: f64 = rng.random_range(f64::MIN_POSITIVE..1.0);
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

fn signed(rng: &mut SmallRng, lo: f64, hi: f64) -> f64 {
    let size = rng.random_range(lo..hi);
    if rng.random() { size } else { -size }
}

/// The fixture of `family` for `seed`. Shapes are defined over the run's length
/// (u = step / span in 0–1), so a sampled series is the same curve with fewer
/// points per step; σ = 0.3 as in NDT's fixtures.
pub fn fixture(family: Family, sampling: Sampling, seed: u64) -> Fixture {
    const SIGMA: f64 = 0.3;
    let mut rng = SmallRng::seed_from_u64(
        seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ ((family as u64) << 8 | sampling as u64),
    );
    let points: u64 = match family {
        Family::PlantedSingle => 400,
        Family::PlantedMulti => 600,
        _ => 1000,
    };
    let (steps, span) = sampling.steps(points, &mut rng);
    let u = |s: u64| s as f64 / span as f64;
    // Changes are planted at sampled steps: the first step at the new level.
    let pick = |rng: &mut SmallRng, lo: f64, hi: f64| {
        let candidates: Vec<u64> = steps
            .iter()
            .copied()
            .filter(|&s| (lo..hi).contains(&u(s)))
            .collect();
        candidates[rng.random_range(0..candidates.len())]
    };
    let mut shifts: Vec<(u64, f64)> = Vec::new();
    let base: Box<dyn Fn(f64) -> f64> = match family {
        Family::PlantedSingle => {
            shifts.push((
                pick(&mut rng, 0.25, 0.75),
                signed(&mut rng, 3.0, 10.0) * SIGMA,
            ));
            Box::new(|_| 10.0)
        }
        Family::PlantedMulti => {
            while shifts.len() < 3 {
                let at = pick(&mut rng, 0.1, 0.9);
                if shifts.iter().all(|&(s, _)| (u(s) - u(at)).abs() >= 0.1) {
                    shifts.push((at, signed(&mut rng, 4.0, 10.0) * SIGMA));
                }
            }
            Box::new(|_| 10.0)
        }
        Family::PureNoise => Box::new(|_| 0.0),
        Family::Drift => {
            let total = signed(&mut rng, 10.0, 60.0) * SIGMA;
            Box::new(move |u| 10.0 + total * u)
        }
        Family::DecayDrop => {
            shifts.push((
                pick(&mut rng, 0.3, 0.8),
                -rng.random_range(4.0..10.0) * SIGMA,
            ));
            let tau = rng.random_range(0.1..0.3);
            Box::new(move |u| 1.0 + 40.0 * SIGMA * (-u / tau).exp())
        }
    };
    shifts.sort_by_key(|s| s.0);
    let points = steps
        .iter()
        .map(|&s| {
            let level: f64 = shifts
                .iter()
                .filter(|&&(at, _)| s >= at)
                .map(|&(_, d)| d)
                .sum();
            (s, base(u(s)) + level + SIGMA * normal(&mut rng))
        })
        .collect();
    Fixture {
        points,
        truth: shifts.iter().map(|s| s.0).collect(),
        steps: span,
    }
}

/// (true positives, false positives): greedy one-to-one matching within
/// `tolerance` steps, as NDT's harness does.
pub fn score(detected: &[u64], truth: &[u64], tolerance: u64) -> (usize, usize) {
    let mut left: Vec<u64> = truth.to_vec();
    let (mut tp, mut fp) = (0, 0);
    let mut sorted = detected.to_vec();
    sorted.sort_unstable();
    for d in sorted {
        if let Some(i) = left.iter().position(|&t| t.abs_diff(d) <= tolerance) {
            left.remove(i);
            tp += 1;
        } else {
            fp += 1;
        }
    }
    (tp, fp)
}

/// Recall and false positives of the detector on one family and sampling.
#[derive(Debug, Default)]
pub struct Tally {
    pub planted: usize,
    pub found: usize,
    pub false_positives: usize,
    pub steps: u64,
    pub points: usize,
}

impl Tally {
    pub fn recall(&self) -> Option<f64> {
        (self.planted > 0).then(|| self.found as f64 / self.planted as f64)
    }

    pub fn fp_per_1000_steps(&self) -> f64 {
        1000.0 * self.false_positives as f64 / self.steps.max(1) as f64
    }

    pub fn fp_per_1000_points(&self) -> f64 {
        1000.0 * self.false_positives as f64 / self.points.max(1) as f64
    }
}

pub fn run(family: Family, sampling: Sampling, seeds: u64, config: &JumpConfig) -> Tally {
    let mut tally = Tally::default();
    for seed in 0..seeds {
        let fx = fixture(family, sampling, seed);
        let found: Vec<u64> = detect(&fx.points, config)
            .expect("fixtures are valid series")
            .jumps
            .iter()
            .map(|j| j.step)
            .collect();
        let (tp, fp) = score(&found, &fx.truth, 5);
        tally.planted += fx.truth.len();
        tally.found += tp;
        tally.false_positives += fp;
        tally.steps += fx.steps;
        tally.points += fx.points.len();
    }
    tally
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEEDS: u64 = 200;

    #[test]
    fn scoring_matches_one_to_one() {
        assert_eq!(score(&[98, 103, 300], &[100], 5), (1, 2));
        assert_eq!(score(&[], &[100], 5), (0, 0));
        assert_eq!(score(&[94], &[100], 5), (0, 1));
    }

    /// The validity figures of docs/metrics.md: printed per family and sampling
    /// (`cargo test -p rankscope --no-default-features jumps_validity -- --nocapture`),
    /// and held to the targets: recall ≥ 0.95 on planted jumps, ≤ 0.5 false
    /// positives per 1,000 steps on pure noise and on drift.
    #[test]
    fn jumps_validity() {
        let config = JumpConfig::default();
        println!(
            "{:<15} {:<11} {:>6} {:>8} {:>7} {:>10} {:>14} {:>15}",
            "family",
            "sampling",
            "seeds",
            "planted",
            "recall",
            "false pos",
            "fp/1000 steps",
            "fp/1000 points"
        );
        let mut failures = Vec::new();
        for family in Family::ALL {
            let mut all = Tally::default();
            for sampling in Sampling::ALL {
                let t = run(family, sampling, SEEDS, &config);
                println!(
                    "{:<15} {:<11} {:>6} {:>8} {:>7} {:>10} {:>14.3} {:>15.3}",
                    family.name(),
                    sampling.name(),
                    SEEDS,
                    t.planted,
                    t.recall().map_or("-".into(), |r| format!("{r:.3}")),
                    t.false_positives,
                    t.fp_per_1000_steps(),
                    t.fp_per_1000_points()
                );
                if t.recall().is_some_and(|r| r < 0.95) {
                    failures.push(format!(
                        "{} / {}: recall {:?}",
                        family.name(),
                        sampling.name(),
                        t.recall()
                    ));
                }
                if matches!(family, Family::PureNoise | Family::Drift)
                    && t.fp_per_1000_steps() > 0.5
                {
                    failures.push(format!(
                        "{} / {}: {:.3} false positives per 1000 steps",
                        family.name(),
                        sampling.name(),
                        t.fp_per_1000_steps()
                    ));
                }
                all.planted += t.planted;
                all.found += t.found;
                all.false_positives += t.false_positives;
                all.steps += t.steps;
                all.points += t.points;
            }
            println!(
                "{:<15} {:<11} {:>6} {:>8} {:>7} {:>10} {:>14.3} {:>15.3}",
                family.name(),
                "all",
                3 * SEEDS,
                all.planted,
                all.recall().map_or("-".into(), |r| format!("{r:.3}")),
                all.false_positives,
                all.fp_per_1000_steps(),
                all.fp_per_1000_points()
            );
        }
        assert!(failures.is_empty(), "targets missed: {failures:?}");
    }

    /// Recall as a function of the shift size (one shift at step 200 of 400,
    /// every step): where the detector's power ends. Printed, and held to the
    /// design: sure at 4σ, silent-ish at 1σ.
    #[test]
    fn jumps_power_curve() {
        let config = JumpConfig::default();
        println!("{:>10} {:>8}", "shift (σ)", "recall");
        for size in [1.0, 2.0, 2.5, 3.0, 4.0, 6.0] {
            let mut found = 0;
            for seed in 0..SEEDS {
                let mut rng = SmallRng::seed_from_u64(seed);
                let points: Vec<(u64, f64)> = (0..400)
                    .map(|s| (s, if s >= 200 { size } else { 0.0 } + normal(&mut rng)))
                    .collect();
                let jumps = detect(&points, &config).unwrap().jumps;
                found += usize::from(jumps.iter().any(|j| j.step.abs_diff(200) <= 5));
            }
            let recall = found as f64 / SEEDS as f64;
            println!("{size:>10.1} {recall:>8.3}");
            if size >= 4.0 {
                assert!(recall >= 0.95, "shift {size}σ: recall {recall}");
            }
            if size <= 1.0 {
                assert!(recall <= 0.2, "shift {size}σ: recall {recall}");
            }
        }
    }

    /// Noise outside the independent, constant-scale model: AR(1) noise (each
    /// point keeps φ of the previous one's noise), which the detector's
    /// correlation estimate must absorb, and noise whose scale grows fourfold
    /// along the series. 1,000 points, no jump; held to the same 0.5 per 1,000.
    #[test]
    fn jumps_on_correlated_and_growing_noise() {
        let config = JumpConfig::default();
        println!("{:<28} {:>15}", "noise", "fp/1000 points");
        let cases: [(&str, f64, f64); 5] = [
            ("independent", 0.0, 1.0),
            ("AR(1), phi = 0.2", 0.2, 1.0),
            ("AR(1), phi = 0.5", 0.5, 1.0),
            ("AR(1), phi = 0.8", 0.8, 1.0),
            ("independent, scale x1 -> x4", 0.0, 4.0),
        ];
        for (name, phi, growth) in cases {
            let mut false_positives = 0;
            for seed in 0..SEEDS {
                let mut rng = SmallRng::seed_from_u64(seed ^ 0xa5a5);
                let mut e = 0.0;
                let points: Vec<(u64, f64)> = (0..1000u64)
                    .map(|s| {
                        e = phi * e + (1.0 - phi * phi).sqrt() * normal(&mut rng);
                        let scale = 1.0 + (growth - 1.0) * s as f64 / 1000.0;
                        (s, scale * e)
                    })
                    .collect();
                false_positives += detect(&points, &config).unwrap().jumps.len();
            }
            let rate = 1000.0 * false_positives as f64 / (1000 * SEEDS) as f64;
            println!("{name:<28} {rate:>15.3}");
            assert!(
                rate <= 0.5,
                "{name}: {rate} false positives per 1000 points"
            );
        }
    }
}
