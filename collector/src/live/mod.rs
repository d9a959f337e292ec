//! The live view: what every rank of every run is doing now, kept in memory from
//! the rows as the collector accepts them (not read back from the files), for
//! `/live` on the `--http` server and `rankscope top`.
//!
//! Per run it holds, per rank, the last `--live-steps` steps (64 by default)
//! and the rank's telemetry counters; per layer, the last [`LAYER_HISTORY`]
//! samples of the lowest rank that samples it; and the run's counters. It is
//! bounded whatever the agents send:
//! - at most [`MAX_RANKS`] ranks over all runs; a rank of a new run past it
//!   evicts the run updated longest ago (the present wins), a rank of a run
//!   already held is left out and counted (`rows_not_shown`);
//! - at most [`MAX_LAYERS`] layers per run, the rest counted the same way.
//!
//! A step takes 232 bytes, so at the defaults a rank takes 14.5 KiB and the view
//! at most 58 MiB (4,096 ranks); a layer's history takes 3 KiB. BENCHMARKS.md
//! has the measured figure at 1,024 ranks. The files
//! are unaffected: the view only reads the record batches the buffer keeps.
//!
//! Cost: a batch is read column by column before the view's lock is taken; the
//! lock is held to append the values, never while a snapshot is serialised.
//! `--live-steps 0` turns the view off (`/live` then answers 404).
//!
//! Layout:
//! - [`snapshot`]: the JSON it answers, as types a viewer reads back;
//! - [`cost`]: what the agent cost a rank, per share of its budget;
//! - [`rows`]: the values read out of a batch's record batches;
//! - this module: [`LiveView`], the state and its bounds.

pub mod cost;
pub mod rows;
pub mod snapshot;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use arrow::array::RecordBatch;
use rankscope_proto::Table;
use rankscope_proto::v1::Hello;

use snapshot::{
    LayerLive, LayerPoint, RankLive, RunCounters, RunList, RunSnapshot, RunSummary, StepPoint,
};

/// Steps kept per rank by default (`--live-steps`): enough for the straggler
/// test's persistence (20 steps) with room to see a trend.
pub const DEFAULT_STEPS: usize = 64;
/// The most `--live-steps` takes.
pub const MAX_STEPS: usize = 4096;
/// Samples kept per layer.
pub const LAYER_HISTORY: usize = 32;
/// Ranks held over all runs: the collector's default `--max-streams`.
pub const MAX_RANKS: usize = 4096;
/// Layers held per run.
pub const MAX_LAYERS: usize = 1024;

#[derive(Debug, Default)]
struct RankState {
    hostname: String,
    node_rank: u32,
    finished: bool,
    samples_dropped: u64,
    samples_skipped: u64,
    rows_dropped: u64,
    steps: VecDeque<StepPoint>,
}

#[derive(Debug, Default)]
struct LayerState {
    rank: u32,
    history: VecDeque<LayerPoint>,
}

#[derive(Debug, Default)]
struct RunState {
    world_size: u32,
    sample_every: Option<u64>,
    updated_us: i64,
    counters: RunCounters,
    ranks: BTreeMap<u32, RankState>,
    /// By name. Every `layers` row of every rank looks its layer up here, so a
    /// fast hash (foldhash, seeded per process) and not an ordered map: a
    /// snapshot sorts the layers by name instead.
    layers: HashMap<String, LayerState, foldhash::fast::RandomState>,
}

impl RunState {
    fn summary(&self, run_id: &str) -> RunSummary {
        RunSummary {
            run_id: run_id.to_string(),
            world_size: self.world_size,
            ranks_seen: self.ranks.len() as u32,
            ranks_finished: self.ranks.values().filter(|r| r.finished).count() as u32,
            last_step: self
                .ranks
                .values()
                .filter_map(|r| r.steps.back().map(|s| s.step))
                .max(),
            updated_us: self.updated_us,
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    runs: HashMap<String, RunState>,
    /// Ranks held over all runs.
    ranks: usize,
}

/// What runs the live diagnoses over a run's snapshot: the diagnoses live in
/// the `rankscope` command's analysis, above the collector, which hands them in
/// ([`crate::CollectorConfig::live_findings`]). It is called when `/live` answers,
/// never on the path of the rows.
#[derive(Clone)]
pub struct Findings(pub Arc<FindingsFn>);

/// The function behind [`Findings`]: a run's snapshot to its findings' JSON.
pub type FindingsFn = dyn Fn(&RunSnapshot) -> Vec<serde_json::Value> + Send + Sync;

impl std::fmt::Debug for Findings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Findings(..)")
    }
}

/// The live view, shared by the streams (which feed it) and the `--http`
/// server (which reads it).
#[derive(Debug)]
pub struct LiveView {
    steps: usize,
    inner: Mutex<Inner>,
}

/// The values of one batch, read before the lock is taken.
#[derive(Debug, Default)]
struct Values<'a> {
    steps: Vec<StepPoint>,
    /// Its `layers` record batches: read under the lock, where the view knows
    /// which layers this rank is followed for (most ranks' rows are not kept).
    layers: Vec<&'a RecordBatch>,
    layer_rows: usize,
    events: Vec<rows::EventPoint>,
    ranks: Vec<rows::RankPoint>,
    /// (step, comm_ms) of its `comm` rows.
    comm: Vec<(u64, f64)>,
    /// The run's `sample_every`, from a `runs` row.
    sample_every: Option<u64>,
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

impl LiveView {
    /// A view keeping `steps` steps per rank (at most [`MAX_STEPS`]).
    pub fn new(steps: usize) -> LiveView {
        LiveView {
            steps: steps.clamp(1, MAX_STEPS),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Steps kept per rank.
    pub fn steps_kept(&self) -> usize {
        self.steps
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain values behind: still usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A rank's stream opened: who it is, and the run's world size.
    pub fn hello(&self, hello: &Hello) {
        let mut inner = self.lock();
        let Some(rank) = rank_slot(&mut inner, &hello.run_id, hello.rank) else {
            return;
        };
        rank.hostname.clone_from(&hello.hostname);
        rank.node_rank = hello.node_rank;
        if let Some(run) = inner.runs.get_mut(&hello.run_id) {
            run.world_size = run.world_size.max(hello.world_size);
            run.updated_us = now_us();
        }
    }

    /// Takes the rows of one accepted batch of `rank` of `run_id`.
    pub fn record(&self, run_id: &str, rank: u32, tables: &[(Table, RecordBatch)]) {
        let mut values = Values::default();
        for (table, batch) in tables {
            match table {
                Table::Steps => values.steps.extend(rows::steps(batch)),
                Table::Layers => {
                    values.layer_rows += batch.num_rows();
                    values.layers.push(batch);
                }
                Table::Events => values.events.extend(rows::events(batch)),
                Table::Ranks => values.ranks.extend(rows::ranks(batch)),
                Table::Comm => values.comm.extend(rows::comm(batch)),
                Table::Runs => values.sample_every = rows::sample_every(batch),
                Table::Model => {}
            }
        }
        let keep = self.steps;
        let mut inner = self.lock();
        let Some(state) = rank_slot(&mut inner, run_id, rank) else {
            if let Some(run) = inner.runs.get_mut(run_id) {
                run.counters.rows_not_shown += (values.steps.len() + values.layer_rows) as u64;
            }
            return;
        };
        let mut counters = RunCounters {
            step_rows: values.steps.len() as u64,
            layer_rows: values.layer_rows as u64,
            ..RunCounters::default()
        };
        for point in values.steps {
            // Steps arrive in order from one rank; a resend after a restart may
            // repeat or go back: keep the deque in step order.
            match state.steps.back() {
                Some(last) if last.step >= point.step => {
                    let at = state.steps.partition_point(|s| s.step < point.step);
                    if state.steps.get(at).is_some_and(|s| s.step == point.step) {
                        state.steps[at] = point;
                    } else {
                        state.steps.insert(at, point);
                    }
                }
                _ => {
                    // Room first: the deque never grows past `keep`.
                    if state.steps.len() >= keep {
                        state.steps.pop_front();
                    }
                    state.steps.push_back(point);
                }
            }
            if state.steps.len() > keep {
                state.steps.pop_front();
            }
        }
        // A step's `comm` rows follow its `steps` row (in the same batch or a
        // later one): their time adds up to its comm_ms where the row had none.
        for (step, ms) in values.comm {
            let at = state.steps.partition_point(|s| s.step < step);
            if let Some(point) = state.steps.get_mut(at).filter(|s| s.step == step)
                && point.comm_from_table
            {
                point.comm_ms = Some(point.comm_ms.unwrap_or(0.0) + ms);
            }
        }
        for event in &values.events {
            let value = event.value.unwrap_or(0).max(0) as u64;
            match event.kind.as_str() {
                "samples_dropped" => {
                    state.samples_dropped += value;
                    counters.samples_dropped += value;
                }
                "samples_skipped" => {
                    state.samples_skipped += value;
                    counters.samples_skipped += value;
                }
                "rows_dropped" => {
                    state.rows_dropped += value;
                    counters.rows_dropped += value;
                }
                "nonfinite_activation" => counters.nonfinite_events += 1,
                _ => {}
            }
        }
        for point in values.ranks {
            state.hostname = point.hostname;
            state.node_rank = point.node_rank;
            state.finished |= point.finished;
        }
        let Some(run) = inner.runs.get_mut(run_id) else {
            return;
        };
        if values.sample_every.is_some() {
            run.sample_every = values.sample_every;
        }
        // A layer is followed on the lowest rank that samples it: a higher
        // rank's rows of a layer already held are skipped unread.
        let mut layers = Vec::new();
        for batch in values.layers {
            layers.extend(rows::layers(batch, |name| {
                run.layers.get(name).is_none_or(|held| rank <= held.rank)
            }));
        }
        for (name, point) in layers {
            if !run.layers.contains_key(&name) {
                if run.layers.len() >= MAX_LAYERS {
                    counters.rows_not_shown += 1;
                    continue;
                }
                let fresh = LayerState {
                    rank,
                    history: VecDeque::new(),
                };
                run.layers.insert(name.clone(), fresh);
            }
            let Some(layer) = run.layers.get_mut(&name) else {
                continue;
            };
            if rank < layer.rank {
                // A lower rank samples it too: follow that one from now on.
                layer.rank = rank;
                layer.history.clear();
            }
            if rank == layer.rank {
                if layer.history.len() >= LAYER_HISTORY {
                    layer.history.pop_front();
                }
                layer.history.push_back(point);
            }
        }
        run.counters.add(&counters);
        run.updated_us = now_us();
    }

    /// Every run held, most recently updated first.
    pub fn runs(&self) -> RunList {
        let inner = self.lock();
        let mut runs: Vec<RunSummary> =
            inner.runs.iter().map(|(id, run)| run.summary(id)).collect();
        runs.sort_by(|a, b| {
            b.updated_us
                .cmp(&a.updated_us)
                .then_with(|| a.run_id.cmp(&b.run_id))
        });
        RunList { runs }
    }

    /// One run, with at most `steps` steps per rank (the newest); `None` when
    /// the view holds no such run.
    pub fn run(&self, run_id: &str, steps: usize) -> Option<RunSnapshot> {
        let inner = self.lock();
        let run = inner.runs.get(run_id)?;
        let ranks = run
            .ranks
            .iter()
            .map(|(&rank, r)| RankLive {
                rank,
                hostname: r.hostname.clone(),
                node_rank: r.node_rank,
                finished: r.finished,
                samples_dropped: r.samples_dropped,
                samples_skipped: r.samples_skipped,
                rows_dropped: r.rows_dropped,
                steps: r
                    .steps
                    .iter()
                    .skip(r.steps.len().saturating_sub(steps))
                    .cloned()
                    .collect(),
                agent_cost: None,
            })
            .map(RankLive::with_agent_cost)
            .collect();
        let mut layers: Vec<LayerLive> = run
            .layers
            .iter()
            .map(|(name, l)| LayerLive {
                layer: name.clone(),
                rank: l.rank,
                history: l.history.iter().cloned().collect(),
            })
            .collect();
        layers.sort_unstable_by(|a, b| a.layer.cmp(&b.layer));
        Some(RunSnapshot {
            summary: run.summary(run_id),
            now_us: now_us(),
            steps_kept: self.steps as u32,
            sample_every: run.sample_every,
            counters: run.counters.clone(),
            ranks,
            layers,
            findings: Vec::new(),
        })
    }
}

/// The state of `rank` of `run_id`, made if there is room ([`MAX_RANKS`]).
fn rank_slot<'a>(inner: &'a mut Inner, run_id: &str, rank: u32) -> Option<&'a mut RankState> {
    let known = inner
        .runs
        .get(run_id)
        .is_some_and(|r| r.ranks.contains_key(&rank));
    if !known {
        if inner.ranks >= MAX_RANKS {
            if inner.runs.contains_key(run_id) {
                return None;
            }
            // A new run: make room by forgetting the run updated longest ago.
            let oldest = inner
                .runs
                .iter()
                .min_by_key(|(_, r)| r.updated_us)
                .map(|(id, _)| id.clone())?;
            let gone = inner.runs.remove(&oldest).map_or(0, |r| r.ranks.len());
            inner.ranks -= gone;
            tracing::info!(run_id = %oldest, ranks = gone, "live view: forgot the run updated longest ago to hold a new one");
        }
        inner.ranks += 1;
    }
    let run = inner.runs.entry(run_id.to_string()).or_default();
    Some(run.ranks.entry(rank).or_default())
}

#[cfg(test)]
mod tests;
