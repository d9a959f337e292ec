//! Layer diagnoses: dimensional collapse, dead layers, the onset of non-finite
//! values, and data-shard skew.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::{Diagnosis, Evidence, LayerRecord, RunData, Thresholds};
use crate::analysis::jumps::{self, Direction, JumpConfig};
use crate::analysis::stats;

type Metric = (&'static str, fn(&LayerRecord) -> Option<f64>);

const DIMENSIONALITY: [Metric; 2] = [
    ("stable_rank", |l| l.stable_rank),
    ("effective_rank", |l| l.effective_rank),
];

/// Rows by layer name.
fn by_layer(run: &RunData) -> BTreeMap<&str, Vec<&LayerRecord>> {
    let mut map: BTreeMap<&str, Vec<&LayerRecord>> = BTreeMap::new();
    for l in &run.layers {
        map.entry(l.layer.as_str()).or_default().push(l);
    }
    map
}

/// Per layer and dimensionality metric (`stable_rank`, `effective_rank`), the
/// median over ranks per sampled step: the series the collapse test reads and
/// the report plots.
pub fn layer_series(run: &RunData) -> BTreeMap<(String, String), Vec<(u64, f64)>> {
    let mut all = BTreeMap::new();
    for (layer, rows) in by_layer(run) {
        for (metric, get) in DIMENSIONALITY {
            let series = median_series(&rows, get);
            if !series.is_empty() {
                all.insert((layer.to_string(), metric.to_string()), series);
            }
        }
    }
    all
}

/// Per step, the median over ranks of a metric's finite values.
fn median_series(rows: &[&LayerRecord], get: fn(&LayerRecord) -> Option<f64>) -> Vec<(u64, f64)> {
    let mut per_step: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    for l in rows {
        if let Some(v) = get(l).filter(|v| v.is_finite()) {
            per_step.entry(l.step).or_default().push(v);
        }
    }
    per_step
        .into_iter()
        .filter_map(|(s, v)| Some((s, stats::median(&v)?)))
        .collect()
}

/// Evidence of [`collapse`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CollapseEvidence {
    pub layer: String,
    /// `stable_rank` or `effective_rank` (the median over ranks at each step).
    pub metric: String,
    /// The first step at the lower level.
    pub step: u64,
    pub before: f64,
    /// Median of the metric from the jump to the end of the run.
    pub after: f64,
    /// (before − after) / before.
    pub drop: f64,
    /// The jump's size in noise units and the detector's confidence.
    pub size: f64,
    pub confidence: f64,
}

/// A layer collapses when the jump detector finds a downward jump in its stable
/// or effective rank (median over ranks per sampled step) and the metric stays
/// down: the median of every value from the jump to the end is at least
/// `collapse_drop` below the level before the jump. A smooth decline is not a
/// jump, and a dip that recovers is not sustained.
pub fn collapse(run: &RunData, t: &Thresholds) -> Vec<Diagnosis> {
    let mut found = Vec::new();
    for ((layer, metric), series) in layer_series(run) {
        let Ok(detection) = jumps::detect(&series, &JumpConfig::default()) else {
            continue;
        };
        for j in detection
            .jumps
            .iter()
            .filter(|j| j.direction == Direction::Down)
        {
            if j.before <= 0.0 {
                continue;
            }
            let rest: Vec<f64> = series
                .iter()
                .filter(|p| p.0 >= j.step)
                .map(|p| p.1)
                .collect();
            let Some(after) = stats::median(&rest) else {
                continue;
            };
            let drop = (j.before - after) / j.before;
            if drop < t.collapse_drop {
                continue;
            }
            found.push(Diagnosis {
                message: format!(
                    "dimensional collapse in {layer}: {metric} fell from {:.2} to {:.2} ({:.0}%) \
                     at step {} and stayed down (jump of {:.1} noise units, confidence {:.3})",
                    j.before,
                    after,
                    100.0 * drop,
                    j.step,
                    j.size,
                    j.confidence
                ),
                evidence: Evidence::Collapse(CollapseEvidence {
                    layer: layer.clone(),
                    metric: metric.clone(),
                    step: j.step,
                    before: j.before,
                    after,
                    drop,
                    size: j.size,
                    confidence: j.confidence,
                }),
            });
        }
    }
    found
}

/// Evidence of [`dead_layers`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeadLayerEvidence {
    pub layer: String,
    /// Median over ranks at the last sampled step.
    pub zero_fraction: f64,
    /// The first step from which the median stayed at or above the threshold.
    pub since_step: u64,
    /// Ranks at or above the threshold at the last sampled step.
    pub ranks: Vec<u32>,
}

/// A layer is dead when the median over ranks of its zero_fraction is at least
/// `dead_zero_fraction` at each of its last `dead_last_samples` sampled steps:
/// (almost) every output is exactly 0, as with dead ReLU units.
pub fn dead_layers(run: &RunData, t: &Thresholds) -> Vec<Diagnosis> {
    let mut found = Vec::new();
    for (layer, rows) in by_layer(run) {
        let series = median_series(&rows, |l| l.zero_fraction);
        let n = t.dead_last_samples.max(1);
        if series.len() < n
            || series[series.len() - n..]
                .iter()
                .any(|p| p.1 < t.dead_zero_fraction)
        {
            continue;
        }
        let since = series
            .iter()
            .rposition(|p| p.1 < t.dead_zero_fraction)
            .map_or(series[0].0, |i| series[i + 1].0);
        let (last_step, zero_fraction) = series[series.len() - 1];
        let ranks: BTreeSet<u32> = rows
            .iter()
            .filter(|l| {
                l.step == last_step && l.zero_fraction.is_some_and(|z| z >= t.dead_zero_fraction)
            })
            .map(|l| l.rank)
            .collect();
        found.push(Diagnosis {
            message: format!(
                "dead layer {layer}: {:.1}% of its outputs are exactly 0 since step {since} (ranks {:?})",
                100.0 * zero_fraction,
                ranks
            ),
            evidence: Evidence::DeadLayer(DeadLayerEvidence {
                layer: layer.to_string(),
                zero_fraction,
                since_step: since,
                ranks: ranks.into_iter().collect(),
            }),
        });
    }
    found
}

/// Evidence of [`nonfinite_onset`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NonfiniteEvidence {
    /// The first step with a non-finite value anywhere.
    pub step: u64,
    /// Layers with non-finite activations at that step (empty if only the loss
    /// or gradient norm was).
    pub layers: Vec<String>,
    /// Ranks with a non-finite value at that step.
    pub ranks: Vec<u32>,
    /// NaN/±Inf elements in those layers' samples at that step.
    pub elements: u64,
    /// The first step whose loss or grad_norm is non-finite, if any.
    pub loss_step: Option<u64>,
    /// The first step with a non-finite activation, if any.
    pub activation_step: Option<u64>,
}

/// The first step where a layer's activation held NaN/±Inf (`nonfinite` > 0) or
/// the loss or gradient norm was non-finite, with the layers and ranks at that
/// step. No threshold: one non-finite value is a finding.
pub fn nonfinite_onset(run: &RunData) -> Option<Diagnosis> {
    let activation_step = run
        .layers
        .iter()
        .filter(|l| l.nonfinite > 0)
        .map(|l| l.step)
        .min();
    let bad = |v: Option<f64>| v.is_some_and(|v| !v.is_finite());
    let loss_step = run
        .steps
        .iter()
        .filter(|s| bad(s.loss) || bad(s.grad_norm))
        .map(|s| s.step)
        .min();
    let step = activation_step.into_iter().chain(loss_step).min()?;
    let at: Vec<&LayerRecord> = run
        .layers
        .iter()
        .filter(|l| l.step == step && l.nonfinite > 0)
        .collect();
    let layers: BTreeSet<String> = at.iter().map(|l| l.layer.clone()).collect();
    let mut ranks: BTreeSet<u32> = at.iter().map(|l| l.rank).collect();
    ranks.extend(
        run.steps
            .iter()
            .filter(|s| s.step == step && (bad(s.loss) || bad(s.grad_norm)))
            .map(|s| s.rank),
    );
    let elements = at.iter().map(|l| l.nonfinite).sum();
    let layers: Vec<String> = layers.into_iter().collect();
    let ranks: Vec<u32> = ranks.into_iter().collect();
    let place = if layers.is_empty() {
        "the loss or gradient norm".to_string()
    } else {
        format!(
            "layer{} {}",
            if layers.len() == 1 { "" } else { "s" },
            layers.join(", ")
        )
    };
    Some(Diagnosis {
        message: format!("non-finite values from step {step}: first in {place} on ranks {ranks:?}"),
        evidence: Evidence::NonfiniteOnset(NonfiniteEvidence {
            step,
            layers,
            ranks,
            elements,
            loss_step,
            activation_step,
        }),
    })
}

/// Evidence of [`shard_skew`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardSkewEvidence {
    pub layer: String,
    pub rank: u32,
    /// `effective_rank`, or `stable_rank` when the layer has no effective rank.
    pub metric: String,
    /// The rank's median of the metric over the run.
    pub value: f64,
    /// The other ranks' median and (normal-consistent) MAD of their medians.
    pub others_median: f64,
    pub others_mad: f64,
    /// (value − others_median) / others_mad, the MAD floored at 1% of the median.
    pub z: f64,
}

/// Data-parallel ranks hold the same weights, so a layer's dimensionality should
/// agree across ranks; a rank that departs points at its data shard. Per layer,
/// each rank's median effective rank over the run is compared with the other
/// ranks' (leave-one-out robust z-score, MAD floored at 1% of the median). A rank
/// is reported when |z| ≥ `skew_z` and it departs by at least `skew_share` of the
/// others' median; it needs `skew_min_ranks` ranks.
pub fn shard_skew(run: &RunData, t: &Thresholds) -> Vec<Diagnosis> {
    let mut found = Vec::new();
    for (layer, rows) in by_layer(run) {
        let (metric, get) = if rows.iter().any(|l| l.effective_rank.is_some()) {
            DIMENSIONALITY[1]
        } else {
            DIMENSIONALITY[0]
        };
        let mut per_rank: BTreeMap<u32, Vec<f64>> = BTreeMap::new();
        for l in &rows {
            if let Some(v) = get(l).filter(|v| v.is_finite()) {
                per_rank.entry(l.rank).or_default().push(v);
            }
        }
        let medians: Vec<(u32, f64)> = per_rank
            .iter()
            .filter_map(|(r, v)| Some((*r, stats::median(v)?)))
            .collect();
        if medians.len() < t.skew_min_ranks.max(3) {
            continue;
        }
        for &(rank, value) in &medians {
            let others: Vec<f64> = medians
                .iter()
                .filter(|m| m.0 != rank)
                .map(|m| m.1)
                .collect();
            let (Some(med), Some(mad)) = (stats::median(&others), stats::mad(&others)) else {
                continue;
            };
            let scale = mad.max(0.01 * med.abs()).max(f64::MIN_POSITIVE);
            let z = (value - med) / scale;
            if z.abs() < t.skew_z || (value - med).abs() < t.skew_share * med.abs() {
                continue;
            }
            found.push(Diagnosis {
                message: format!(
                    "data-shard skew in {layer}: rank {rank}'s {metric} is {value:.2} against {med:.2} \
                     on the other ranks (robust z {z:+.1}); check its data shard"
                ),
                evidence: Evidence::ShardSkew(ShardSkewEvidence {
                    layer: layer.to_string(),
                    rank,
                    metric: metric.into(),
                    value,
                    others_median: med,
                    others_mad: mad,
                    z,
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
    fn collapse_is_a_sustained_drop_not_a_decline() {
        let t = Thresholds::default();
        let mut run = synthetic::healthy(4, 1, 1000, 5);
        assert!(collapse(&run, &t).is_empty(), "{:#?}", collapse(&run, &t));
        // fc2's stable rank halves from step 600 on, on every rank.
        for l in run
            .layers
            .iter_mut()
            .filter(|l| l.layer == "fc2" && l.step >= 600)
        {
            l.stable_rank = l.stable_rank.map(|v| v * 0.5);
        }
        // head dips by half for 5 samples and recovers: not sustained.
        for l in run
            .layers
            .iter_mut()
            .filter(|l| l.layer == "head" && (300..350).contains(&l.step))
        {
            l.effective_rank = l.effective_rank.map(|v| v * 0.5);
        }
        let found = collapse(&run, &t);
        assert_eq!(found.len(), 1, "{found:#?}");
        let Evidence::Collapse(e) = &found[0].evidence else {
            panic!()
        };
        assert_eq!(
            (e.layer.as_str(), e.metric.as_str(), e.step),
            ("fc2", "stable_rank", 600)
        );
        assert!((e.drop - 0.5).abs() < 0.1, "{e:?}");
    }

    #[test]
    fn dead_layer_since_when() {
        let t = Thresholds::default();
        let mut run = synthetic::healthy(2, 1, 200, 6);
        assert!(dead_layers(&run, &t).is_empty());
        for l in run
            .layers
            .iter_mut()
            .filter(|l| l.layer == "fc1" && l.step >= 150)
        {
            l.zero_fraction = Some(1.0);
        }
        // A layer near-dead but not quite (0.97) is not dead.
        for l in run.layers.iter_mut().filter(|l| l.layer == "fc2") {
            l.zero_fraction = Some(0.97);
        }
        let found = dead_layers(&run, &t);
        assert_eq!(found.len(), 1, "{found:#?}");
        let Evidence::DeadLayer(e) = &found[0].evidence else {
            panic!()
        };
        assert_eq!(
            (e.layer.as_str(), e.since_step, e.ranks.clone()),
            ("fc1", 150, vec![0, 1])
        );
    }

    #[test]
    fn nonfinite_onset_names_step_layer_and_rank() {
        let mut run = synthetic::healthy(4, 1, 100, 7);
        assert!(nonfinite_onset(&run).is_none());
        for l in run
            .layers
            .iter_mut()
            .filter(|l| l.rank == 2 && l.step >= 60)
        {
            if l.layer == "fc2" || l.step > 60 {
                l.nonfinite = 12;
            }
        }
        for s in run.steps.iter_mut().filter(|s| s.step >= 61) {
            s.loss = Some(f64::NAN);
        }
        let d = nonfinite_onset(&run).expect("onset");
        let Evidence::NonfiniteOnset(e) = &d.evidence else {
            panic!()
        };
        assert_eq!(e.step, 60);
        assert_eq!(e.layers, vec!["fc2".to_string()]);
        assert_eq!(e.ranks, vec![2]);
        assert_eq!(
            (e.elements, e.loss_step, e.activation_step),
            (12, Some(61), Some(60))
        );
    }

    #[test]
    fn shard_skew_finds_the_odd_rank() {
        let t = Thresholds::default();
        let mut run = synthetic::healthy(8, 2, 200, 8);
        assert!(
            shard_skew(&run, &t).is_empty(),
            "{:#?}",
            shard_skew(&run, &t)
        );
        for l in run
            .layers
            .iter_mut()
            .filter(|l| l.rank == 6 && l.layer == "fc1")
        {
            l.effective_rank = l.effective_rank.map(|v| v * 0.7);
        }
        let found = shard_skew(&run, &t);
        assert_eq!(found.len(), 1, "{found:#?}");
        let Evidence::ShardSkew(e) = &found[0].evidence else {
            panic!()
        };
        assert_eq!((e.layer.as_str(), e.rank), ("fc1", 6));
        assert!(e.z < -5.0, "{e:?}");
        // Too few ranks for a z-score.
        assert!(shard_skew(&synthetic::healthy(3, 1, 100, 8), &t).is_empty());
    }
}
