//! Memory creep: process RSS or device allocated bytes that keep rising after
//! warm-up.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{Diagnosis, Evidence, RunData, Thresholds};
use crate::analysis::stats::{self, Line};

/// Evidence of [`memory_creep`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryCreepEvidence {
    pub rank: u32,
    /// `rss_bytes` or `device_allocated_bytes`.
    pub metric: String,
    /// The steps examined (after warm-up).
    pub first_step: u64,
    pub last_step: u64,
    /// Medians of the four quarters of those steps, in bytes.
    pub quarter_medians: [f64; 4],
    /// Last quarter minus first quarter.
    pub rise_bytes: f64,
    /// Least-squares slope over those steps, in bytes per 1,000 steps.
    pub slope_bytes_per_1000_steps: f64,
}

/// A rank's memory creeps when, after the first `memory_warmup` share of its
/// steps, the medians of the four quarters of the rest rise from each quarter to
/// the next (by at least a tenth of the total rise), and the last exceeds the
/// first by at least `memory_creep_share` of it and by `memory_creep_bytes`.
/// Medians of quarters ignore spikes, and a single step up to a plateau (a cache
/// filling) rises in one or two quarters, not in all three. One diagnosis per
/// (rank, metric).
pub fn memory_creep(run: &RunData, t: &Thresholds) -> Vec<Diagnosis> {
    type Get = fn(&super::StepRecord) -> Option<u64>;
    let metrics: [(&str, Get); 2] = [
        ("rss_bytes", |s| s.rss_bytes),
        ("device_allocated_bytes", |s| s.device_allocated_bytes),
    ];
    let mut found = Vec::new();
    for (metric, get) in metrics {
        let mut per_rank: BTreeMap<u32, Vec<(u64, f64)>> = BTreeMap::new();
        for s in &run.steps {
            if let Some(v) = get(s) {
                per_rank.entry(s.rank).or_default().push((s.step, v as f64));
            }
        }
        for (rank, mut series) in per_rank {
            series.sort_by_key(|p| p.0);
            let skip = (series.len() as f64 * t.memory_warmup).floor() as usize;
            let rest = &series[skip..];
            if rest.len() < t.min_steps.max(8) {
                continue;
            }
            let q = rest.len() / 4;
            let quarter = |i: usize| {
                let end = if i == 3 { rest.len() } else { (i + 1) * q };
                let v: Vec<f64> = rest[i * q..end].iter().map(|p| p.1).collect();
                stats::median(&v).unwrap_or(0.0)
            };
            let medians = [quarter(0), quarter(1), quarter(2), quarter(3)];
            let rise = medians[3] - medians[0];
            let rising = medians.windows(2).all(|w| w[1] - w[0] >= 0.1 * rise);
            if !rising
                || rise < t.memory_creep_share * medians[0]
                || rise < t.memory_creep_bytes as f64
            {
                continue;
            }
            let slope = Line::fit(rest.iter().map(|p| p.0 as f64), rest.iter().map(|p| p.1))
                .map_or(0.0, |l| l.slope * 1000.0);
            let (first_step, last_step) = (rest[0].0, rest[rest.len() - 1].0);
            found.push(Diagnosis {
                message: format!(
                    "memory creep on rank {rank}: {metric} rose {:.1} MiB ({:.0}%) from step {first_step} \
                     to {last_step}, {:.1} MiB per 1000 steps",
                    rise / 1048576.0,
                    100.0 * rise / medians[0].max(1.0),
                    slope / 1048576.0
                ),
                evidence: Evidence::MemoryCreep(MemoryCreepEvidence {
                    rank,
                    metric: metric.into(),
                    first_step,
                    last_step,
                    quarter_medians: medians,
                    rise_bytes: rise,
                    slope_bytes_per_1000_steps: slope,
                }),
            });
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::super::synthetic;
    use super::*;

    #[test]
    fn a_leak_is_creep_and_a_plateau_is_not() {
        let t = Thresholds::default();
        let mut run = synthetic::healthy(2, 1, 400, 4);
        assert!(memory_creep(&run, &t).is_empty());
        // Warm-up growth then a plateau, plus a one-off step up mid-run (a cache).
        for s in &mut run.steps {
            let warm = 500e6 * (s.step.min(50) as f64 / 50.0);
            let cache = if s.step >= 200 { 300e6 } else { 0.0 };
            s.device_allocated_bytes = s.device_allocated_bytes.map(|b| b + (warm + cache) as u64);
        }
        assert!(memory_creep(&run, &t).is_empty());
        // Rank 1 leaks 1 MiB per step.
        for s in run.steps.iter_mut().filter(|s| s.rank == 1) {
            s.rss_bytes = s.rss_bytes.map(|b| b + (s.step << 20));
        }
        let found = memory_creep(&run, &t);
        assert_eq!(found.len(), 1, "{found:#?}");
        let Evidence::MemoryCreep(e) = &found[0].evidence else {
            panic!()
        };
        assert_eq!((e.rank, e.metric.as_str()), (1, "rss_bytes"));
        assert!(
            (e.slope_bytes_per_1000_steps / 1048576.0 - 1000.0).abs() < 20.0,
            "{e:?}"
        );
    }
}
