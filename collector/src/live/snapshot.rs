//! What the live view answers: the JSON of `/live/runs` and `/live/runs/<run>`
//! (and each event of `/live/runs/<run>/events`), as Rust types that serialise
//! to it and that a viewer (`rankscope top`) reads back.
//!
//! The field names are the columns' names (docs/columns.md): `step_ms`,
//! `comm_ms`, `rss_bytes`, `stable_rank`, `samples_skipped`, … A value the rank did
//! not record is left out of the JSON (`None` here), as it is null in the tables.

use serde::{Deserialize, Serialize};

use super::cost::{AgentCost, CostRow};

/// `GET /live/runs`: every run the live view holds, most recently updated first.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunList {
    pub runs: Vec<RunSummary>,
}

/// One run, in a line.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    pub run_id: String,
    /// Processes in the job, from the ranks' `Hello` (0 until one arrived).
    pub world_size: u32,
    /// Ranks that sent anything to this collector.
    pub ranks_seen: u32,
    /// Ranks whose final batch (their `ranks` row) arrived.
    pub ranks_finished: u32,
    /// The highest step any rank recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_step: Option<u64>,
    /// When the collector last took a row of the run (µs since the Unix epoch).
    pub updated_us: i64,
}

/// `GET /live/runs/<run>`: what the live view holds of one run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunSnapshot {
    #[serde(flatten)]
    pub summary: RunSummary,
    /// The collector's clock when it answered (µs since the Unix epoch), for
    /// the age of the newest row.
    pub now_us: i64,
    /// The most steps it keeps per rank (`--live-steps`).
    pub steps_kept: u32,
    /// The run's `sample_every` (its `runs` row, which rank 0 sends), against
    /// which a viewer tells whether a layer's history carries a trend; absent
    /// until that row arrived, and on a collector that holds no rank 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample_every: Option<u64>,
    /// Counters over the run, summed over its ranks.
    pub counters: RunCounters,
    /// Every rank seen, by rank.
    pub ranks: Vec<RankLive>,
    /// Every layer seen, by name.
    pub layers: Vec<LayerLive>,
    /// The live diagnoses of the run, when the collector runs them (the
    /// `rankscope collector` command does: `Diagnosis` JSON of docs/diagnoses.md,
    /// each with `fired_at_step`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub findings: Vec<serde_json::Value>,
}

impl RunSnapshot {
    /// Keeps each rank's newest `steps` steps (what a viewer draws), after the
    /// diagnoses read the whole window, and sets each rank's `agent_cost` over
    /// them.
    pub fn keep_last_steps(&mut self, steps: usize) {
        for r in &mut self.ranks {
            let extra = r.steps.len().saturating_sub(steps);
            r.steps.drain(..extra);
            r.agent_cost = r.cost_of_steps();
        }
    }
}

/// What the ranks of a run reported about their own telemetry, and what the
/// live view left out to stay within its bounds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunCounters {
    /// `samples_dropped` events, their `value` summed.
    pub samples_dropped: u64,
    /// `samples_skipped` events, their `value` summed.
    pub samples_skipped: u64,
    /// `rows_dropped` events, their `value` summed.
    pub rows_dropped: u64,
    /// `nonfinite_activation` events.
    pub nonfinite_events: u64,
    /// `steps` rows taken.
    pub step_rows: u64,
    /// `layers` rows taken.
    pub layer_rows: u64,
    /// Rows of ranks or layers past the view's bounds (not shown; still
    /// written to the files).
    pub rows_not_shown: u64,
}

impl RunCounters {
    /// Adds `other`'s counts to these (a batch's to its run's, or one
    /// collector's to a merged view's).
    pub fn add(&mut self, other: &RunCounters) {
        self.samples_dropped += other.samples_dropped;
        self.samples_skipped += other.samples_skipped;
        self.rows_dropped += other.rows_dropped;
        self.nonfinite_events += other.nonfinite_events;
        self.step_rows += other.step_rows;
        self.layer_rows += other.layer_rows;
        self.rows_not_shown += other.rows_not_shown;
    }
}

/// One rank: who it is, its last steps (oldest first), its own counters.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RankLive {
    pub rank: u32,
    pub hostname: String,
    pub node_rank: u32,
    /// Its final batch arrived.
    pub finished: bool,
    pub samples_dropped: u64,
    pub samples_skipped: u64,
    pub rows_dropped: u64,
    /// Its last steps, in step order, at most `steps_kept` (or the `steps`
    /// the request asked for).
    pub steps: Vec<StepPoint>,
    /// What the agent cost the rank over those steps, per share of its budget
    /// ([`super::cost`]); absent until a step arrived.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_cost: Option<AgentCost>,
}

impl RankLive {
    /// The rank with its `agent_cost` set over its steps.
    pub fn with_agent_cost(mut self) -> RankLive {
        self.agent_cost = self.cost_of_steps();
        self
    }

    fn cost_of_steps(&self) -> Option<AgentCost> {
        (!self.steps.is_empty()).then(|| AgentCost::of(self.steps.iter().map(CostRow::from)))
    }
}

/// One `steps` row, as the live view keeps it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepPoint {
    pub step: u64,
    /// End of the step (µs since the Unix epoch), the rank's clock.
    pub time_us: i64,
    pub step_ms: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forward_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backward_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_ms: Option<f64>,
    /// The step's `comm_ms`; where its row has none (an FSDP run, a loop of
    /// the user's own collectives), the sum of its `comm` rows' `comm_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_ms: Option<f64>,
    /// Whether `comm_ms` is that sum (the `comm` rows of the step add to it).
    #[serde(skip)]
    pub comm_from_table: bool,
    pub overhead_ms: f64,
    /// The agent's device time read in this step; absent on CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overhead_device_ms: Option<f64>,
    /// The step's observed slowdown, on sampled steps and the steps their work
    /// was in flight (signed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overhead_observed_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rss_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_allocated_bytes: Option<u64>,
}

/// One layer: its latest values and a short history, from the lowest rank that
/// samples it (rank 0 in every mode that samples layers).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LayerLive {
    pub layer: String,
    /// The rank whose samples these are.
    pub rank: u32,
    /// Its last samples, in step order (the newest is the latest value).
    pub history: Vec<LayerPoint>,
}

/// One `layers` row, the dimensionality and health columns.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LayerPoint {
    pub step: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stable_rank: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub participation_ratio: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effective_rank: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero_fraction: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub std: Option<f64>,
    pub nonfinite: u64,
}
