//! What `top` draws: one frame from the merged run, its findings and the
//! viewer's choices (sort, scroll), with ratatui widgets.
//!
//! The screen, top to bottom: a header (run, ranks, step, collectors, counters),
//! the live diagnoses, the ranks table (one row per rank: step, step ms, comm
//! ms, the phase split as a bar, memory, samples dropped/skipped, the agent's
//! cost per share of its budget, and a heatmap of its step time over the
//! recent steps), then the loss and throughput
//! sparklines and the layer panel, and the keys.

use std::collections::{BTreeMap, BTreeSet};

use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Cell, Paragraph, Row, Sparkline, Table, Wrap};

use rankscope_collector::live::cost::AgentCost;
use rankscope_collector::live::snapshot::{RankLive, RunSnapshot, StepPoint};

use crate::analysis::coverage::{self, Coverage};
use crate::analysis::live::Finding;

/// The smallest terminal `top` draws in.
pub const MIN_WIDTH: u16 = 80;
pub const MIN_HEIGHT: u16 = 20;

/// The order of the ranks table (`s` cycles it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SortKey {
    /// Slowest last step first: the worst ranks on top.
    #[default]
    StepMs,
    CommMs,
    Memory,
    Rank,
}

impl SortKey {
    pub fn next(self) -> SortKey {
        match self {
            SortKey::StepMs => SortKey::CommMs,
            SortKey::CommMs => SortKey::Memory,
            SortKey::Memory => SortKey::Rank,
            SortKey::Rank => SortKey::StepMs,
        }
    }

    fn name(self) -> &'static str {
        match self {
            SortKey::StepMs => "step ms",
            SortKey::CommMs => "comm ms (least first)",
            SortKey::Memory => "memory",
            SortKey::Rank => "rank",
        }
    }
}

/// Everything one frame shows.
#[derive(Debug, Default)]
pub struct Screen<'a> {
    pub run: Option<&'a RunSnapshot>,
    pub findings: &'a [Finding],
    /// Collectors that answered, of those asked.
    pub collectors_ok: usize,
    pub collectors: usize,
    /// Why a collector did not answer, or the chosen run is not there.
    pub problems: &'a [String],
    pub sort: SortKey,
    /// Rows scrolled past in the ranks table.
    pub scroll: usize,
}

fn newest(r: &RankLive) -> Option<&StepPoint> {
    r.steps.last()
}

/// Bytes as `1.2G`.
fn bytes(b: Option<u64>) -> String {
    let Some(b) = b else { return "-".into() };
    let units = ["B", "K", "M", "G", "T"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b}B")
    } else {
        format!("{v:.1}{}", units[u])
    }
}

fn ms(v: Option<f64>) -> String {
    v.filter(|v| v.is_finite())
        .map_or("-".into(), |v| format!("{v:.1}"))
}

/// What the agent cost a rank over the steps shown, in percent of their step
/// time: host (its time on the training thread) / observed (the robust sum of
/// the sampled steps' slowdown) and, where the rank has device figures,
/// / device. `-` for a share with no figure.
fn agent_cost(c: Option<&AgentCost>) -> String {
    let Some(c) = c.filter(|c| c.steps > 0) else {
        return "-".into();
    };
    let pct = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.1}", 100.0 * v));
    let mut text = format!("{}/{}", pct(Some(c.host)), pct(c.observed));
    if c.device.is_some() {
        text += &format!("/{}", pct(c.device));
    }
    text
}

/// A rank's memory: device allocated bytes where recorded, else RSS.
fn memory(p: &StepPoint) -> Option<u64> {
    p.device_allocated_bytes.or(p.rss_bytes)
}

/// The phase split of a step as a bar `width` wide: data, forward, backward
/// (with the all-reduce), optimizer, and the rest.
fn phase_bar(p: &StepPoint, width: usize) -> Line<'static> {
    let total = p.step_ms.max(1e-9);
    let parts = [
        (p.data_ms, 'd', Color::Magenta),
        (p.forward_ms, 'f', Color::Blue),
        (p.backward_ms, 'b', Color::Cyan),
        (p.optimizer_ms, 'o', Color::Green),
    ];
    let mut spans = Vec::new();
    let mut used = 0;
    for (value, c, color) in parts {
        let n = ((value.unwrap_or(0.0).max(0.0) / total) * width as f64).round() as usize;
        let n = n.min(width - used);
        if n > 0 {
            spans.push(Span::styled(
                c.to_string().repeat(n),
                Style::default().fg(Color::Black).bg(color),
            ));
            used += n;
        }
    }
    if used < width {
        spans.push(Span::raw(".".repeat(width - used)));
    }
    Line::from(spans)
}

/// A cell of the heatmap: the step's time against the median rank's.
fn heat(ratio: Option<f64>) -> Span<'static> {
    match ratio {
        None => Span::raw(" "),
        Some(r) if r <= 1.05 => Span::styled("░", Style::default().fg(Color::Green)),
        Some(r) if r <= 1.25 => Span::styled("▒", Style::default().fg(Color::Yellow)),
        Some(r) if r <= 1.6 => Span::styled("▓", Style::default().fg(Color::LightRed)),
        Some(_) => Span::styled("█", Style::default().fg(Color::Red)),
    }
}

/// The median step_ms of each of the run's steps over its ranks.
fn step_medians(run: &RunSnapshot) -> BTreeMap<u64, f64> {
    let mut per_step: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    for r in &run.ranks {
        for s in &r.steps {
            if s.step_ms.is_finite() {
                per_step.entry(s.step).or_default().push(s.step_ms);
            }
        }
    }
    per_step
        .into_iter()
        .map(|(step, mut v)| {
            v.sort_by(f64::total_cmp);
            (step, v[v.len() / 2])
        })
        .collect()
}

/// Ranks in the order the viewer chose.
pub fn sorted_ranks(run: &RunSnapshot, sort: SortKey) -> Vec<&RankLive> {
    let mut ranks: Vec<&RankLive> = run.ranks.iter().collect();
    let key = |r: &RankLive| -> f64 {
        let Some(p) = newest(r) else {
            return f64::NEG_INFINITY;
        };
        match sort {
            SortKey::StepMs => p.step_ms,
            SortKey::CommMs => -p.comm_ms.unwrap_or(f64::INFINITY),
            SortKey::Memory => memory(p).unwrap_or(0) as f64,
            SortKey::Rank => -(r.rank as f64),
        }
    };
    ranks.sort_by(|a, b| key(b).total_cmp(&key(a)).then_with(|| a.rank.cmp(&b.rank)));
    ranks
}

/// Ranks a finding names (shown in red in the table).
fn named_ranks(findings: &[Finding]) -> BTreeSet<u32> {
    let mut out = BTreeSet::new();
    for f in findings {
        let json = serde_json::to_value(&f.diagnosis.evidence).unwrap_or_default();
        if let Some(r) = json.get("rank").and_then(|v| v.as_u64()) {
            out.insert(r as u32);
        }
    }
    out
}

/// Draws one frame.
pub fn draw(frame: &mut Frame, screen: &Screen) {
    let area = frame.area();
    if area.width < MIN_WIDTH || area.height < MIN_HEIGHT {
        let text = format!(
            "rankscope top needs a terminal of at least {MIN_WIDTH}x{MIN_HEIGHT}; this one is {}x{}: enlarge it (q quits)",
            area.width, area.height
        );
        frame.render_widget(Paragraph::new(text).wrap(Wrap { trim: true }), area);
        return;
    }
    // Each finding or problem takes the lines it wraps to; at most 8 in all.
    let inner = area.width.saturating_sub(2).max(1) as usize;
    let wrapped: usize =
        screen
            .problems
            .iter()
            .map(|p| p.chars().count())
            .chain(screen.findings.iter().map(|f| {
                f.diagnosis.message.chars().count() + f.diagnosis.evidence.kind().len() + 16
            }))
            .map(|n| n.div_ceil(inner))
            .sum();
    let findings_height = (wrapped.clamp(1, 8) + 2) as u16;
    let [header, diagnoses, table, bottom, keys] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Length(findings_height),
        Constraint::Min(6),
        Constraint::Length(8),
        Constraint::Length(1),
    ])
    .areas(area);
    draw_header(frame, header, screen);
    draw_findings(frame, diagnoses, screen);
    match screen.run {
        Some(run) => {
            draw_ranks(frame, table, run, screen);
            draw_bottom(frame, bottom, run);
        }
        None => frame.render_widget(
            Paragraph::new("no run to show yet: waiting for a collector that holds one")
                .block(Block::bordered().title(" ranks ")),
            table,
        ),
    }
    frame.render_widget(
        Paragraph::new(format!(
            "q quit · s sort (now: {}) · r next run · j/k scroll",
            screen.sort.name()
        ))
        .style(Style::default().add_modifier(Modifier::DIM)),
        keys,
    );
}

fn draw_header(frame: &mut Frame, area: Rect, screen: &Screen) {
    let mut lines = Vec::new();
    let collectors = format!(
        "collectors {}/{} answering",
        screen.collectors_ok, screen.collectors
    );
    match screen.run {
        Some(run) => {
            let s = &run.summary;
            lines.push(Line::from(vec![
                Span::styled(
                    format!("run {}", s.run_id),
                    Style::default().add_modifier(Modifier::BOLD),
                ),
                Span::raw(format!(
                    " · world {} · ranks seen {} (finished {}) · step {} · {collectors}",
                    s.world_size,
                    s.ranks_seen,
                    s.ranks_finished,
                    s.last_step.map_or("-".into(), |v| v.to_string()),
                )),
            ]));
            let c = &run.counters;
            let mut text = format!(
                "samples skipped {} · samples dropped {} · rows dropped {} · non-finite events {}",
                c.samples_skipped, c.samples_dropped, c.rows_dropped, c.nonfinite_events
            );
            if c.rows_not_shown > 0 {
                text.push_str(&format!(
                    " · rows past the view's bounds {}",
                    c.rows_not_shown
                ));
            }
            lines.push(Line::from(text));
        }
        None => lines.push(Line::from(format!("rankscope top · {collectors}"))),
    }
    frame.render_widget(Paragraph::new(lines), area);
}

fn draw_findings(frame: &mut Frame, area: Rect, screen: &Screen) {
    let mut lines: Vec<Line> = screen
        .problems
        .iter()
        .map(|p| Line::styled(p.clone(), Style::default().fg(Color::Yellow)))
        .collect();
    lines.extend(screen.findings.iter().map(|f| {
        Line::from(vec![
            Span::styled(
                format!(
                    "[step {}] {} ",
                    f.fired_at_step,
                    f.diagnosis.evidence.kind()
                ),
                Style::default().fg(Color::Red).add_modifier(Modifier::BOLD),
            ),
            Span::raw(f.diagnosis.message.clone()),
        ])
    }));
    if lines.is_empty() {
        lines.push(Line::from("no finding"));
    }
    frame.render_widget(
        Paragraph::new(lines)
            .wrap(Wrap { trim: true })
            .block(Block::bordered().title(" live diagnoses ")),
        area,
    );
}

fn draw_ranks(frame: &mut Frame, area: Rect, run: &RunSnapshot, screen: &Screen) {
    const PHASE_WIDTH: usize = 12;
    const COST_WIDTH: u16 = 15;
    let fixed: u16 = 6 + 8 + 9 + 9 + PHASE_WIDTH as u16 + 8 + 11 + COST_WIDTH + 8 + 2;
    let heat_width = area.width.saturating_sub(fixed).max(1) as usize;
    let medians = step_medians(run);
    let recent: Vec<u64> = medians
        .keys()
        .rev()
        .take(heat_width)
        .rev()
        .copied()
        .collect();
    let named = named_ranks(screen.findings);
    let ranks = sorted_ranks(run, screen.sort);
    let visible = area.height.saturating_sub(3) as usize;
    let scroll = screen.scroll.min(ranks.len().saturating_sub(visible));
    let rows = ranks.iter().skip(scroll).take(visible).map(|r| {
        let by_step: BTreeMap<u64, f64> = r.steps.iter().map(|s| (s.step, s.step_ms)).collect();
        let heatmap: Vec<Span> = recent
            .iter()
            .map(|step| {
                let ratio = by_step
                    .get(step)
                    .zip(medians.get(step))
                    .map(|(v, m)| v / m.max(1e-9));
                heat(ratio)
            })
            .collect();
        let style = if named.contains(&r.rank) {
            Style::default().fg(Color::Red).add_modifier(Modifier::BOLD)
        } else {
            Style::default()
        };
        let p = newest(r);
        Row::new(vec![
            Cell::from(r.rank.to_string()).style(style),
            Cell::from(p.map_or("-".into(), |p| p.step.to_string())),
            Cell::from(ms(p.map(|p| p.step_ms))),
            Cell::from(ms(p.and_then(|p| p.comm_ms))),
            Cell::from(p.map_or(Line::from("-"), |p| phase_bar(p, PHASE_WIDTH))),
            Cell::from(bytes(p.and_then(memory))),
            Cell::from(format!("{}/{}", r.samples_dropped, r.samples_skipped)),
            Cell::from(agent_cost(r.agent_cost.as_ref())),
            Cell::from(if r.finished { "finished" } else { "" }),
            Cell::from(Line::from(heatmap)),
        ])
    });
    let header = Row::new(vec![
        "rank",
        "step",
        "step ms",
        "comm ms",
        "phases dfbo",
        "memory",
        "drop/skip",
        "agent % h/o/d",
        "",
        "step time vs median, recent steps",
    ])
    .style(Style::default().add_modifier(Modifier::BOLD));
    let widths = [
        Constraint::Length(6),
        Constraint::Length(8),
        Constraint::Length(9),
        Constraint::Length(9),
        Constraint::Length(PHASE_WIDTH as u16),
        Constraint::Length(8),
        Constraint::Length(11),
        Constraint::Length(COST_WIDTH),
        Constraint::Length(8),
        Constraint::Min(1),
    ];
    let title = format!(
        " ranks {}–{} of {} ",
        (scroll + 1).min(ranks.len()),
        (scroll + visible).min(ranks.len()),
        ranks.len()
    );
    frame.render_widget(
        Table::new(rows, widths)
            .header(header)
            .block(Block::bordered().title(title)),
        area,
    );
}

/// Per step (oldest first), the mean loss over the ranks that recorded one, and
/// the throughput: Σ samples / step time over the ranks.
fn series(run: &RunSnapshot) -> (Vec<f64>, Vec<f64>) {
    let mut loss: BTreeMap<u64, (f64, usize)> = BTreeMap::new();
    let mut throughput: BTreeMap<u64, f64> = BTreeMap::new();
    for r in &run.ranks {
        for s in &r.steps {
            if let Some(l) = s.loss.filter(|l| l.is_finite()) {
                let e = loss.entry(s.step).or_default();
                e.0 += l;
                e.1 += 1;
            }
            if let Some(n) = s.samples.filter(|_| s.step_ms > 0.0) {
                *throughput.entry(s.step).or_default() += n as f64 / (s.step_ms / 1000.0);
            }
        }
    }
    (
        loss.into_values().map(|(s, n)| s / n as f64).collect(),
        throughput.into_values().collect(),
    )
}

/// A series scaled to the sparkline's whole numbers (its range over 0–1,000).
fn scaled(values: &[f64]) -> Vec<u64> {
    let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let span = (hi - lo).max(1e-12);
    values
        .iter()
        .map(|v| (1.0 + 999.0 * (v - lo) / span) as u64)
        .collect()
}

fn draw_bottom(frame: &mut Frame, area: Rect, run: &RunSnapshot) {
    let [loss_area, throughput_area, layers_area] = Layout::horizontal([
        Constraint::Percentage(25),
        Constraint::Percentage(25),
        Constraint::Percentage(50),
    ])
    .areas(area);
    let (loss, throughput) = series(run);
    let last = |v: &[f64], unit: &str| v.last().map_or("-".into(), |x| format!("{x:.4}{unit}"));
    for (values, title, target, color) in [
        (
            &loss,
            format!(" loss {} ", last(&loss, "")),
            loss_area,
            Color::Cyan,
        ),
        (
            &throughput,
            format!(" samples/s {} ", last(&throughput, "")),
            throughput_area,
            Color::Green,
        ),
    ] {
        let width = target.width.saturating_sub(2) as usize;
        let tail = &values[values.len().saturating_sub(width)..];
        let data = scaled(tail);
        frame.render_widget(
            Sparkline::default()
                .block(Block::bordered().title(title))
                .style(Style::default().fg(color))
                .data(data.iter().copied()),
            target,
        );
    }
    let coverage: Vec<Coverage> = run
        .layers
        .iter()
        .map(|l| coverage::live_layer(l, run))
        .collect();
    // The layer with the thinnest series says why in the panel's title; each
    // thin layer's row says how thin instead of drawing a trend.
    let thinnest = coverage
        .iter()
        .filter(|c| c.note.is_some())
        .max_by_key(|c| c.skipped.unwrap_or(0));
    let title = match thinnest.and_then(|c| c.note.as_ref()) {
        Some(note) => format!(" layers ({}): {note} ", run.layers.len()),
        None => format!(" layers ({}) ", run.layers.len()),
    };
    let rows = run.layers.iter().zip(&coverage).map(|(l, c)| {
        let latest = l.history.last();
        let get = |f: fn(&rankscope_collector::live::snapshot::LayerPoint) -> Option<f64>| {
            latest.and_then(f).map_or("-".into(), |v| format!("{v:.2}"))
        };
        let trend: Vec<f64> = l.history.iter().filter_map(|p| p.stable_rank).collect();
        let trend = &trend[trend.len().saturating_sub(16)..];
        let spark: String = match (c.trend_reliable, c.planned, c.skipped) {
            (false, Some(planned), Some(skipped)) if skipped > 0 => {
                format!("{skipped} of {planned} skipped")
            }
            (false, ..) => format!("{} samples", c.measured),
            _ => scaled(trend)
                .iter()
                .map(|v| {
                    ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'][((*v - 1) * 8 / 1000).min(7) as usize]
                })
                .collect(),
        };
        let nonfinite = latest.map_or(0, |p| p.nonfinite);
        Row::new(vec![
            Cell::from(l.layer.clone()),
            Cell::from(get(|p| p.stable_rank)),
            Cell::from(get(|p| p.effective_rank)),
            Cell::from(get(|p| p.zero_fraction)),
            Cell::from(nonfinite.to_string()).style(if nonfinite > 0 {
                Style::default().fg(Color::Red)
            } else {
                Style::default()
            }),
            Cell::from(spark),
        ])
    });
    let widths = [
        Constraint::Min(12),
        Constraint::Length(7),
        Constraint::Length(7),
        Constraint::Length(6),
        Constraint::Length(6),
        Constraint::Length(16),
    ];
    frame.render_widget(
        Table::new(rows, widths)
            .header(
                Row::new(vec![
                    "layer",
                    "stable",
                    "eff.",
                    "zero",
                    "nan",
                    "stable rank",
                ])
                .style(Style::default().add_modifier(Modifier::BOLD)),
            )
            .block(Block::bordered().title(title)),
        layers_area,
    );
}
