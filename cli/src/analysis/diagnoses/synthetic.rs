//! Synthetic runs for the diagnoses' tests: a data-parallel job whose ranks
//! compute with noise and meet in an all-reduce, so the rank that arrives last
//! waits least (smallest `comm_ms`) and every rank's backward absorbs its wait.

use rand::SeedableRng;
use rand::rngs::SmallRng;

use super::{LayerRecord, RankInfo, RunData, StepRecord};
use crate::analysis::validity::normal;

pub const LAYERS: [&str; 3] = ["fc1", "fc2", "head"];
pub const SAMPLE_EVERY: u64 = 10;

/// Per-rank multipliers of the healthy model; 1.0 everywhere is healthy.
#[derive(Clone, Debug)]
pub struct Slowdown {
    pub rank: u32,
    pub data: f64,
    pub forward: f64,
}

fn jitter(rng: &mut SmallRng, mean: f64, cv: f64) -> f64 {
    (mean * (1.0 + cv * normal(rng))).max(0.0)
}

/// `ranks` ranks on `nodes` nodes (consecutive ranks share a node), `steps` steps.
pub fn healthy(ranks: u32, nodes: u32, steps: u64, seed: u64) -> RunData {
    build(ranks, nodes, steps, seed, &[])
}

/// As [`healthy`], with `rank`'s forward pass `extra` (a share) slower.
pub fn with_straggler(
    ranks: u32,
    nodes: u32,
    steps: u64,
    seed: u64,
    rank: u32,
    extra: f64,
) -> RunData {
    build(
        ranks,
        nodes,
        steps,
        seed,
        &[Slowdown {
            rank,
            data: 1.0,
            forward: 1.0 + extra,
        }],
    )
}

pub fn build(ranks: u32, nodes: u32, steps: u64, seed: u64, slow: &[Slowdown]) -> RunData {
    let mut rng = SmallRng::seed_from_u64(seed);
    let per_node = ranks.div_ceil(nodes.max(1));
    let mut run = RunData {
        ranks: (0..ranks)
            .map(|r| RankInfo {
                rank: r,
                node_rank: r / per_node,
                hostname: format!("node{}", r / per_node),
            })
            .collect(),
        ..RunData::default()
    };
    for step in 0..steps {
        let allreduce = jitter(&mut rng, 10.0, 0.05);
        let mut phases = Vec::new();
        for r in 0..ranks {
            let s = slow.iter().find(|s| s.rank == r);
            let data = jitter(&mut rng, 5.0, 0.1) * s.map_or(1.0, |s| s.data);
            let forward = jitter(&mut rng, 30.0, 0.05) * s.map_or(1.0, |s| s.forward);
            let backward = jitter(&mut rng, 60.0, 0.05);
            phases.push((data, forward, backward));
        }
        let last = phases
            .iter()
            .map(|(d, f, b)| d + f + b)
            .fold(0.0_f64, f64::max);
        for (r, &(data, forward, backward)) in (0..ranks).zip(&phases) {
            let comm = last - (data + forward + backward) + allreduce;
            let optimizer = jitter(&mut rng, 5.0, 0.05);
            let step_ms = data + forward + backward + comm + optimizer + 1.0;
            run.steps.push(StepRecord {
                rank: r,
                step,
                step_ms,
                data_ms: Some(data),
                forward_ms: Some(forward),
                backward_ms: Some(backward + comm),
                optimizer_ms: Some(optimizer),
                comm_ms: Some(comm),
                overhead_ms: jitter(&mut rng, 0.05, 0.1),
                overhead_device_ms: None,
                overhead_observed_ms: None,
                loss: Some(2.0 * (-(step as f64) / 100.0).exp() + 0.1 + 0.01 * normal(&mut rng)),
                grad_norm: Some(1.0),
                rss_bytes: Some((2e9 + 1e6 * normal(&mut rng)) as u64),
                device_allocated_bytes: Some((4e9 + 1e6 * normal(&mut rng)) as u64),
            });
            if step % SAMPLE_EVERY == 0 {
                for (i, layer) in LAYERS.iter().enumerate() {
                    let base = 20.0 + 10.0 * i as f64;
                    let smooth = base * (1.0 - 0.2 * step as f64 / steps as f64);
                    run.layers.push(LayerRecord {
                        rank: r,
                        step,
                        layer: layer.to_string(),
                        stable_rank: Some(smooth * 0.3 * (1.0 + 0.02 * normal(&mut rng))),
                        effective_rank: Some(smooth * (1.0 + 0.02 * normal(&mut rng))),
                        zero_fraction: Some(0.3 + 0.01 * normal(&mut rng)),
                        nonfinite: 0,
                        compute_ms: Some(0.5 * (i + 1) as f64),
                    });
                }
            }
        }
    }
    run
}
