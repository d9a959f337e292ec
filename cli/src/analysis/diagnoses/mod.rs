//! Diagnoses of a run: which rank the others wait for, whether the run waits on
//! its input, whether memory creeps, whether a layer collapsed, died or went
//! non-finite, whether one rank's data differs, and whether the telemetry itself
//! cost too much or lost samples.
//!
//! Every diagnosis is a pure function of a [`RunData`] (plain rows, the same
//! columns as the Parquet tables; see docs/columns.md) and the [`Thresholds`]. It
//! returns [`Diagnosis`] values carrying their evidence (numbers, ranks, steps),
//! serialisable into a JSON report. docs/diagnoses.md lists each threshold and why.
//!
//! Layout:
//! - `timing`: straggler rank, input-bound, imbalance across nodes;
//! - `memory`: memory creep;
//! - `layers`: dimensional collapse, dead layer, non-finite onset, data-shard skew;
//! - `telemetry`: agent overhead above budget, samples or rows dropped.

mod layers;
mod memory;
mod telemetry;
mod timing;

use serde::{Deserialize, Serialize};

pub use layers::{collapse, dead_layers, layer_series, nonfinite_onset, shard_skew};
pub use memory::memory_creep;
pub use telemetry::{
    agent_overhead, budget_percent, cpu_shares, share_of_millionths, telemetry_loss,
};
pub use timing::{input_bound, node_imbalance, straggler};

/// One rank's identity (the `ranks` table).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RankInfo {
    pub rank: u32,
    pub node_rank: u32,
    pub hostname: String,
}

/// One row of the `steps` table (the columns the diagnoses read).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub rank: u32,
    pub step: u64,
    pub step_ms: f64,
    pub data_ms: Option<f64>,
    pub forward_ms: Option<f64>,
    pub backward_ms: Option<f64>,
    pub optimizer_ms: Option<f64>,
    /// Launch to completion of the step's gradient all-reduce (DDP only).
    pub comm_ms: Option<f64>,
    pub overhead_ms: f64,
    /// The agent's device time read in this step (null on CPU).
    #[serde(default)]
    pub overhead_device_ms: Option<f64>,
    /// The step's observed slowdown, on sampled steps and the steps their
    /// work was in flight (signed).
    #[serde(default)]
    pub overhead_observed_ms: Option<f64>,
    pub loss: Option<f64>,
    pub grad_norm: Option<f64>,
    pub rss_bytes: Option<u64>,
    pub device_allocated_bytes: Option<u64>,
}

/// One row of the `layers` table (the columns the diagnoses read).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LayerRecord {
    pub rank: u32,
    pub step: u64,
    pub layer: String,
    pub stable_rank: Option<f64>,
    pub effective_rank: Option<f64>,
    pub zero_fraction: Option<f64>,
    pub nonfinite: u64,
    /// The metrics thread's time computing this row: what sampling the layer cost.
    #[serde(default)]
    pub compute_ms: Option<f64>,
}

/// One row of the `events` table.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EventRecord {
    pub rank: u32,
    pub kind: String,
    pub value: Option<i64>,
    pub step: Option<u64>,
    #[serde(default)]
    pub message: Option<String>,
}

/// A run, as the diagnoses see it. Rows may come in any order.
#[derive(Clone, Debug, Default)]
pub struct RunData {
    /// The agents' overhead budget as a fraction (`runs.overhead_budget`), when
    /// the run recorded it.
    pub overhead_budget: Option<f64>,
    pub ranks: Vec<RankInfo>,
    pub steps: Vec<StepRecord>,
    pub layers: Vec<LayerRecord>,
    pub events: Vec<EventRecord>,
}

/// Every threshold, with its default; docs/diagnoses.md explains each.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Thresholds {
    /// Steps that every rank recorded, below which timing diagnoses stay silent.
    pub min_steps: usize,
    /// Straggler: family-wise false-alarm probability of the persistence test
    /// (binomial, Bonferroni over ranks) on a run without a straggler.
    pub straggler_alpha: f64,
    /// Straggler: the median delay it causes, as a share of the median step.
    pub straggler_min_share: f64,
    /// Input-bound: data time as a share of step time.
    pub input_bound_share: f64,
    /// Node imbalance: (slowest − fastest) / fastest node compute time.
    pub node_imbalance: f64,
    /// Memory creep: share of the run ignored as warm-up.
    pub memory_warmup: f64,
    /// Memory creep: least rise from the first to the last quarter after
    /// warm-up, relative to the first quarter…
    pub memory_creep_share: f64,
    /// …and in bytes.
    pub memory_creep_bytes: u64,
    /// Collapse: least relative drop of stable or effective rank at a jump.
    pub collapse_drop: f64,
    /// Dead layer: zero_fraction at or above this…
    pub dead_zero_fraction: f64,
    /// …in this many of the layer's last samples (all of them).
    pub dead_last_samples: usize,
    /// Shard skew: least robust z-score across ranks…
    pub skew_z: f64,
    /// …and least relative departure from the other ranks' median.
    pub skew_share: f64,
    /// Shard skew: fewest ranks for a robust z-score.
    pub skew_min_ranks: usize,
    /// Agent overhead budget, held on each share (cpu, device, observed) per
    /// rank, for a run that did not record its own (`runs.overhead_budget`;
    /// the agent's default).
    pub overhead_budget: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            min_steps: 20,
            straggler_alpha: 1e-3,
            straggler_min_share: 0.05,
            input_bound_share: 0.20,
            node_imbalance: 0.10,
            memory_warmup: 0.2,
            memory_creep_share: 0.05,
            memory_creep_bytes: 16 << 20,
            collapse_drop: 0.25,
            dead_zero_fraction: 0.99,
            dead_last_samples: 3,
            skew_z: 5.0,
            skew_share: 0.10,
            skew_min_ranks: 4,
            overhead_budget: 0.02,
        }
    }
}

/// A finding, with a sentence for people and the evidence behind it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Diagnosis {
    pub message: String,
    #[serde(flatten)]
    pub evidence: Evidence,
}

/// What each diagnosis found, by kind (`"kind"` in JSON).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Evidence {
    Straggler(timing::StragglerEvidence),
    InputBound(timing::InputBoundEvidence),
    NodeImbalance(timing::NodeImbalanceEvidence),
    MemoryCreep(memory::MemoryCreepEvidence),
    Collapse(layers::CollapseEvidence),
    DeadLayer(layers::DeadLayerEvidence),
    NonfiniteOnset(layers::NonfiniteEvidence),
    ShardSkew(layers::ShardSkewEvidence),
    AgentOverhead(telemetry::OverheadEvidence),
    TelemetryLoss(telemetry::LossEvidence),
}

impl Evidence {
    /// The `kind` string of the JSON form.
    pub fn kind(&self) -> &'static str {
        match self {
            Evidence::Straggler(_) => "straggler",
            Evidence::InputBound(_) => "input_bound",
            Evidence::NodeImbalance(_) => "node_imbalance",
            Evidence::MemoryCreep(_) => "memory_creep",
            Evidence::Collapse(_) => "collapse",
            Evidence::DeadLayer(_) => "dead_layer",
            Evidence::NonfiniteOnset(_) => "nonfinite_onset",
            Evidence::ShardSkew(_) => "shard_skew",
            Evidence::AgentOverhead(_) => "agent_overhead",
            Evidence::TelemetryLoss(_) => "telemetry_loss",
        }
    }
}

/// Every diagnosis of `run`, in the order of the list above.
pub fn diagnose(run: &RunData, t: &Thresholds) -> Vec<Diagnosis> {
    let mut all = Vec::new();
    all.extend(straggler(run, t));
    all.extend(input_bound(run, t));
    all.extend(node_imbalance(run, t));
    all.extend(memory_creep(run, t));
    all.extend(collapse(run, t));
    all.extend(dead_layers(run, t));
    all.extend(nonfinite_onset(run));
    all.extend(shard_skew(run, t));
    all.extend(agent_overhead(run, t));
    all.extend(telemetry_loss(run));
    all
}

#[cfg(test)]
pub(crate) mod synthetic;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_healthy_run_has_no_diagnosis_and_reports_serialise() {
        let run = synthetic::healthy(8, 2, 200, 1);
        let found = diagnose(&run, &Thresholds::default());
        assert!(found.is_empty(), "{found:#?}");
        let sick = synthetic::with_straggler(8, 2, 200, 1, 3, 0.3);
        let found = diagnose(&sick, &Thresholds::default());
        let json = serde_json::to_value(&found).unwrap();
        assert_eq!(json[0]["kind"], "straggler");
        assert_eq!(json[0]["rank"], 3);
        let back: Vec<Diagnosis> = serde_json::from_value(json).unwrap();
        assert_eq!(back, found);
    }
}
