//! The report's JSON summary: a versioned schema (docs/report.md) built from SQL
//! over the dataset and from the diagnoses. The HTML page and `compare` read this
//! struct, never the files again.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::analysis::agent_cost;
use crate::analysis::coverage::{self, Coverage};
use crate::analysis::diagnoses::{self, Diagnosis, RunData, Thresholds};
use crate::analysis::jumps::{self, Jump, JumpConfig};
use crate::output_query::{Dataset, RunInfo, floats, ints, literal, strings};

/// The `schema` field of every report.
pub const SCHEMA: &str = "rankscope.report";
/// Bumped on any change that can break a reader; additions keep it.
pub const SCHEMA_VERSION: u32 = 1;

/// The phases with a time column in `steps`, in the order of a step.
pub const PHASES: [&str; 7] = [
    "step",
    "data",
    "forward",
    "backward",
    "optimizer",
    "comm",
    "overhead",
];

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Report {
    pub schema: String,
    pub schema_version: u32,
    pub run: Run,
    /// Per rank, in rank order.
    pub ranks: Vec<RankSummary>,
    pub loss: Option<LossSummary>,
    /// Per layer, in the order of first sampling.
    pub layers: Vec<LayerSummary>,
    /// The static model profile of the lowest rank that sent one.
    pub model: Vec<ModelLayer>,
    pub diagnoses: Vec<Diagnosis>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Run {
    /// The run's configuration (its `runs` row), as the query layer reads it.
    #[serde(flatten)]
    pub info: RunInfo,
    /// Ranks with at least one `steps` row.
    pub ranks_seen: usize,
    /// Ranks with a `ranks` row whose `finished_at` is set; fewer than
    /// `ranks_seen` while the run is still going.
    pub ranks_finished: usize,
    pub last_step: Option<u64>,
    /// The agents' overhead budget as a fraction (`runs.overhead_budget`), when
    /// the run recorded it.
    #[serde(default)]
    pub overhead_budget: Option<f64>,
}

/// Percentiles of one phase's time over a rank's steps (ms).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PhaseStats {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub mean: f64,
    /// Steps that timed the phase.
    pub steps: u64,
    /// The step-to-step spread: 1.4826 · median |x − p50| (the normal-consistent
    /// MAD); `compare` derives its noise band from it. Absent in reports
    /// written before it was added.
    #[serde(default)]
    pub mad: Option<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RankSummary {
    pub rank: u32,
    pub node_rank: u32,
    pub hostname: String,
    pub steps: u64,
    /// By phase name (see [`PHASES`]); phases never timed are absent.
    pub phases: BTreeMap<String, PhaseStats>,
    /// Σ overhead_ms / Σ step_ms, in percent.
    pub overhead_pct: Option<f64>,
    /// The agent's share of the process's CPU time, in percent, as it reported
    /// at finish (`overhead_share`); absent for a rank that did not finish and
    /// in reports written before it was added.
    #[serde(default)]
    pub cpu_pct: Option<f64>,
    /// Σ overhead_device_ms / Σ step_ms, in percent: the agent's device time;
    /// absent where the rank recorded none (CPU) and in older reports.
    #[serde(default)]
    pub device_pct: Option<f64>,
    /// The observed slowdown, in percent of step time: median
    /// overhead_observed_ms × `observed_steps` / Σ step_ms
    /// (`analysis::agent_cost`); absent where no step has a value.
    #[serde(default)]
    pub observed_pct: Option<f64>,
    /// Steps with an overhead_observed_ms value.
    #[serde(default)]
    pub observed_steps: u64,
    pub peak_rss_bytes: Option<u64>,
    pub peak_device_allocated_bytes: Option<u64>,
    pub samples_dropped: i64,
    /// Planned samples the overhead budget had no room for.
    pub samples_skipped: i64,
    pub rows_dropped: i64,
    /// The rank's collectives by kind (the `comm` table, all steps and between
    /// them); empty for runs without one and in reports written before it.
    #[serde(default)]
    pub comm: BTreeMap<String, CommSummary>,
}

/// One kind of collective on one rank, over the whole run.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CommSummary {
    pub count: u64,
    pub bytes: u64,
    /// Launch to completion, summed.
    pub comm_ms: f64,
    /// bytes / comm_ms, in MB/s (10⁶ bytes); waiting for peers included.
    pub mb_per_s: Option<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LossSummary {
    pub first: f64,
    #[serde(rename = "final")]
    pub last: f64,
    pub min: f64,
    pub steps: usize,
    /// Jumps in the mean loss over ranks.
    pub jumps: Vec<JumpMark>,
    /// (step, mean loss over ranks).
    pub series: Vec<(u64, f64)>,
}

/// A detected jump, as the report keeps it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct JumpMark {
    pub step: u64,
    pub direction: String,
    pub size: f64,
    pub before: f64,
    pub after: f64,
    pub confidence: f64,
}

impl From<&Jump> for JumpMark {
    fn from(j: &Jump) -> Self {
        JumpMark {
            step: j.step,
            direction: j.direction.to_string(),
            size: j.size,
            before: j.before,
            after: j.after,
            confidence: j.confidence,
        }
    }
}

/// One dimensionality metric of a layer: its median over ranks per sampled step.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct MetricTrend {
    pub first: f64,
    #[serde(rename = "final")]
    pub last: f64,
    /// (final − first) / first.
    pub change: Option<f64>,
    pub jumps: Vec<JumpMark>,
    /// (step, value) of the series, for plots and comparisons.
    pub series: Vec<(u64, f64)>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LayerSummary {
    pub layer: String,
    pub samples: u64,
    pub stable_rank: Option<MetricTrend>,
    pub effective_rank: Option<MetricTrend>,
    /// The last sampled step's mean over ranks.
    pub final_zero_fraction: Option<f64>,
    pub nonfinite: u64,
    /// Planned samples against those measured, and whether the series carries
    /// a trend (`analysis::coverage`); when it does not, the trends' `change`
    /// is null and `note` says why. Absent in reports written before it.
    #[serde(default)]
    pub coverage: Option<Coverage>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ModelLayer {
    pub layer: String,
    pub kind: String,
    pub params: u64,
    pub param_bytes: u64,
    pub forward_flops: u64,
    pub output_shape: String,
}

/// Builds the report of `run` from the dataset. `data` is the run's rows,
/// read once by the caller for the diagnoses and the plots.
pub fn build(dataset: &Dataset, info: &RunInfo, data: &RunData) -> anyhow::Result<Report> {
    let id = literal(&info.run_id);
    let ranks = rank_summaries(dataset, &info.run_id, data)?;
    let finished = dataset.sql(&format!(
        "SELECT count(DISTINCT rank) AS n FROM ranks
         WHERE run_id = {id} AND finished_at IS NOT NULL"
    ))?;
    let ranks_finished = finished
        .first()
        .map(|b| ints(b, "n"))
        .transpose()?
        .and_then(|v| v.first().copied().flatten())
        .unwrap_or(0) as usize;
    let last_step = data.steps.iter().map(|s| s.step).max();
    Ok(Report {
        schema: SCHEMA.into(),
        schema_version: SCHEMA_VERSION,
        run: Run {
            info: info.clone(),
            ranks_seen: ranks.len(),
            ranks_finished,
            last_step,
            overhead_budget: data.overhead_budget,
        },
        ranks,
        loss: loss_summary(dataset, &id)?,
        layers: layer_summaries(dataset, &id, data, info.sample_every)?,
        model: model(dataset, &id)?,
        diagnoses: diagnoses::diagnose(data, &Thresholds::default()),
    })
}

fn rank_summaries(
    dataset: &Dataset,
    run_id: &str,
    data: &RunData,
) -> anyhow::Result<Vec<RankSummary>> {
    let id = literal(run_id);
    let mut select = String::from(
        "SELECT CAST(rank AS BIGINT) AS rank, count(*) AS steps,
                100 * sum(overhead_ms) / sum(step_ms) AS overhead_pct,
                CAST(max(rss_bytes) AS BIGINT) AS peak_rss,
                CAST(max(device_allocated_bytes) AS BIGINT) AS peak_device",
    );
    for phase in PHASES {
        let c = format!("{phase}_ms");
        for (q, name) in [(0.5, "p50"), (0.95, "p95"), (0.99, "p99")] {
            select +=
                &format!(", percentile_cont({q}) WITHIN GROUP (ORDER BY {c}) AS {phase}_{name}");
        }
        select += &format!(", avg({c}) AS {phase}_mean, count({c}) AS {phase}_n");
    }
    select += &format!(" FROM steps WHERE run_id = {id} GROUP BY rank ORDER BY rank");
    let events = dataset.rank_events(run_id)?;
    let mut comm = comm_by_rank(dataset, &id)?;
    let spread = phase_mads(dataset, &id)?;
    let costs = agent_cost::rank_costs(&data.steps);
    let mut out = Vec::new();
    for b in &dataset.sql(&select)? {
        let (rank, steps) = (ints(b, "rank")?, ints(b, "steps")?);
        let overhead = floats(b, "overhead_pct")?;
        let (rss, dev) = (ints(b, "peak_rss")?, ints(b, "peak_device")?);
        let mut phase_cols = Vec::new();
        for phase in PHASES {
            phase_cols.push((
                phase,
                floats(b, &format!("{phase}_p50"))?,
                floats(b, &format!("{phase}_p95"))?,
                floats(b, &format!("{phase}_p99"))?,
                floats(b, &format!("{phase}_mean"))?,
                ints(b, &format!("{phase}_n"))?,
            ));
        }
        for i in 0..b.num_rows() {
            let r = rank[i].unwrap_or_default();
            let info = data.ranks.iter().find(|x| i64::from(x.rank) == r);
            let mut phases = BTreeMap::new();
            for (phase, p50, p95, p99, mean, n) in &phase_cols {
                if let (Some(p50), Some(p95), Some(p99), Some(mean), Some(n)) =
                    (p50[i], p95[i], p99[i], mean[i], n[i])
                    && n > 0
                {
                    phases.insert(
                        phase.to_string(),
                        PhaseStats {
                            p50,
                            p95,
                            p99,
                            mean,
                            steps: n as u64,
                            mad: spread.get(&(r, *phase)).copied(),
                        },
                    );
                }
            }
            let e = events.get(&r).copied().unwrap_or_default();
            let cost = costs.get(&(r as u32)).cloned().unwrap_or_default();
            out.push(RankSummary {
                rank: r as u32,
                node_rank: info.map_or(0, |x| x.node_rank),
                hostname: info.map(|x| x.hostname.clone()).unwrap_or_default(),
                steps: steps[i].unwrap_or_default() as u64,
                phases,
                overhead_pct: overhead[i],
                cpu_pct: e.cpu_pct(),
                device_pct: cost.device.map(|d| 100.0 * d),
                observed_pct: cost.observed.map(|o| 100.0 * o),
                observed_steps: cost.observed_steps as u64,
                peak_rss_bytes: rss[i].map(|v| v as u64),
                peak_device_allocated_bytes: dev[i].map(|v| v as u64),
                samples_dropped: e.samples_dropped,
                samples_skipped: e.samples_skipped,
                rows_dropped: e.rows_dropped,
                comm: comm.remove(&r).unwrap_or_default(),
            });
        }
    }
    Ok(out)
}

/// Per (rank, phase), the normal-consistent median absolute deviation of the
/// phase's time over the rank's steps.
fn phase_mads(dataset: &Dataset, id: &str) -> anyhow::Result<BTreeMap<(i64, &'static str), f64>> {
    let (mut medians, mut deviations) = (Vec::new(), Vec::new());
    for phase in PHASES {
        medians.push(format!("median({phase}_ms) AS {phase}_m"));
        deviations.push(format!(
            "1.4826 * median(abs(s.{phase}_ms - m.{phase}_m)) AS {phase}_mad"
        ));
    }
    let mut out = BTreeMap::new();
    for b in &dataset.sql(&format!(
        "WITH m AS (SELECT rank, {} FROM steps WHERE run_id = {id} GROUP BY rank)
         SELECT CAST(s.rank AS BIGINT) AS rank, {}
         FROM steps s JOIN m ON m.rank = s.rank
         WHERE s.run_id = {id} GROUP BY s.rank",
        medians.join(", "),
        deviations.join(", ")
    ))? {
        let rank = ints(b, "rank")?;
        for phase in PHASES {
            let mad = floats(b, &format!("{phase}_mad"))?;
            for i in 0..b.num_rows() {
                if let (Some(r), Some(v)) = (rank[i], mad[i]) {
                    out.insert((r, phase), v);
                }
            }
        }
    }
    Ok(out)
}

/// Per rank, its collectives by kind.
fn comm_by_rank(
    dataset: &Dataset,
    id: &str,
) -> anyhow::Result<BTreeMap<i64, BTreeMap<String, CommSummary>>> {
    let mut out: BTreeMap<i64, BTreeMap<String, CommSummary>> = BTreeMap::new();
    for b in &dataset.sql(&format!(
        "SELECT CAST(rank AS BIGINT) AS rank, kind, CAST(sum(count) AS BIGINT) AS n,
                CAST(sum(bytes) AS DOUBLE) AS bytes, sum(comm_ms) AS comm_ms
         FROM comm WHERE run_id = {id} GROUP BY rank, kind ORDER BY rank, kind"
    ))? {
        let (rank, kind, n) = (ints(b, "rank")?, strings(b, "kind")?, ints(b, "n")?);
        let (bytes, ms) = (floats(b, "bytes")?, floats(b, "comm_ms")?);
        for i in 0..b.num_rows() {
            let (bytes, comm_ms) = (bytes[i].unwrap_or_default(), ms[i].unwrap_or_default());
            out.entry(rank[i].unwrap_or_default()).or_default().insert(
                kind[i].clone().unwrap_or_default(),
                CommSummary {
                    count: n[i].unwrap_or_default().max(0) as u64,
                    bytes: bytes.max(0.0) as u64,
                    comm_ms,
                    mb_per_s: (comm_ms > 0.0).then(|| bytes / comm_ms / 1e3),
                },
            );
        }
    }
    Ok(out)
}

/// The mean loss over ranks per step, and its jumps.
pub fn loss_series(dataset: &Dataset, id: &str) -> anyhow::Result<Vec<(u64, f64)>> {
    let mut points = Vec::new();
    for b in &dataset.sql(&format!(
        "SELECT CAST(step AS BIGINT) AS step, avg(loss) AS loss FROM steps
         WHERE run_id = {id} AND loss IS NOT NULL AND NOT isnan(loss)
         GROUP BY step ORDER BY step"
    ))? {
        let (step, loss) = (ints(b, "step")?, floats(b, "loss")?);
        for i in 0..b.num_rows() {
            if let (Some(s), Some(l)) = (step[i], loss[i])
                && l.is_finite()
            {
                points.push((s as u64, l));
            }
        }
    }
    Ok(points)
}

fn detect(points: &[(u64, f64)]) -> Vec<JumpMark> {
    jumps::detect(points, &JumpConfig::default())
        .map(|d| d.jumps.iter().map(JumpMark::from).collect())
        .unwrap_or_default()
}

fn loss_summary(dataset: &Dataset, id: &str) -> anyhow::Result<Option<LossSummary>> {
    let points = loss_series(dataset, id)?;
    let (Some(&(_, first)), Some(&(_, last))) = (points.first(), points.last()) else {
        return Ok(None);
    };
    Ok(Some(LossSummary {
        first,
        last,
        min: points.iter().map(|p| p.1).fold(f64::INFINITY, f64::min),
        steps: points.len(),
        jumps: detect(&points),
        series: points,
    }))
}

fn trend(series: Vec<(u64, f64)>) -> Option<MetricTrend> {
    let (first, last) = (series.first()?.1, series.last()?.1);
    Some(MetricTrend {
        first,
        last,
        change: (first != 0.0).then(|| (last - first) / first),
        jumps: detect(&series),
        series,
    })
}

fn layer_summaries(
    dataset: &Dataset,
    id: &str,
    data: &RunData,
    sample_every: Option<u64>,
) -> anyhow::Result<Vec<LayerSummary>> {
    let mut series = diagnoses::layer_series(data);
    let mut covered = coverage::layer_coverage(data, sample_every);
    let mut out = Vec::new();
    for b in &dataset.sql(&format!(
        "WITH last AS (SELECT layer, max(step) AS step FROM layers WHERE run_id = {id} GROUP BY layer)
         SELECT l.layer, count(*) AS samples, CAST(sum(l.nonfinite) AS BIGINT) AS nonfinite,
                avg(CASE WHEN l.step = last.step THEN l.zero_fraction END) AS zero_fraction,
                min(l.time) AS seen
         FROM layers l JOIN last ON last.layer = l.layer
         WHERE l.run_id = {id}
         GROUP BY l.layer ORDER BY seen, l.layer"
    ))? {
        let name = strings(b, "layer")?;
        let (samples, nonfinite) = (ints(b, "samples")?, ints(b, "nonfinite")?);
        let zero = floats(b, "zero_fraction")?;
        for i in 0..b.num_rows() {
            let layer = name[i].clone().unwrap_or_default();
            let coverage = covered.remove(&layer);
            let reliable = coverage.as_ref().is_none_or(|c| c.trend_reliable);
            let mut take = |metric: &str| {
                let mut t = series
                    .remove(&(layer.clone(), metric.to_string()))
                    .and_then(trend)?;
                if !reliable {
                    t.change = None;
                }
                Some(t)
            };
            out.push(LayerSummary {
                stable_rank: take("stable_rank"),
                effective_rank: take("effective_rank"),
                layer,
                samples: samples[i].unwrap_or_default() as u64,
                final_zero_fraction: zero[i],
                nonfinite: nonfinite[i].unwrap_or_default() as u64,
                coverage,
            });
        }
    }
    Ok(out)
}

fn model(dataset: &Dataset, id: &str) -> anyhow::Result<Vec<ModelLayer>> {
    let mut out = Vec::new();
    for b in &dataset.sql(&format!(
        "SELECT layer, kind, CAST(params AS BIGINT) AS params,
                CAST(param_bytes AS BIGINT) AS param_bytes,
                CAST(forward_flops AS BIGINT) AS forward_flops, output_shape
         FROM model
         WHERE run_id = {id} AND rank = (SELECT min(rank) FROM model WHERE run_id = {id})
           AND seq = (SELECT max(seq) FROM model m WHERE m.run_id = {id}
                      AND m.rank = (SELECT min(rank) FROM model WHERE run_id = {id}))"
    ))? {
        let (layer, kind, shape) = (
            strings(b, "layer")?,
            strings(b, "kind")?,
            strings(b, "output_shape")?,
        );
        let (params, bytes, flops) = (
            ints(b, "params")?,
            ints(b, "param_bytes")?,
            ints(b, "forward_flops")?,
        );
        for i in 0..b.num_rows() {
            out.push(ModelLayer {
                layer: layer[i].clone().unwrap_or_default(),
                kind: kind[i].clone().unwrap_or_default(),
                params: params[i].unwrap_or_default() as u64,
                param_bytes: bytes[i].unwrap_or_default() as u64,
                forward_flops: flops[i].unwrap_or_default() as u64,
                output_shape: shape[i].clone().unwrap_or_default(),
            });
        }
    }
    Ok(out)
}
