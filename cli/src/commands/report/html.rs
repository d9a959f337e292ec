//! The report page: one self-contained HTML file (inline CSS and SVG, no script,
//! no network), with the diagnoses first and then the pictures.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::json_summary::{LayerSummary, Report};
use super::plots::{self, SMALL, Series, WIDE};
use crate::analysis::diagnoses::{self, RunData};

/// Columns of the step-time heatmap at most (steps are binned beyond that).
const HEATMAP_COLUMNS: usize = 240;
/// Points per line of the memory chart at most.
const LINE_POINTS: usize = 600;

/// Text safe inside HTML elements and attributes.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1000px; color: #1d1d1f; }
h1 { margin-bottom: 4px; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 4px; margin-top: 32px; }
.meta { color: #555; } .note { color: #666; font-size: 13px; }
.diagnosis { border-left: 4px solid #d9822b; background: #fff7ee; padding: 8px 12px; margin: 8px 0; }
.diagnosis .kind { font-weight: 600; text-transform: uppercase; font-size: 12px; color: #a5531a; }
.healthy { border-left: 4px solid #3a9a5b; background: #f0faf3; padding: 8px 12px; }
details pre { font-size: 12px; background: #f6f6f6; padding: 8px; overflow-x: auto; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border-bottom: 1px solid #eee; padding: 3px 10px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.over { color: #b3261e; font-weight: 600; }
.grid { display: flex; flex-wrap: wrap; gap: 8px; }
svg { display: block; }
";

/// The whole page.
pub fn page(report: &Report, data: &RunData) -> anyhow::Result<String> {
    let run = &report.run;
    let mut h = String::new();
    writeln!(
        h,
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>rankscope report: {}</title><style>{STYLE}</style></head><body>",
        escape(&run.info.run_id)
    )?;
    writeln!(
        h,
        "<header><h1>rankscope report</h1><p class=\"meta\">run <b>{}</b> · {} ranks seen, {} finished{} · mode {} · {}last step {}</p></header>",
        escape(&run.info.run_id),
        run.ranks_seen,
        run.ranks_finished,
        run.info
            .world_size
            .map_or(String::new(), |w| format!(" of {w}")),
        escape(run.info.mode.as_deref().unwrap_or("?")),
        run.info
            .workload
            .as_deref()
            .map_or(String::new(), |w| format!("workload {} · ", escape(w))),
        run.last_step.map_or("-".into(), |s| s.to_string()),
    )?;
    if run.ranks_finished < run.ranks_seen {
        writeln!(
            h,
            "<p class=\"note\">Some ranks have not finished: this report covers the rows committed so far.</p>"
        )?;
    }
    diagnoses(&mut h, report)?;
    loss(&mut h, report)?;
    step_time(&mut h, report, data)?;
    phases(&mut h, report)?;
    comm(&mut h, report)?;
    memory(&mut h, data)?;
    overhead(&mut h, report)?;
    layers(&mut h, &report.layers)?;
    model(&mut h, report)?;
    writeln!(
        h,
        "<footer class=\"note\"><p>Made by rankscope {}. Thresholds and methods: docs/diagnoses.md and docs/metrics.md. \
         The same numbers in JSON: <code>rankscope report --json</code> (schema {} v{}).</p></footer></body></html>",
        env!("CARGO_PKG_VERSION"),
        super::json_summary::SCHEMA,
        super::json_summary::SCHEMA_VERSION
    )?;
    Ok(h)
}

fn diagnoses(h: &mut String, report: &Report) -> anyhow::Result<()> {
    writeln!(h, "<section id=\"diagnoses\"><h2>Diagnoses</h2>")?;
    if report.diagnoses.is_empty() {
        writeln!(
            h,
            "<div class=\"healthy\">No problem found: no straggler, input wait, node imbalance, memory creep, \
             collapse, dead layer, NaN/Inf, shard skew, overhead above budget or lost telemetry.</div>"
        )?;
    }
    for d in &report.diagnoses {
        let evidence = serde_json::to_string_pretty(&d.evidence)?;
        writeln!(
            h,
            "<div class=\"diagnosis\"><div class=\"kind\">{}</div><div>{}</div>\
             <details><summary>evidence</summary><pre>{}</pre></details></div>",
            escape(&d.evidence.kind().replace('_', " ")),
            escape(&d.message),
            escape(&evidence)
        )?;
    }
    writeln!(h, "</section>")?;
    Ok(())
}

fn loss(h: &mut String, report: &Report) -> anyhow::Result<()> {
    writeln!(h, "<section id=\"loss\"><h2>Loss</h2>")?;
    match &report.loss {
        None => writeln!(
            h,
            "<p class=\"note\">No loss was recorded (<code>s.loss</code> / <code>record(loss=...)</code>).</p>"
        )?,
        Some(l) => {
            let marks: Vec<f64> = l.jumps.iter().map(|j| j.step as f64).collect();
            writeln!(
                h,
                "<p class=\"meta\">first {:.4} · final {:.4} · min {:.4} · {} jumps (red dashes)</p>",
                l.first,
                l.last,
                l.min,
                l.jumps.len()
            )?;
            h.push_str(&plots::lines(
                "mean loss over ranks",
                "loss",
                &[Series {
                    name: "loss".into(),
                    points: l.series.iter().map(|p| (p.0 as f64, p.1)).collect(),
                }],
                &marks,
                WIDE,
            )?);
        }
    }
    writeln!(h, "</section>")?;
    Ok(())
}

fn step_time(h: &mut String, report: &Report, data: &RunData) -> anyhow::Result<()> {
    writeln!(h, "<section id=\"step-time\"><h2>Step time per rank</h2>")?;
    let (Some(first), Some(last)) = (
        data.steps.iter().map(|s| s.step).min(),
        data.steps.iter().map(|s| s.step).max(),
    ) else {
        writeln!(h, "<p class=\"note\">No steps yet.</p></section>")?;
        return Ok(());
    };
    let span = (last - first + 1) as usize;
    let width = span.div_ceil(HEATMAP_COLUMNS).max(1);
    let cols = span.div_ceil(width);
    let mut cells: BTreeMap<u32, Vec<(f64, u32)>> = BTreeMap::new();
    for s in &data.steps {
        let row = cells.entry(s.rank).or_insert_with(|| vec![(0.0, 0); cols]);
        let c = ((s.step - first) as usize / width).min(cols - 1);
        row[c].0 += s.step_ms;
        row[c].1 += 1;
    }
    let rows: Vec<(String, Vec<Option<f64>>)> = cells
        .into_iter()
        .map(|(rank, row)| {
            let values = row
                .into_iter()
                .map(|(sum, n)| (n > 0).then(|| sum / f64::from(n)))
                .collect();
            (rank.to_string(), values)
        })
        .collect();
    let title = if width > 1 {
        format!("step ms, rank × step (mean of {width} steps per cell)")
    } else {
        "step ms, rank × step".to_string()
    };
    h.push_str(&plots::heatmap(&title, &rows, first as f64, width as f64)?);
    writeln!(
        h,
        "<table><tr><th>rank</th><th>node</th><th>steps</th><th>step p50</th><th>p95</th><th>p99</th><th>comm p50</th></tr>"
    )?;
    for r in &report.ranks {
        let get = |phase: &str, f: fn(&super::json_summary::PhaseStats) -> f64| {
            r.phases
                .get(phase)
                .map_or("-".to_string(), |p| format!("{:.2}", f(p)))
        };
        writeln!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            r.rank,
            r.node_rank,
            r.steps,
            get("step", |p| p.p50),
            get("step", |p| p.p95),
            get("step", |p| p.p99),
            get("comm", |p| p.p50),
        )?;
    }
    writeln!(
        h,
        "</table><p class=\"note\">Times in ms. comm: all-reduce launch to completion; the rank that waits least is the one the others wait for.</p></section>"
    )?;
    Ok(())
}

fn phases(h: &mut String, report: &Report) -> anyhow::Result<()> {
    writeln!(h, "<section id=\"phases\"><h2>Phase split per rank</h2>")?;
    let names = ["data", "forward", "backward", "optimizer"];
    let categories: Vec<String> = report
        .ranks
        .iter()
        .map(|r| format!("rank {}", r.rank))
        .collect();
    let mean =
        |r: &super::json_summary::RankSummary, p: &str| r.phases.get(p).map_or(0.0, |s| s.mean);
    let mut parts: Vec<(String, Vec<f64>)> = names
        .iter()
        .map(|p| {
            (
                p.to_string(),
                report.ranks.iter().map(|r| mean(r, p)).collect(),
            )
        })
        .collect();
    parts.push((
        "other".into(),
        report
            .ranks
            .iter()
            .map(|r| (mean(r, "step") - names.iter().map(|p| mean(r, p)).sum::<f64>()).max(0.0))
            .collect(),
    ));
    h.push_str(&plots::stacked_bars(
        "mean ms per step, by phase",
        "ms",
        &categories,
        &parts,
    )?);
    writeln!(
        h,
        "<p class=\"note\">other: step time outside the timed phases. The all-reduce overlaps backward, so it is not a segment here (see the table above).</p></section>"
    )?;
    Ok(())
}

/// Collectives by kind per rank (the `comm` table): count, bytes, time per step
/// and bandwidth. Absent for runs without collectives.
fn comm(h: &mut String, report: &Report) -> anyhow::Result<()> {
    if report.ranks.iter().all(|r| r.comm.is_empty()) {
        return Ok(());
    }
    writeln!(
        h,
        "<section id=\"comm\"><h2>Communication by kind per rank</h2>\
         <table><tr><th>rank</th><th>kind</th><th>count</th><th>MB</th><th>ms per step</th><th>MB/s</th></tr>"
    )?;
    for r in &report.ranks {
        for (kind, c) in &r.comm {
            let per_step = if r.steps > 0 {
                format!("{:.2}", c.comm_ms / r.steps as f64)
            } else {
                "-".into()
            };
            writeln!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.2}</td><td>{}</td><td>{}</td></tr>",
                r.rank,
                escape(kind),
                c.count,
                c.bytes as f64 / 1e6,
                per_step,
                c.mb_per_s.map_or("-".into(), |v| format!("{v:.1}")),
            )?;
        }
    }
    writeln!(
        h,
        "</table><p class=\"note\">Every torch.distributed collective the Python package saw (FSDP's all-gathers and reduce-scatters among them), launch to completion. \
         Bandwidth includes waiting for peers: the rank that waits least, the one the others wait for, shows the highest.</p></section>"
    )?;
    Ok(())
}

/// Every `n`-th point, so a line has at most `max` points.
fn thin(points: Vec<(f64, f64)>, max: usize) -> Vec<(f64, f64)> {
    let every = points.len().div_ceil(max).max(1);
    points.into_iter().step_by(every).collect()
}

fn memory(h: &mut String, data: &RunData) -> anyhow::Result<()> {
    writeln!(h, "<section id=\"memory\"><h2>Memory per rank</h2>")?;
    let mut rss: BTreeMap<u32, Vec<(f64, f64)>> = BTreeMap::new();
    let mut device: BTreeMap<u32, Vec<(f64, f64)>> = BTreeMap::new();
    for s in &data.steps {
        if let Some(b) = s.rss_bytes {
            rss.entry(s.rank)
                .or_default()
                .push((s.step as f64, b as f64 / 1048576.0));
        }
        if let Some(b) = s.device_allocated_bytes {
            device
                .entry(s.rank)
                .or_default()
                .push((s.step as f64, b as f64 / 1048576.0));
        }
    }
    for (title, lines) in [("host RSS (MiB)", rss), ("device allocated (MiB)", device)] {
        if lines.is_empty() {
            continue;
        }
        let series: Vec<Series> = lines
            .into_iter()
            .map(|(rank, points)| Series {
                name: format!("rank {rank}"),
                points: thin(points, LINE_POINTS),
            })
            .collect();
        h.push_str(&plots::lines(title, "MiB", &series, &[], WIDE)?);
    }
    writeln!(h, "</section>")?;
    Ok(())
}

/// A bar per rank that has a value; the ranks without one are named below the
/// chart (`why`) instead of drawn as 0. Nothing when no rank has a value.
fn per_rank_bars(
    h: &mut String,
    title: &str,
    series: &str,
    values: &[(u32, Option<f64>)],
    why: &str,
) -> anyhow::Result<()> {
    let (with, without): (Vec<_>, Vec<_>) = values.iter().partition(|(_, v)| v.is_some());
    if with.is_empty() {
        return Ok(());
    }
    let categories: Vec<String> = with.iter().map(|(r, _)| format!("rank {r}")).collect();
    let bars: Vec<f64> = with.iter().filter_map(|(_, v)| *v).collect();
    h.push_str(&plots::stacked_bars(
        title,
        "%",
        &categories,
        &[(series.into(), bars)],
    )?);
    if !without.is_empty() {
        let ranks: Vec<String> = without.iter().map(|(r, _)| r.to_string()).collect();
        writeln!(
            h,
            "<p class=\"meta\">{series}, no value for rank {}: {why}</p>",
            ranks.join(", ")
        )?;
    }
    Ok(())
}

fn overhead(h: &mut String, report: &Report) -> anyhow::Result<()> {
    writeln!(
        h,
        "<section id=\"overhead\"><h2>Agent overhead per rank</h2>"
    )?;
    overhead_table(h, report)?;
    let overhead: Vec<(u32, Option<f64>)> = report
        .ranks
        .iter()
        .map(|r| (r.rank, r.overhead_pct))
        .collect();
    per_rank_bars(
        h,
        "agent time on the training thread, % of step time",
        "overhead %",
        &overhead,
        "no steps recorded",
    )?;
    let observed: Vec<(u32, Option<f64>)> = report
        .ranks
        .iter()
        .map(|r| (r.rank, r.observed_pct))
        .collect();
    per_rank_bars(
        h,
        "observed slowdown of the sampled steps, % of step time",
        "observed %",
        &observed,
        "no step carries an observed slowdown (a run before the figure, or no sample yet)",
    )?;
    let cpu: Vec<(u32, Option<f64>)> = report.ranks.iter().map(|r| (r.rank, r.cpu_pct)).collect();
    per_rank_bars(
        h,
        "agent CPU time, % of the process's CPU time (reported at finish)",
        "agent cpu %",
        &cpu,
        "not reported yet: the rank has not finished",
    )?;
    let dropped: i64 = report.ranks.iter().map(|r| r.samples_dropped).sum();
    let rows: i64 = report.ranks.iter().map(|r| r.rows_dropped).sum();
    let skipped: i64 = report.ranks.iter().map(|r| r.samples_skipped).sum();
    writeln!(
        h,
        "<p class=\"meta\">activation samples skipped within the budget: {skipped} · dropped: {dropped} · rows dropped: {rows}</p></section>"
    )?;
    Ok(())
}

/// Per rank, the agent's cost on each share of its budget, beside the budget;
/// a share above it is marked. The device column shows only when a rank has
/// device figures.
fn overhead_table(h: &mut String, report: &Report) -> anyhow::Result<()> {
    if report.ranks.is_empty() {
        return Ok(());
    }
    let budget = report.run.overhead_budget.filter(|b| *b > 0.0 && *b < 1.0);
    let with_device = report.ranks.iter().any(|r| r.device_pct.is_some());
    let cell = |v: Option<f64>| match v {
        None => "<td>-</td>".to_string(),
        Some(v) if budget.is_some_and(|b| v > 100.0 * b) => {
            format!("<td class=\"over\">{v:.2}</td>")
        }
        Some(v) => format!("<td>{v:.2}</td>"),
    };
    writeln!(
        h,
        "<p class=\"meta\">overhead budget: {}</p>",
        report.run.overhead_budget.map_or("not recorded".to_string(), |b| {
            format!(
                "{} of each process's CPU time (the cpu share) and of its step time (the device \
                 and observed shares){} (RANKSCOPE_OVERHEAD_BUDGET; docs/metrics.md, \
                 \"Which steps are sampled\")",
                diagnoses::budget_percent(b),
                if b >= 1.0 { ": no limit" } else { "" }
            )
        })
    )?;
    h.push_str("<table><tr><th>rank</th><th>host % of step time</th>");
    if with_device {
        h.push_str("<th>device %</th>");
    }
    h.push_str("<th>observed %</th><th>observed steps</th><th>process CPU %</th></tr>\n");
    for r in &report.ranks {
        write!(h, "<tr><td>{}</td>{}", r.rank, cell(r.overhead_pct))?;
        if with_device {
            h.push_str(&cell(r.device_pct));
        }
        writeln!(
            h,
            "{}<td>{}</td>{}</tr>",
            cell(r.observed_pct),
            r.observed_steps,
            cell(r.cpu_pct)
        )?;
    }
    writeln!(
        h,
        "</table><p class=\"note\">host: Σ overhead_ms / Σ step_ms (the agent on the training \
         thread); device: Σ overhead_device_ms / Σ step_ms; observed: the median slowdown of the \
         steps that carry one (sampled steps and those their work was in flight) times their \
         count, over Σ step_ms, so a step slow for another reason does not count whole; process \
         CPU: the agent's share of the process's CPU time, reported at finish. Marked: above the \
         budget.</p>"
    )?;
    Ok(())
}

fn layers(h: &mut String, layers: &[LayerSummary]) -> anyhow::Result<()> {
    writeln!(
        h,
        "<section id=\"layers\"><h2>Layer dimensionality</h2>\
         <p class=\"note\">Median over ranks per sampled step: stable rank (first colour) and effective rank (second); red dashes: detected jumps.</p><div class=\"grid\">"
    )?;
    if layers.is_empty() {
        writeln!(h, "<p class=\"note\">No layer was sampled.</p>")?;
    }
    for l in layers {
        let mut series = Vec::new();
        let mut marks = Vec::new();
        for (name, t) in [("stable", &l.stable_rank), ("effective", &l.effective_rank)] {
            if let Some(t) = t {
                series.push(Series {
                    name: name.into(),
                    points: t.series.iter().map(|p| (p.0 as f64, p.1)).collect(),
                });
                marks.extend(t.jumps.iter().map(|j| j.step as f64));
            }
        }
        h.push_str(&format!(
            "<div class=\"layer\" data-layer=\"{}\">",
            escape(&l.layer)
        ));
        h.push_str(&plots::lines(&l.layer, "", &series, &marks, SMALL)?);
        if let Some(note) = l.coverage.as_ref().and_then(|c| c.note.as_ref()) {
            h.push_str(&format!("<p class=\"note thin\">{}</p>", escape(note)));
        }
        h.push_str("</div>");
    }
    writeln!(h, "</div></section>")?;
    Ok(())
}

fn model(h: &mut String, report: &Report) -> anyhow::Result<()> {
    writeln!(h, "<section id=\"model\"><h2>Model profile</h2>")?;
    if report.model.is_empty() {
        writeln!(
            h,
            "<p class=\"note\">No model profile was sent (<code>agent.profile(model)</code>).</p></section>"
        )?;
        return Ok(());
    }
    writeln!(
        h,
        "<table><tr><th>layer</th><th>kind</th><th>params</th><th>bytes</th><th>forward FLOPs</th><th>output shape</th></tr>"
    )?;
    for m in &report.model {
        writeln!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&m.layer),
            escape(&m.kind),
            m.params,
            plots::short(m.param_bytes as f64),
            plots::short(m.forward_flops as f64),
            escape(&m.output_shape)
        )?;
    }
    let params: u64 = report.model.iter().map(|m| m.params).sum();
    let flops: u64 = report.model.iter().map(|m| m.forward_flops).sum();
    writeln!(
        h,
        "<tr><th>total</th><th></th><th>{params}</th><th></th><th>{}</th><th></th></tr></table></section>",
        plots::short(flops as f64)
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped() {
        assert_eq!(
            escape("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }

    #[test]
    fn ranks_without_a_value_are_named_not_drawn_as_zero() {
        let mut h = String::new();
        let values = [(0, Some(1.5)), (1, None), (2, Some(2.5)), (3, None)];
        per_rank_bars(&mut h, "cpu", "agent cpu %", &values, "not finished").unwrap();
        let label = |r: u32| format!(">\nrank {r}\n<");
        assert!(h.contains(&label(0)) && h.contains(&label(2)), "{h}");
        assert!(!h.contains(&label(1)) && !h.contains(&label(3)), "{h}");
        assert!(
            h.contains("agent cpu %, no value for rank 1, 3: not finished"),
            "{h}"
        );

        let mut h = String::new();
        per_rank_bars(&mut h, "cpu", "agent cpu %", &[(0, None)], "not finished").unwrap();
        assert!(h.is_empty(), "no chart when no rank has a value: {h}");
    }
}
