//! `rankscope compare`: two runs side by side (step time and its phases, agent
//! overhead, memory peaks, loss, and each layer's final dimensionality), each
//! difference with its direction. Both sides are the reports' JSON summaries.
//!
//! A time figure is called `better` or `worse` only when it moved beyond the
//! runs' own step-to-step noise ([`noise_band`]); the comparison warns when the
//! runs cover different numbers of steps.

use std::path::PathBuf;

use serde::Serialize;

use crate::commands::report::{self, Report};
use crate::output_query::Dataset;

/// Compare two runs.
#[derive(clap::Args, Clone, Debug)]
#[command(after_help = "RUN_A is the baseline; changes are B relative to A.

A step-time or phase figure is better or worse only beyond the runs' own noise: per rank, the
standard error of its p50 (or p95) from the spread of its steps (1.2533 × MAD / √steps for the
p50, 2.1097 × MAD / √steps for the p95, MAD the normal-consistent median absolute deviation),
averaged over ranks (a DDP run's ranks move together); a difference within 3 × √(SE_A² + SE_B²)
is `same`, within noise. Other figures are `same` within 0.5 %. Runs whose lengths differ by more
than 10 % are compared with a warning: their figures cover different spans.

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
    /// The noise band's half-width, in the figure's unit: a change within it
    /// is `same` (step time and phases only; null elsewhere, or when a report
    /// has no spread).
    pub noise: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    pub schema: &'static str,
    pub schema_version: u32,
    pub run_a: String,
    pub run_b: String,
    pub diagnoses_a: Vec<String>,
    pub diagnoses_b: Vec<String>,
    /// Steps of each run: the most any of its ranks recorded.
    pub steps_a: u64,
    pub steps_b: u64,
    /// What makes the comparison less fair, for people (e.g. runs of
    /// different lengths).
    pub warnings: Vec<String>,
    pub rows: Vec<Row>,
}

/// Standard deviations of the difference beyond which a time figure changed.
pub const NOISE_Z: f64 = 3.0;
/// Runs whose step counts differ by more than this share are warned about.
pub const LENGTH_TOLERANCE: f64 = 0.10;

/// The standard error of a normal sample's quantile `q`, in units of σ/√n:
/// √(q(1 − q)) / φ(z_q).
fn quantile_se_factor(q: &str) -> f64 {
    match q {
        "p95" => 2.1097,
        _ => 1.2533,
    }
}

/// The standard error of a run's figure `q` of a phase: per rank
/// factor · MAD / √steps, averaged over ranks (not reduced by √ranks: the
/// ranks of a data-parallel run wait for each other, so their step times move
/// together).
fn standard_error(r: &Report, phase: &str, q: &str) -> Option<f64> {
    let se: Vec<f64> = r
        .ranks
        .iter()
        .filter_map(|x| {
            let p = x.phases.get(phase)?;
            (p.steps > 0).then_some(quantile_se_factor(q) * p.mad? / (p.steps as f64).sqrt())
        })
        .collect();
    (!se.is_empty()).then(|| se.iter().sum::<f64>() / se.len() as f64)
}

/// The half-width of the band within which a phase's figure `q` of A and B
/// differ by noise alone: [`NOISE_Z`] · √(SE_A² + SE_B²).
pub fn noise_band(a: &Report, b: &Report, phase: &str, q: &str) -> Option<f64> {
    let (sa, sb) = (standard_error(a, phase, q)?, standard_error(b, phase, q)?);
    Some(NOISE_Z * sa.hypot(sb))
}

/// A run's length: the most steps any of its ranks recorded.
fn run_steps(r: &Report) -> u64 {
    r.ranks.iter().map(|x| x.steps).max().unwrap_or(0)
}

/// The warning for runs of different lengths, when they differ by more than
/// [`LENGTH_TOLERANCE`].
fn length_warning(a: u64, b: u64) -> Option<String> {
    let (short, long) = (a.min(b), a.max(b));
    (long as f64 > short as f64 * (1.0 + LENGTH_TOLERANCE))
        .then(|| format!("runs differ in length: {a} vs {b} steps; figures over different spans"))
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
    noise: Option<f64>,
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
    let within_noise = change.zip(noise).is_some_and(|(c, n)| c.abs() <= n);
    let verdict = match (direction, better) {
        ("-", _) => "-",
        ("same", _) => "same",
        _ if within_noise => "same",
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
        noise,
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
                noise_band(a, b, phase, q),
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
            None,
        ));
        let bandwidth = |r: &Report| mean_over_ranks(r, |x| x.comm.get(kind)?.mb_per_s);
        rows.push(row(
            "comm",
            &format!("{kind} bandwidth (mean over ranks)"),
            "MB/s",
            bandwidth(a),
            bandwidth(b),
            Better::Higher,
            None,
        ));
    }
    type Share = fn(&report::json_summary::RankSummary) -> Option<f64>;
    let shares: [(&str, Share); 4] = [
        (
            "agent time on the training thread, share of step time",
            |x| x.overhead_pct,
        ),
        ("agent CPU, share of the process's CPU time", |x| x.cpu_pct),
        ("agent device time, share of step time", |x| x.device_pct),
        (
            "observed slowdown of sampled steps, share of step time",
            |x| x.observed_pct,
        ),
    ];
    for (metric, share) in shares {
        rows.push(row(
            "overhead",
            &format!("{metric} (mean over ranks)"),
            "%",
            mean_over_ranks(a, share),
            mean_over_ranks(b, share),
            Better::Lower,
            None,
        ));
    }
    let skipped = |r: &Report| Some(r.ranks.iter().map(|x| x.samples_skipped).sum::<i64>() as f64);
    rows.push(row(
        "overhead",
        "planned samples skipped",
        "samples",
        skipped(a),
        skipped(b),
        Better::Lower,
        None,
    ));
    let dropped = |r: &Report| Some(r.ranks.iter().map(|x| x.samples_dropped).sum::<i64>() as f64);
    rows.push(row(
        "overhead",
        "samples dropped",
        "samples",
        dropped(a),
        dropped(b),
        Better::Lower,
        None,
    ));
    rows.push(row(
        "memory",
        "peak RSS (max over ranks)",
        "bytes",
        max_over_ranks(a, |x| x.peak_rss_bytes),
        max_over_ranks(b, |x| x.peak_rss_bytes),
        Better::Lower,
        None,
    ));
    rows.push(row(
        "memory",
        "peak device allocated (max over ranks)",
        "bytes",
        max_over_ranks(a, |x| x.peak_device_allocated_bytes),
        max_over_ranks(b, |x| x.peak_device_allocated_bytes),
        Better::Lower,
        None,
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
        None,
    ));
    rows.push(row(
        "loss",
        "min loss",
        "",
        loss(a, |l| l.min),
        loss(b, |l| l.min),
        Better::Lower,
        None,
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
                None,
            ));
        }
    }
    let kinds = |r: &Report| {
        r.diagnoses
            .iter()
            .map(|d| d.evidence.kind().to_string())
            .collect()
    };
    let (steps_a, steps_b) = (run_steps(a), run_steps(b));
    Comparison {
        schema: SCHEMA,
        schema_version: SCHEMA_VERSION,
        run_a: a.run.info.run_id.clone(),
        run_b: b.run.info.run_id.clone(),
        diagnoses_a: kinds(a),
        diagnoses_b: kinds(b),
        steps_a,
        steps_b,
        warnings: length_warning(steps_a, steps_b).into_iter().collect(),
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
    let mut t = format!("A = {}\nB = {}\n", c.run_a, c.run_b);
    for w in &c.warnings {
        t += &format!("warning: {w}\n");
    }
    t += "\n";
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
        let noise = match r.noise {
            Some(n) if r.verdict == "same" && r.direction != "same" => {
                format!(", within noise (±{n:.3})")
            }
            _ => String::new(),
        };
        t += &format!(
            "{:<44} {:>14} {:>14} {:>9}  {arrow} {}{noise}\n",
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
    use std::collections::BTreeMap;

    use super::*;
    use crate::commands::report::json_summary::{PhaseStats, RankSummary, Run};
    use crate::output_query::RunInfo;

    #[test]
    fn directions_and_verdicts() {
        let r = row(
            "t",
            "step",
            "ms",
            Some(10.0),
            Some(8.0),
            Better::Lower,
            None,
        );
        assert_eq!(
            (r.direction.as_str(), r.verdict.as_str()),
            ("down", "better")
        );
        let r = row(
            "t",
            "step",
            "ms",
            Some(10.0),
            Some(12.0),
            Better::Lower,
            None,
        );
        assert_eq!((r.direction.as_str(), r.verdict.as_str()), ("up", "worse"));
        let r = row(
            "l",
            "rank",
            "",
            Some(10.0),
            Some(10.01),
            Better::Neither,
            None,
        );
        assert_eq!(r.verdict, "same");
        let r = row(
            "l",
            "rank",
            "",
            Some(10.0),
            Some(5.0),
            Better::Neither,
            None,
        );
        assert_eq!(
            (r.direction.as_str(), r.verdict.as_str()),
            ("down", "changed")
        );
        let r = row("l", "rank", "", None, Some(5.0), Better::Neither, None);
        assert_eq!(r.verdict, "-");
        // Within the noise band: up, but the same.
        let r = row(
            "t",
            "step",
            "ms",
            Some(10.0),
            Some(10.1),
            Better::Lower,
            Some(0.2),
        );
        assert_eq!((r.direction.as_str(), r.verdict.as_str()), ("up", "same"));
    }

    /// A report of `ranks` ranks whose step p50 is `p50` ms, with `steps` steps
    /// spread by a MAD of `mad` ms.
    fn report(run: &str, ranks: u32, steps: u64, p50: f64, mad: f64) -> Report {
        let stats = PhaseStats {
            p50,
            p95: p50 + 2.0 * mad,
            p99: p50 + 3.0 * mad,
            mean: p50,
            steps,
            mad: Some(mad),
        };
        Report {
            schema: report::json_summary::SCHEMA.into(),
            schema_version: report::json_summary::SCHEMA_VERSION,
            run: Run {
                info: RunInfo {
                    run_id: run.into(),
                    world_size: Some(ranks.into()),
                    mode: None,
                    sample_every: None,
                    workload: None,
                    started_at: None,
                },
                ranks_seen: ranks as usize,
                ranks_finished: ranks as usize,
                last_step: steps.checked_sub(1),
                overhead_budget: None,
            },
            ranks: (0..ranks)
                .map(|rank| RankSummary {
                    rank,
                    node_rank: 0,
                    hostname: "h".into(),
                    steps,
                    phases: BTreeMap::from([("step".to_string(), stats.clone())]),
                    overhead_pct: None,
                    cpu_pct: None,
                    device_pct: None,
                    observed_pct: None,
                    observed_steps: 0,
                    peak_rss_bytes: None,
                    peak_device_allocated_bytes: None,
                    samples_dropped: 0,
                    samples_skipped: 0,
                    rows_dropped: 0,
                    comm: BTreeMap::new(),
                })
                .collect(),
            loss: None,
            layers: Vec::new(),
            model: Vec::new(),
            diagnoses: Vec::new(),
        }
    }

    fn step_p50(c: &Comparison) -> &Row {
        c.rows
            .iter()
            .find(|r| r.metric.starts_with("step p50"))
            .unwrap()
    }

    #[test]
    fn a_change_within_the_runs_noise_is_the_same() {
        // Steps of 100 ms spread by 5 ms over 250 steps: the p50's standard
        // error is 1.2533 · 5 / √250 ≈ 0.40 ms a run, the band 3 · √2 · 0.40
        // ≈ 1.7 ms. +1.0 % is inside it.
        let c = compare(
            &report("a", 4, 250, 100.0, 5.0),
            &report("b", 4, 250, 101.0, 5.0),
        );
        let r = step_p50(&c);
        assert_eq!((r.direction.as_str(), r.verdict.as_str()), ("up", "same"));
        assert!((r.noise.unwrap() - 1.68).abs() < 0.01, "{:?}", r.noise);
        assert!(text(&c).contains("same, within noise"), "{}", text(&c));
        assert!(c.warnings.is_empty());
        // +3 % is beyond it.
        let c = compare(
            &report("a", 4, 250, 100.0, 5.0),
            &report("b", 4, 250, 103.0, 5.0),
        );
        assert_eq!(step_p50(&c).verdict, "worse");
        // With steady steps the same +1 % is real.
        let c = compare(
            &report("a", 4, 250, 100.0, 0.5),
            &report("b", 4, 250, 101.0, 0.5),
        );
        assert_eq!(step_p50(&c).verdict, "worse");
        // A report without the spread (written before it) has no band.
        let mut old = report("a", 4, 250, 100.0, 5.0);
        for r in &mut old.ranks {
            r.phases.get_mut("step").unwrap().mad = None;
        }
        let c = compare(&old, &report("b", 4, 250, 101.0, 5.0));
        assert_eq!(
            (step_p50(&c).verdict.as_str(), step_p50(&c).noise),
            ("worse", None)
        );
    }

    #[test]
    fn the_budgets_shares_are_compared() {
        let mut a = report("a", 2, 250, 100.0, 5.0);
        let mut b = report("b", 2, 250, 100.0, 5.0);
        for (r, (device, observed, skipped)) in
            a.ranks.iter_mut().zip([(1.0, 0.5, 10), (3.0, 1.5, 30)])
        {
            (r.device_pct, r.observed_pct, r.samples_skipped) =
                (Some(device), Some(observed), skipped);
        }
        for r in &mut b.ranks {
            (r.device_pct, r.observed_pct, r.samples_skipped) = (Some(1.0), None, 0);
        }
        let c = compare(&a, &b);
        let find = |metric: &str| {
            c.rows
                .iter()
                .find(|r| r.metric.starts_with(metric))
                .unwrap()
        };
        let device = find("agent device time");
        assert_eq!(
            (device.a, device.b, device.verdict.as_str()),
            (Some(2.0), Some(1.0), "better")
        );
        let observed = find("observed slowdown");
        assert_eq!(
            (observed.a, observed.b, observed.verdict.as_str()),
            (Some(1.0), None, "-")
        );
        let skipped = find("planned samples skipped");
        assert_eq!((skipped.a, skipped.b), (Some(40.0), Some(0.0)));
    }

    #[test]
    fn runs_of_different_lengths_are_warned_about() {
        let c = compare(
            &report("a", 2, 80, 100.0, 5.0),
            &report("b", 2, 250, 100.0, 5.0),
        );
        let warning = "runs differ in length: 80 vs 250 steps; figures over different spans";
        assert_eq!(c.warnings, [warning]);
        assert_eq!((c.steps_a, c.steps_b), (80, 250));
        assert!(text(&c).contains(&format!("warning: {warning}")));
        let json = serde_json::to_value(&c).unwrap();
        assert_eq!(json["warnings"][0], warning);
        // Within 10 %: no warning.
        let c = compare(
            &report("a", 2, 250, 100.0, 5.0),
            &report("b", 2, 260, 100.0, 5.0),
        );
        assert!(c.warnings.is_empty());
    }
}
