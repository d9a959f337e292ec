//! `rankscope compare`: two runs side by side (step time and its phases, agent
//! overhead, memory peaks, loss, and each layer's final dimensionality), each
//! difference with its direction. Both sides are the reports' JSON summaries.

use std::path::PathBuf;

use serde::Serialize;

use crate::commands::report::{self, Report};
use crate::output_query::Dataset;

/// Compare two runs.
#[derive(clap::Args, Clone, Debug)]
#[command(after_help = "RUN_A is the baseline; changes are B relative to A.

Examples:
  rankscope compare run-1763790000-123 run-1763790500-456
  rankscope compare baseline candidate --out rankscope-out --out-b ../other/rankscope-out
  rankscope compare A B --json | jq '.rows[] | select(.verdict == \"worse\")'")]
pub struct Args {
    /// The baseline run.
    pub run_a: String,
    /// The run compared with it.
    pub run_b: String,
    /// The collector's output directory holding the runs, or its Delta tables
    /// (`delta:PATH`, `s3://BUCKET/PREFIX`).
    #[arg(long, default_value = rankscope_collector::CollectorConfig::DEFAULT_OUT)]
    pub out: PathBuf,
    /// Another output directory holding RUN_B, when it is not in --out.
    #[arg(long)]
    pub out_b: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The `schema` field of the JSON output.
pub const SCHEMA: &str = "rankscope.compare";
pub const SCHEMA_VERSION: u32 = 1;

/// Which way is better for a figure, if either.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Better {
    Lower,
    Higher,
    Neither,
}

/// One compared figure.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    pub section: String,
    pub metric: String,
    pub unit: String,
    pub a: Option<f64>,
    pub b: Option<f64>,
    /// b − a.
    pub change: Option<f64>,
    /// (b − a) / |a|.
    pub relative_change: Option<f64>,
    /// `up`, `down` or `same` (within 0.5 %).
    pub direction: String,
    /// `better`, `worse`, `same`, or `changed` where neither way is better.
    pub verdict: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    pub schema: &'static str,
    pub schema_version: u32,
    pub run_a: String,
    pub run_b: String,
    pub diagnoses_a: Vec<String>,
    pub diagnoses_b: Vec<String>,
    pub rows: Vec<Row>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let a_data = Dataset::open(&args.out)?;
    let (a, _) = report::build(&a_data, Some(&args.run_a))?;
    let (b, _) = match &args.out_b {
        Some(dir) => report::build(&Dataset::open(dir)?, Some(&args.run_b))?,
        None => report::build(&a_data, Some(&args.run_b))?,
    };
    let comparison = compare(&a, &b);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&comparison)?);
    } else {
        print!("{}", text(&comparison));
    }
    Ok(())
}

fn row(
    section: &str,
    metric: &str,
    unit: &str,
    a: Option<f64>,
    b: Option<f64>,
    better: Better,
) -> Row {
    let change = a.zip(b).map(|(a, b)| b - a);
    let relative_change = a
        .zip(change)
        .and_then(|(a, c)| (a != 0.0).then(|| c / a.abs()));
    let direction = match (change, relative_change) {
        (None, _) => "-",
        (Some(c), r) if c == 0.0 || r.is_some_and(|r| r.abs() < 0.005) => "same",
        (Some(c), _) if c > 0.0 => "up",
        _ => "down",
    };
    let verdict = match (direction, better) {
        ("-", _) => "-",
        ("same", _) => "same",
        (_, Better::Neither) => "changed",
        ("down", Better::Lower) | ("up", Better::Higher) => "better",
        _ => "worse",
    };
    Row {
        section: section.into(),
        metric: metric.into(),
        unit: unit.into(),
        a,
        b,
        change,
        relative_change,
        direction: direction.into(),
        verdict: verdict.into(),
    }
}

/// The mean over ranks of a per-rank figure.
fn mean_over_ranks(
    r: &Report,
    f: impl Fn(&report::json_summary::RankSummary) -> Option<f64>,
) -> Option<f64> {
    let v: Vec<f64> = r.ranks.iter().filter_map(f).collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

fn max_over_ranks(
    r: &Report,
    f: impl Fn(&report::json_summary::RankSummary) -> Option<u64>,
) -> Option<f64> {
    r.ranks.iter().filter_map(f).max().map(|v| v as f64)
}

/// B against A, figure by figure.
pub fn compare(a: &Report, b: &Report) -> Comparison {
    let mut rows = Vec::new();
    for phase in ["step", "data", "forward", "backward", "optimizer", "comm"] {
        for (q, get) in [
            (
                "p50",
                (|p: &report::json_summary::PhaseStats| p.p50) as fn(&_) -> f64,
            ),
            ("p95", |p| p.p95),
        ] {
            let f = |r: &Report| mean_over_ranks(r, |x| x.phases.get(phase).map(get));
            rows.push(row(
                "time",
                &format!("{phase} {q} (mean over ranks)"),
                "ms",
                f(a),
                f(b),
                Better::Lower,
            ));
        }
    }
    // Collectives by kind, from the `comm` table: per step time and bandwidth.
    let mut comm_kinds: Vec<&String> = a
        .ranks
        .iter()
        .chain(&b.ranks)
        .flat_map(|x| x.comm.keys())
        .collect();
    comm_kinds.sort();
    comm_kinds.dedup();
    for kind in comm_kinds {
        let per_step = |r: &Report| {
            mean_over_ranks(r, |x| {
                let c = x.comm.get(kind)?;
                (x.steps > 0).then(|| c.comm_ms / x.steps as f64)
            })
        };
        rows.push(row(
            "comm",
            &format!("{kind} time per step (mean over ranks)"),
            "ms",
            per_step(a),
            per_step(b),
            Better::Lower,
        ));
        let bandwidth = |r: &Report| mean_over_ranks(r, |x| x.comm.get(kind)?.mb_per_s);
        rows.push(row(
            "comm",
            &format!("{kind} bandwidth (mean over ranks)"),
            "MB/s",
            bandwidth(a),
            bandwidth(b),
            Better::Higher,
        ));
    }
    rows.push(row(
        "overhead",
        "agent time on the training thread, share of step time (mean over ranks)",
        "%",
        mean_over_ranks(a, |x| x.overhead_pct),
        mean_over_ranks(b, |x| x.overhead_pct),
        Better::Lower,
    ));
    rows.push(row(
        "overhead",
        "agent CPU, share of the process's CPU time (mean over ranks)",
        "%",
        mean_over_ranks(a, |x| x.cpu_pct),
        mean_over_ranks(b, |x| x.cpu_pct),
        Better::Lower,
    ));
    let dropped = |r: &Report| Some(r.ranks.iter().map(|x| x.samples_dropped).sum::<i64>() as f64);
    rows.push(row(
        "overhead",
        "samples dropped",
        "samples",
        dropped(a),
        dropped(b),
        Better::Lower,
    ));
    rows.push(row(
        "memory",
        "peak RSS (max over ranks)",
        "bytes",
        max_over_ranks(a, |x| x.peak_rss_bytes),
        max_over_ranks(b, |x| x.peak_rss_bytes),
        Better::Lower,
    ));
    rows.push(row(
        "memory",
        "peak device allocated (max over ranks)",
        "bytes",
        max_over_ranks(a, |x| x.peak_device_allocated_bytes),
        max_over_ranks(b, |x| x.peak_device_allocated_bytes),
        Better::Lower,
    ));
    let loss =
        |r: &Report, f: fn(&report::json_summary::LossSummary) -> f64| r.loss.as_ref().map(f);
    rows.push(row(
        "loss",
        "final loss",
        "",
        loss(a, |l| l.last),
        loss(b, |l| l.last),
        Better::Lower,
    ));
    rows.push(row(
        "loss",
        "min loss",
        "",
        loss(a, |l| l.min),
        loss(b, |l| l.min),
        Better::Lower,
    ));
    for la in &a.layers {
        let lb = b.layers.iter().find(|l| l.layer == la.layer);
        for (metric, get) in [
            (
                "stable rank",
                (|l: &report::json_summary::LayerSummary| l.stable_rank.as_ref().map(|t| t.last))
                    as fn(&_) -> Option<f64>,
            ),
            ("effective rank", |l| {
                l.effective_rank.as_ref().map(|t| t.last)
            }),
        ] {
            rows.push(row(
                "layers",
                &format!("{} final {metric}", la.layer),
                "",
                get(la),
                lb.and_then(get),
                Better::Neither,
            ));
        }
    }
    let kinds = |r: &Report| {
        r.diagnoses
            .iter()
            .map(|d| d.evidence.kind().to_string())
            .collect()
    };
    Comparison {
        schema: SCHEMA,
        schema_version: SCHEMA_VERSION,
        run_a: a.run.info.run_id.clone(),
        run_b: b.run.info.run_id.clone(),
        diagnoses_a: kinds(a),
        diagnoses_b: kinds(b),
        rows,
    }
}

fn show(v: Option<f64>, unit: &str) -> String {
    match v {
        None => "-".into(),
        Some(v) if unit == "bytes" => format!("{:.1} MiB", v / 1048576.0),
        Some(v) => format!("{v:.4}"),
    }
}

/// The comparison as a table for people.
pub fn text(c: &Comparison) -> String {
    let mut t = format!("A = {}\nB = {}\n\n", c.run_a, c.run_b);
    t += &format!(
        "{:<44} {:>14} {:>14} {:>9}  {}\n",
        "figure", "A", "B", "change", "B vs A"
    );
    for r in &c.rows {
        if r.a.is_none() && r.b.is_none() {
            continue;
        }
        let arrow = match r.direction.as_str() {
            "up" => "▲",
            "down" => "▼",
            "same" => "=",
            _ => " ",
        };
        let rel = r
            .relative_change
            .map_or("-".into(), |x| format!("{:+.1}%", 100.0 * x));
        let unit = if r.unit.is_empty() || r.unit == "bytes" {
            String::new()
        } else {
            format!(" ({})", r.unit)
        };
        t += &format!(
            "{:<44} {:>14} {:>14} {:>9}  {arrow} {}\n",
            format!("{}{unit}", r.metric),
            show(r.a, &r.unit),
            show(r.b, &r.unit),
            rel,
            r.verdict
        );
    }
    let list = |d: &Vec<String>| {
        if d.is_empty() {
            "none".to_string()
        } else {
            d.join(", ")
        }
    };
    t += &format!(
        "\ndiagnoses A: {}\ndiagnoses B: {}\n",
        list(&c.diagnoses_a),
        list(&c.diagnoses_b)
    );
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directions_and_verdicts() {
        let r = row("t", "step", "ms", Some(10.0), Some(8.0), Better::Lower);
        assert_eq!(
            (r.direction.as_str(), r.verdict.as_str()),
            ("down", "better")
        );
        let r = row("t", "step", "ms", Some(10.0), Some(12.0), Better::Lower);
        assert_eq!((r.direction.as_str(), r.verdict.as_str()), ("up", "worse"));
        let r = row("l", "rank", "", Some(10.0), Some(10.01), Better::Neither);
        assert_eq!(r.verdict, "same");
        let r = row("l", "rank", "", Some(10.0), Some(5.0), Better::Neither);
        assert_eq!(
            (r.direction.as_str(), r.verdict.as_str()),
            ("down", "changed")
        );
        let r = row("l", "rank", "", None, Some(5.0), Better::Neither);
        assert_eq!(r.verdict, "-");
    }
}
