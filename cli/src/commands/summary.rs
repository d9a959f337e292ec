//! `rankscope summary`: a run's summary, as SQL over the collector's Parquet files
//! ([`crate::output_query`]): per rank its steps, mean step and all-reduce time, agent
//! overhead and dropped samples; per layer its latest stable and effective rank and
//! their trend since the first sample.

use std::collections::BTreeMap;

use crate::analysis::coverage::{Coverage, planned_samples};
use crate::output_query::{Dataset, RunArgs, floats, ints, literal, strings};

/// Summarise a run from the collector's output.
#[derive(clap::Args, Clone, Debug)]
#[command(after_help = "Examples:
  rankscope summary rankscope-out                              # the latest run
  rankscope summary rankscope-out --run-id run-1763790000-123
  rankscope summary --out delta:/data/rankscope                # Delta tables")]
pub struct Args {
    #[command(flatten)]
    pub input: RunArgs,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let data = Dataset::open(&args.input.out())?;
    let run = data.run(args.input.run_id.as_deref())?;
    print!("{}", summarise_dataset(&data, &run.run_id)?);
    Ok(())
}

#[derive(Default)]
struct RankStats {
    steps: i64,
    step_ms: Option<f64>,
    overhead_pct: Option<f64>,
    /// The agent's device and observed cost, fractions of step time
    /// (`analysis::agent_cost`).
    device: Option<f64>,
    observed: Option<f64>,
    cpu_pct: Option<f64>,
    comm_ms: Option<f64>,
    samples_dropped: i64,
    samples_skipped: i64,
}

/// The summary text of `run_id`, from SQL over the dataset.
pub fn summarise_dataset(data: &Dataset, run_id: &str) -> anyhow::Result<String> {
    let id = literal(run_id);
    let mut ranks: BTreeMap<i64, RankStats> = BTreeMap::new();
    for b in &data.sql(&format!(
        "SELECT CAST(rank AS BIGINT) AS rank, count(*) AS steps, avg(step_ms) AS step_ms,
                avg(comm_ms) AS comm_ms,
                100 * sum(overhead_ms) / sum(step_ms) AS overhead_pct
         FROM steps WHERE run_id = {id} GROUP BY rank"
    ))? {
        let (rank, steps) = (ints(b, "rank")?, ints(b, "steps")?);
        let (step_ms, comm, pct) = (
            floats(b, "step_ms")?,
            floats(b, "comm_ms")?,
            floats(b, "overhead_pct")?,
        );
        for i in 0..b.num_rows() {
            let s = ranks.entry(rank[i].unwrap_or_default()).or_default();
            s.steps = steps[i].unwrap_or_default();
            s.step_ms = step_ms[i];
            s.comm_ms = comm[i];
            s.overhead_pct = pct[i];
        }
    }
    for (rank, e) in data.rank_events(run_id)? {
        let s = ranks.entry(rank).or_default();
        s.samples_dropped = e.samples_dropped;
        s.samples_skipped = e.samples_skipped;
        s.cpu_pct = e.cpu_pct();
    }
    for (rank, c) in data.agent_costs(run_id)? {
        let s = ranks.entry(i64::from(rank)).or_default();
        s.device = c.device;
        s.observed = c.observed;
    }
    // The device column only where a rank has device figures (a GPU run of
    // the Python package): elsewhere it would be a column of dashes.
    let with_device = ranks.values().any(|s| s.device.is_some());
    let mut text = format!("run {run_id}\n\n");
    text += "rank   steps   mean step ms   mean comm ms   overhead %   agent cpu %   observed %";
    if with_device {
        text += "   device %";
    }
    text += "   samples skipped   samples dropped\n";
    let show = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
    let pct = |v: Option<f64>| show(v.map(|v| 100.0 * v));
    for (rank, s) in &ranks {
        text += &format!(
            "{rank:>4}   {:>5}   {:>12}   {:>12}   {:>10}   {:>11}   {:>10}",
            s.steps,
            show(s.step_ms),
            show(s.comm_ms),
            show(s.overhead_pct),
            show(s.cpu_pct),
            pct(s.observed),
        );
        if with_device {
            text += &format!("   {:>8}", pct(s.device));
        }
        text += &format!("   {:>15}   {:>15}\n", s.samples_skipped, s.samples_dropped);
    }
    text += "(overhead %: the agent's time on the training thread as a share of step time; \
             agent cpu %: the agent's share of the process's CPU time, reported when it finished; \
             observed %: the step time that sampling cost, the median over sampled spans of their \
             mean overhead_observed_ms times the steps that carry one, as a share of step time";
    if with_device {
        text += "; device %: the agent's device time as a share of step time";
    }
    text += ")\n";
    if let Some(budget) = data.overhead_budget(run_id)? {
        text += &format!(
            "(the run's overhead budget is {} of each process's CPU time and of its step time, \
             on each share: cpu, device and observed, RANKSCOPE_OVERHEAD_BUDGET; the \
             agent_overhead diagnosis holds them to it)\n",
            crate::analysis::diagnoses::budget_percent(budget)
        );
    }
    if ranks.values().any(|s| s.comm_ms.is_some()) {
        text += "(comm ms: all-reduce launch to completion; the rank that waits least is the one the others wait for)\n";
    }
    if ranks.values().any(|s| s.samples_dropped > 0) {
        text += "(samples dropped: taken but not measured, e.g. libtorch failed to prepare them; see the events table)\n";
    }
    if ranks.values().any(|s| s.samples_skipped > 0) {
        text += "(samples skipped: planned samples the agent's overhead budget had no room for; see RANKSCOPE_OVERHEAD_BUDGET)\n";
    }
    // Per layer, in the order of first sampling: the mean over ranks of the
    // stable and effective rank at the first and last step with finite values.
    let spans = layer_spans(data, &id)?;
    let sample_every = data.run(Some(run_id))?.sample_every;
    text += "\nlayer            stable rank   effective rank   trend (stable rank since first sample)\n";
    for b in &data.sql(&format!(
        "WITH per_step AS (
             SELECT layer, step, avg(stable_rank) AS s, avg(effective_rank) AS e
             FROM layers
             WHERE run_id = {id} AND stable_rank IS NOT NULL AND effective_rank IS NOT NULL
             GROUP BY layer, step),
         ends AS (
             SELECT layer, min(step) AS first, max(step) AS last, count(*) AS samples
             FROM per_step GROUP BY layer),
         names AS (
             SELECT layer, min(time) AS seen FROM layers WHERE run_id = {id} GROUP BY layer)
         SELECT names.layer, f.s AS s0, l.s AS s1, l.e AS e1, ends.samples
         FROM names
         LEFT JOIN ends ON ends.layer = names.layer
         LEFT JOIN per_step f ON f.layer = names.layer AND f.step = ends.first
         LEFT JOIN per_step l ON l.layer = names.layer AND l.step = ends.last
         ORDER BY names.seen, names.layer"
    ))? {
        let name = strings(b, "layer")?;
        let (s0, s1, e1) = (floats(b, "s0")?, floats(b, "s1")?, floats(b, "e1")?);
        let samples = ints(b, "samples")?;
        for i in 0..b.num_rows() {
            let name = name[i].clone().unwrap_or_default();
            let (Some(s0), Some(s1), Some(e1)) = (s0[i], s1[i], e1[i]) else {
                text += &format!(
                    "{name:<16} {:>11}   {:>14}   (no finite sample)\n",
                    "-", "-"
                );
                continue;
            };
            let measured = samples[i].unwrap_or_default().max(0) as u64;
            let planned = spans
                .get(&name)
                .and_then(|&(lo, hi)| planned_samples(lo, hi, sample_every));
            if let Some(note) = Coverage::new(planned, measured).note {
                text += &format!("{name:<16} {s1:>11.3}   {e1:>14.3}   {note}\n");
                continue;
            }
            let change = if s0 > 0.0 {
                100.0 * (s1 - s0) / s0
            } else {
                0.0
            };
            let arrow = if change > 5.0 {
                "up"
            } else if change < -5.0 {
                "down"
            } else {
                "flat"
            };
            text += &format!(
                "{name:<16} {s1:>11.3}   {e1:>14.3}   {arrow} {change:+.1}% over {} samples\n",
                samples[i].unwrap_or_default()
            );
        }
    }
    Ok(text)
}

/// Per layer, the step range of the ranks that sampled it (first, last).
fn layer_spans(data: &Dataset, id: &str) -> anyhow::Result<BTreeMap<String, (u64, u64)>> {
    let mut out = BTreeMap::new();
    for b in &data.sql(&format!(
        "WITH r AS (SELECT rank, min(step) AS lo, max(step) AS hi
                    FROM steps WHERE run_id = {id} GROUP BY rank),
              lr AS (SELECT DISTINCT layer, rank FROM layers WHERE run_id = {id})
         SELECT lr.layer, CAST(min(r.lo) AS BIGINT) AS lo, CAST(max(r.hi) AS BIGINT) AS hi
         FROM lr JOIN r ON r.rank = lr.rank GROUP BY lr.layer"
    ))? {
        let (layer, lo, hi) = (strings(b, "layer")?, ints(b, "lo")?, ints(b, "hi")?);
        for i in 0..b.num_rows() {
            if let (Some(l), Some(lo), Some(hi)) = (layer[i].clone(), lo[i], hi[i]) {
                out.insert(l, (lo.max(0) as u64, hi.max(0) as u64));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::path::Path;

    fn summarise(out: &Path, run_id: &str) -> anyhow::Result<String> {
        summarise_dataset(&Dataset::open(out)?, run_id)
    }
    use std::sync::Arc;

    use arrow::array::{ArrayRef, Float64Array, Int32Array, RecordBatch, StringArray, UInt32Array};
    use arrow::datatypes::{Field, Schema};
    use parquet::arrow::ArrowWriter;

    /// Writes one Parquet file of `columns` (plus `run_id`) as `table` of run `r`.
    fn write(out: &Path, table: &str, columns: Vec<(&str, ArrayRef)>) {
        let dir = out.join(table).join("run_id=r");
        std::fs::create_dir_all(&dir).unwrap();
        let rows = columns[0].1.len();
        let mut columns = columns;
        columns.insert(0, ("run_id", Arc::new(StringArray::from(vec!["r"; rows]))));
        let fields: Vec<Field> = columns
            .iter()
            .map(|(name, a)| Field::new(*name, a.data_type().clone(), true))
            .collect();
        let batch = RecordBatch::try_new(
            Arc::new(Schema::new(fields)),
            columns.into_iter().map(|(_, a)| a).collect(),
        )
        .unwrap();
        let file = File::create(dir.join("part-0.parquet")).unwrap();
        let mut writer = ArrowWriter::try_new(file, batch.schema(), None).unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
    }

    #[test]
    fn files_with_fewer_columns_are_summarised() {
        // Files of an older release lack newer columns: they read as null.
        let out = tempfile::tempdir().unwrap();
        write(
            out.path(),
            "steps",
            vec![
                ("rank", Arc::new(UInt32Array::from(vec![0, 0, 1]))),
                (
                    "step_ms",
                    Arc::new(Float64Array::from(vec![10.0, 20.0, 30.0])),
                ),
            ],
        );
        let text = summarise(out.path(), "r").unwrap();
        assert!(text.contains("   0       2         15.000"), "{text}");
        assert!(text.contains("   1       1         30.000"), "{text}");
    }

    #[test]
    fn columns_of_another_type_are_errors_not_panics() {
        // A string where a number belongs.
        let out = tempfile::tempdir().unwrap();
        write(
            out.path(),
            "steps",
            vec![
                ("rank", Arc::new(UInt32Array::from(vec![0]))),
                ("step_ms", Arc::new(StringArray::from(vec!["ten"]))),
            ],
        );
        let err = format!("{:#}", summarise(out.path(), "r").unwrap_err());
        assert!(err.contains("query failed"), "{err}");

        // An integer column where a float belongs is read as a float.
        let out = tempfile::tempdir().unwrap();
        write(
            out.path(),
            "steps",
            vec![
                ("rank", Arc::new(UInt32Array::from(vec![0]))),
                ("step_ms", Arc::new(Int32Array::from(vec![10]))),
            ],
        );
        let text = summarise(out.path(), "r").unwrap();
        assert!(text.contains("10.000"), "{text}");
    }

    #[test]
    fn float64_layers_files_of_older_releases_are_summarised() {
        // Before `layers` stored its measured values as float32, they were float64.
        let out = tempfile::tempdir().unwrap();
        write(
            out.path(),
            "layers",
            vec![
                ("rank", Arc::new(UInt32Array::from(vec![0, 0]))),
                (
                    "step",
                    Arc::new(arrow::array::UInt64Array::from(vec![0, 1])),
                ),
                ("layer", Arc::new(StringArray::from(vec!["fc", "fc"]))),
                ("stable_rank", Arc::new(Float64Array::from(vec![4.0, 2.0]))),
                (
                    "effective_rank",
                    Arc::new(Float64Array::from(vec![8.25, 6.5])),
                ),
            ],
        );
        let text = summarise(out.path(), "r").unwrap();
        assert!(
            text.contains("fc                     2.000            6.500"),
            "{text}"
        );
        // Two samples are no trend.
        assert!(
            text.contains("2 samples: too few for a trend (at least 5)"),
            "{text}"
        );
    }

    /// Two ranks of 100 steps of 100 ms, sampled every 10 steps with a budget
    /// of 2 %: 0.1 ms a step on the training thread; the sampled steps and the
    /// step after each 5 ms slower (observed), one of them also 2 s slower for
    /// a checkpoint. Rank 1 has device figures, 2 ms a sampled step; rank 0
    /// none (CPU).
    fn costed_run() -> tempfile::TempDir {
        use arrow::array::UInt64Array;
        let out = tempfile::tempdir().unwrap();
        write(
            out.path(),
            "runs",
            vec![
                ("rank", Arc::new(UInt32Array::from(vec![0]))),
                ("sample_every", Arc::new(UInt32Array::from(vec![10]))),
                ("mode", Arc::new(StringArray::from(vec!["full"]))),
                ("workload", Arc::new(StringArray::from(vec![""]))),
                ("overhead_budget", Arc::new(Float64Array::from(vec![0.02]))),
            ],
        );
        let (mut rank, mut step, mut step_ms) = (Vec::new(), Vec::new(), Vec::new());
        let (mut device, mut observed) = (Vec::new(), Vec::new());
        for r in 0..2u32 {
            for s in 0..100u64 {
                let spanned = s % 10 < 2;
                let checkpoint = if s == 50 { 2000.0 } else { 0.0 };
                rank.push(r);
                step.push(s);
                step_ms.push(100.0 + if spanned { 5.0 } else { 0.0 } + checkpoint);
                observed.push(spanned.then_some(5.0 + checkpoint));
                device.push((r == 1).then_some(if s % 10 == 0 { 2.0 } else { 0.0 }));
            }
        }
        write(
            out.path(),
            "steps",
            vec![
                ("rank", Arc::new(UInt32Array::from(rank))),
                ("step", Arc::new(UInt64Array::from(step))),
                ("step_ms", Arc::new(Float64Array::from(step_ms))),
                ("overhead_ms", Arc::new(Float64Array::from(vec![0.1; 200]))),
                ("overhead_device_ms", Arc::new(Float64Array::from(device))),
                (
                    "overhead_observed_ms",
                    Arc::new(Float64Array::from(observed)),
                ),
            ],
        );
        out
    }

    #[test]
    fn the_agents_observed_and_device_cost_per_rank() {
        let out = costed_run();
        let text = summarise(out.path(), "r").unwrap();
        // Σ step_ms = 100 × 100 + 20 × 5 + 2000 = 12,100 ms. Observed: median
        // 5 ms × 20 steps = 100 ms, 0.826 % (a plain sum, 2,100 ms, would read
        // 17 %); device: 10 × 2 ms, 0.165 %; host: 10 ms, 0.083 %.
        assert!(
            text.contains("overhead %   agent cpu %   observed %   device %   samples skipped"),
            "{text}"
        );
        assert!(
            text.contains("     0.083             -        0.826          -"),
            "rank 0 has no device figures: {text}"
        );
        assert!(
            text.contains("     0.083             -        0.826      0.165"),
            "{text}"
        );
        assert!(
            text.contains("overhead budget is 2% of each process's CPU time and of its step time, on each share"),
            "{text}"
        );

        // Without device figures on any rank, no device column.
        let cpu = sampled_run(&[0, 390]);
        let text = summarise(cpu.path(), "r").unwrap();
        assert!(
            text.contains("overhead %   agent cpu %   observed %   samples skipped"),
            "{text}"
        );
        assert!(!text.contains("device %"), "{text}");
    }

    #[test]
    fn the_report_shows_each_share_beside_the_budget() {
        use crate::commands::report;
        let out = costed_run();
        let (r, data) = report::build(&Dataset::open(out.path()).unwrap(), Some("r")).unwrap();
        let json = serde_json::to_value(&r).unwrap();
        let rank = |i: usize, k: &str| json["ranks"][i][k].as_f64();
        assert_eq!(rank(0, "device_pct"), None);
        assert!((rank(1, "device_pct").unwrap() - 2000.0 / 12_100.0).abs() < 1e-9);
        assert!((rank(1, "observed_pct").unwrap() - 10_000.0 / 12_100.0).abs() < 1e-9);
        assert_eq!(json["ranks"][1]["observed_steps"], 20);
        let page = report::html::page(&r, &data).unwrap();
        assert!(
            page.contains("<th>device %</th><th>observed %</th>"),
            "{page}"
        );
        assert!(
            page.contains("<tr><td>1</td><td>0.08</td><td>0.17</td><td>0.83</td><td>20</td>"),
            "{page}"
        );
        assert!(page.contains("overhead budget: 2% of each process's CPU time"));
        assert!(!page.contains("class=\"over\""), "all within 2 %");
        // The observed share over the budget: marked, and the diagnosis names it.
        let budget_1 = report::json_summary::Report {
            run: report::json_summary::Run {
                overhead_budget: Some(0.005),
                ..r.run.clone()
            },
            ..r.clone()
        };
        let page = report::html::page(&budget_1, &data).unwrap();
        assert!(page.contains("<td class=\"over\">0.83</td>"), "{page}");
        let d = r
            .diagnoses
            .iter()
            .find(|d| d.evidence.kind() == "agent_overhead");
        assert!(d.is_none(), "within the run's 2 %: {d:?}");
    }

    /// A run of 400 steps sampled every 10, of which the budget let `kept`
    /// sampled steps in; the stable rank falls by half between the first and
    /// the last.
    fn sampled_run(kept: &[u64]) -> tempfile::TempDir {
        use arrow::array::UInt64Array;
        let out = tempfile::tempdir().unwrap();
        write(
            out.path(),
            "runs",
            vec![
                ("rank", Arc::new(UInt32Array::from(vec![0]))),
                ("sample_every", Arc::new(UInt32Array::from(vec![10]))),
                ("mode", Arc::new(StringArray::from(vec!["full"]))),
                ("workload", Arc::new(StringArray::from(vec![""]))),
            ],
        );
        write(
            out.path(),
            "steps",
            vec![
                ("rank", Arc::new(UInt32Array::from(vec![0; 400]))),
                ("step", Arc::new(UInt64Array::from_iter_values(0..400))),
                ("step_ms", Arc::new(Float64Array::from(vec![10.0; 400]))),
            ],
        );
        let n = kept.len();
        let stable: Vec<f64> = (0..n)
            .map(|i| 4.0 - 2.0 * i as f64 / (n - 1) as f64)
            .collect();
        write(
            out.path(),
            "layers",
            vec![
                ("rank", Arc::new(UInt32Array::from(vec![0; n]))),
                ("step", Arc::new(UInt64Array::from(kept.to_vec()))),
                ("layer", Arc::new(StringArray::from(vec!["fc"; n]))),
                ("stable_rank", Arc::new(Float64Array::from(stable))),
                ("effective_rank", Arc::new(Float64Array::from(vec![6.0; n]))),
            ],
        );
        out
    }

    #[test]
    fn a_thin_series_says_so_instead_of_a_trend() {
        let thin = sampled_run(&[0, 390]);
        let text = summarise(thin.path(), "r").unwrap();
        assert!(
            text.contains("38 of 40 planned samples skipped: trends unreliable"),
            "{text}"
        );
        assert!(!text.contains("down"), "{text}");
        // Every planned sample measured: the trend is shown.
        let full: Vec<u64> = (0..40).map(|i| 10 * i).collect();
        let text = summarise(sampled_run(&full).path(), "r").unwrap();
        assert!(text.contains("down -50.0% over 40 samples"), "{text}");
    }

    #[test]
    fn the_report_says_a_thin_series_has_no_trend() {
        use crate::commands::report;
        let thin = sampled_run(&[0, 390]);
        let (r, data) = report::build(&Dataset::open(thin.path()).unwrap(), Some("r")).unwrap();
        let layer = &r.layers[0];
        let c = layer.coverage.as_ref().unwrap();
        assert_eq!((c.planned, c.measured, c.skipped), (Some(40), 2, Some(38)));
        assert!(!c.trend_reliable);
        assert_eq!(layer.stable_rank.as_ref().unwrap().change, None);
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(
            json["layers"][0]["coverage"]["note"],
            "38 of 40 planned samples skipped: trends unreliable"
        );
        let page = report::html::page(&r, &data).unwrap();
        assert!(
            page.contains("38 of 40 planned samples skipped: trends unreliable"),
            "the page says so"
        );
        // A full series keeps its change.
        let full: Vec<u64> = (0..40).map(|i| 10 * i).collect();
        let out = sampled_run(&full);
        let (r, _) = report::build(&Dataset::open(out.path()).unwrap(), Some("r")).unwrap();
        let c = r.layers[0].coverage.as_ref().unwrap();
        assert!(c.trend_reliable && c.note.is_none());
        assert_eq!(r.layers[0].stable_rank.as_ref().unwrap().change, Some(-0.5));
    }
}
