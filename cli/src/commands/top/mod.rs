//! `rankscope top`: every rank of a run, live, in the terminal.
//!
//! It reads the live view of one or more collectors (`/live` on their `--http`
//! servers), merges a sharded run's ranks, runs the live diagnoses over it
//! ([`crate::analysis::live`]) and draws it with ratatui. Keys only (no mouse),
//! so it works over SSH; `q`, Esc or Ctrl-C restore the terminal and exit.
//!
//! Layout:
//! - `fetch`: asking the collectors, and merging their answers;
//! - `view`: drawing one frame;
//! - this module: the command line, the refresh loop and the keys.

mod fetch;
mod view;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use ratatui::Terminal;
use ratatui::backend::TestBackend;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};

use rankscope_collector::live::snapshot::{RunSnapshot, RunSummary};

use crate::analysis::live::{Finding, LiveDiagnoses};
use crate::duration_arg;
use fetch::Collector;
use view::{Screen, SortKey};

/// The token variable, shared with the agents.
const TOKEN_VAR: &str = "RANKSCOPE_TOKEN";

/// Watch every rank of a run live, from the collectors' live view.
#[derive(clap::Args)]
#[command(after_help = "Examples:
  rankscope collector --out ./rankscope-out --http 127.0.0.1:9464   # a collector with its live view
  rankscope top                                          # the most recent run on 127.0.0.1:9464
  rankscope top --collector 10.0.0.5:9464,10.0.0.6:9464 --run my-run   # a sharded run, merged
  rankscope top --token-file token.txt                   # a collector started with --token-file
  rankscope top --once --width 160 --height 50           # one frame as text, for scripts

Keys: q (or Esc, Ctrl-C) quits, s changes the sort (slowest step first, least
comm time first, memory, rank), r shows the next run, j/k or the arrows scroll.

The rows are the ranks: the last step, its time, its all-reduce time (comm ms),
its phases as a bar (d data, f forward, b backward, o optimizer), its memory
(device allocated, else RSS), samples dropped/skipped, and its step time over
the recent steps against the median rank's (░ within 5%, ▒ 25%, ▓ 60%, █
slower). The live diagnoses are report's (docs/diagnoses.md) over every step
the collectors keep (their --live-steps, 64 per rank) that all ranks have, each
with the step at which it fired.")]
pub struct Args {
    /// The collectors' --http addresses (HOST:PORT), comma-separated: every
    /// collector of a sharded run, whose ranks top merges.
    #[arg(
        long,
        value_name = "LIST",
        default_value = "127.0.0.1:9464",
        env = "RANKSCOPE_LIVE"
    )]
    pub collector: String,
    /// The run to show (default: the most recently updated).
    #[arg(long)]
    pub run: Option<String>,
    /// A file holding the collectors' token (their --token-file); else
    /// RANKSCOPE_TOKEN.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// How often to read the collectors.
    #[arg(long, default_value_t = duration_arg::Arg(Duration::from_secs(1)), value_parser = duration_arg::parse_arg)]
    pub interval: duration_arg::Arg,
    /// Steps per rank to show (the heatmap's window); the diagnoses read every
    /// step the collectors keep (their --live-steps).
    #[arg(long, default_value_t = 32)]
    pub steps: usize,
    /// Print one frame as text and exit, instead of the interactive screen.
    #[arg(long)]
    pub once: bool,
    /// The frame's width with --once.
    #[arg(long, default_value_t = 160, requires = "once")]
    pub width: u16,
    /// The frame's height with --once.
    #[arg(long, default_value_t = 50, requires = "once")]
    pub height: u16,
}

/// The viewer's state between frames.
struct Top {
    collectors: Vec<Collector>,
    steps: usize,
    /// The run asked for on the command line, or chosen with `r`.
    chosen: Option<String>,
    runs: Vec<RunSummary>,
    run: Option<RunSnapshot>,
    findings: Vec<Finding>,
    diagnoses: LiveDiagnoses,
    /// The run the diagnoses' history belongs to.
    diagnosed: Option<String>,
    answering: usize,
    problems: Vec<String>,
    sort: SortKey,
    scroll: usize,
}

impl Top {
    /// A view of `collectors` that has read nothing yet, showing `steps` steps of
    /// the run `chosen` (or the first run found).
    fn new(collectors: Vec<Collector>, steps: usize, chosen: Option<String>) -> Top {
        Top {
            collectors,
            steps,
            chosen,
            runs: Vec::new(),
            run: None,
            findings: Vec::new(),
            diagnoses: LiveDiagnoses::default(),
            diagnosed: None,
            answering: 0,
            problems: Vec::new(),
            sort: SortKey::default(),
            scroll: 0,
        }
    }
}

/// `HOST:PORT` entries of `--collector`; names the bad entry.
fn parse_collectors(list: &str, token: Option<String>) -> anyhow::Result<Vec<Collector>> {
    let mut out = Vec::new();
    for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let addr = entry
            .strip_prefix("http://")
            .unwrap_or(entry)
            .trim_end_matches('/');
        if entry.starts_with("https://") {
            anyhow::bail!(
                "--collector {entry}: the collector's --http server speaks plain HTTP; give HOST:PORT (put a TLS proxy's plain side here, or tunnel over SSH)"
            );
        }
        let port_ok = addr
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !port_ok {
            anyhow::bail!(
                "--collector {entry:?} is not HOST:PORT: give each collector's --http address, e.g. 127.0.0.1:9464"
            );
        }
        out.push(Collector {
            addr: addr.to_string(),
            token: token.clone(),
        });
    }
    if out.is_empty() {
        anyhow::bail!(
            "--collector is empty: give the collectors' --http addresses, e.g. 127.0.0.1:9464"
        );
    }
    Ok(out)
}

fn read_token(args: &Args) -> anyhow::Result<Option<String>> {
    if let Some(path) = &args.token_file {
        let token = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read --token-file {}", path.display()))?;
        if token.trim().is_empty() {
            anyhow::bail!(
                "--token-file {} is empty: put the collector's token in it",
                path.display()
            );
        }
        return Ok(Some(token.trim().to_string()));
    }
    Ok(std::env::var(TOKEN_VAR)
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty()))
}

impl Top {
    /// Reads every collector again, merges, and reruns the diagnoses.
    fn refresh(&mut self) {
        self.problems.clear();
        let mut lists = Vec::new();
        for c in &self.collectors {
            match c.runs() {
                Ok(list) => lists.push(list),
                Err(why) => self.problems.push(why),
            }
        }
        self.answering = lists.len();
        self.runs = fetch::merge_runs(lists);
        let Some(run_id) = self
            .chosen
            .clone()
            .or_else(|| self.runs.first().map(|r| r.run_id.clone()))
        else {
            self.run = None;
            self.findings.clear();
            if self.answering > 0 {
                self.problems.push(
                    "no run yet: the collectors hold none (have the ranks started, with RANKSCOPE_COLLECTOR pointing at them?)".into(),
                );
            }
            return;
        };
        if !self.runs.iter().any(|r| r.run_id == run_id) {
            self.run = None;
            self.findings.clear();
            if self.answering > 0 {
                let held: Vec<&str> = self.runs.iter().map(|r| r.run_id.as_str()).collect();
                self.problems.push(format!(
                    "no run {run_id:?} on the collectors: they hold {} (--run, or r to choose)",
                    if held.is_empty() {
                        "none yet".to_string()
                    } else {
                        held.join(", ")
                    }
                ));
            }
            return;
        }
        // Every step the collectors keep, for the diagnoses: the ranks' newest
        // steps differ by up to a batch, and the diagnoses compare only the
        // steps every rank has. The view draws the last `steps`.
        let mut parts = Vec::new();
        for c in &self.collectors {
            match c.run(
                &run_id,
                rankscope_collector::live::MAX_STEPS.max(self.steps),
            ) {
                Ok(Some(part)) => parts.push(part),
                Ok(None) => {}
                Err(why) => {
                    if !self.problems.contains(&why) {
                        self.problems.push(why)
                    }
                }
            }
        }
        self.run = fetch::merge_run(parts);
        if self.diagnosed.as_deref() != Some(run_id.as_str()) {
            self.diagnoses = LiveDiagnoses::default();
            self.diagnosed = Some(run_id.clone());
        }
        self.findings = match &self.run {
            Some(run) => self.diagnoses.update(run),
            None => Vec::new(),
        };
        if let Some(run) = &mut self.run {
            run.keep_last_steps(self.steps);
        }
    }

    fn screen(&self) -> Screen<'_> {
        Screen {
            run: self.run.as_ref(),
            findings: &self.findings,
            collectors_ok: self.answering,
            collectors: self.collectors.len(),
            problems: &self.problems,
            sort: self.sort,
            scroll: self.scroll,
        }
    }

    /// The run after the one shown.
    fn next_run(&mut self) {
        if self.runs.is_empty() {
            return;
        }
        let now = self.run.as_ref().map(|r| r.summary.run_id.as_str());
        let at = self
            .runs
            .iter()
            .position(|r| Some(r.run_id.as_str()) == now);
        let next = at.map_or(0, |i| (i + 1) % self.runs.len());
        self.chosen = Some(self.runs[next].run_id.clone());
        self.scroll = 0;
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.steps == 0 {
        anyhow::bail!("--steps 0 shows nothing: give the steps per rank to read, e.g. 32");
    }
    if args.once && (args.width < view::MIN_WIDTH || args.height < view::MIN_HEIGHT) {
        anyhow::bail!(
            "--width {} --height {}: a frame needs at least --width {} --height {}",
            args.width,
            args.height,
            view::MIN_WIDTH,
            view::MIN_HEIGHT
        );
    }
    if args.interval.0.is_zero() {
        anyhow::bail!("--interval 0 would read the collectors without pause: give e.g. 1s");
    }
    let token = read_token(&args)?;
    let mut top = Top::new(
        parse_collectors(&args.collector, token)?,
        args.steps,
        args.run.clone(),
    );
    if args.once {
        return once(&mut top, args.width, args.height);
    }
    interactive(&mut top, args.interval.0)
}

/// One frame as text on stdout; an error when nothing could be shown.
fn once(top: &mut Top, width: u16, height: u16) -> anyhow::Result<()> {
    top.refresh();
    let mut terminal = Terminal::new(TestBackend::new(width, height))?;
    terminal.draw(|f| view::draw(f, &top.screen()))?;
    let buffer = terminal.backend().buffer();
    let mut text = String::new();
    for y in 0..buffer.area.height {
        let mut line = String::new();
        for x in 0..buffer.area.width {
            line.push_str(buffer[(x, y)].symbol());
        }
        text.push_str(line.trim_end());
        text.push('\n');
    }
    print!("{text}");
    if top.run.is_none() {
        anyhow::bail!(
            "nothing to show: {}",
            if top.problems.is_empty() {
                "no run".to_string()
            } else {
                top.problems.join("; ")
            }
        );
    }
    Ok(())
}

fn interactive(top: &mut Top, interval: Duration) -> anyhow::Result<()> {
    let mut terminal = ratatui::try_init()
        .context("rankscope top needs a terminal (stdin and stdout a TTY); for text use --once")?;
    let result = (|| -> anyhow::Result<()> {
        let mut next_refresh = Instant::now();
        loop {
            if Instant::now() >= next_refresh {
                top.refresh();
                next_refresh = Instant::now() + interval;
            }
            terminal.draw(|f| view::draw(f, &top.screen()))?;
            let wait = next_refresh.saturating_duration_since(Instant::now());
            if !event::poll(wait)? {
                continue;
            }
            let Event::Key(key) = event::read()? else {
                continue;
            };
            if key.kind != KeyEventKind::Press {
                continue;
            }
            match key.code {
                KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
                KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => {
                    return Ok(());
                }
                KeyCode::Char('s') => top.sort = top.sort.next(),
                KeyCode::Char('r') | KeyCode::Tab => {
                    top.next_run();
                    next_refresh = Instant::now();
                }
                KeyCode::Char('j') | KeyCode::Down => top.scroll += 1,
                KeyCode::Char('k') | KeyCode::Up => top.scroll = top.scroll.saturating_sub(1),
                KeyCode::PageDown => top.scroll += 20,
                KeyCode::PageUp => top.scroll = top.scroll.saturating_sub(20),
                _ => {}
            }
            let ranks = top.run.as_ref().map_or(0, |r| r.ranks.len());
            top.scroll = top.scroll.min(ranks.saturating_sub(1));
        }
    })();
    ratatui::restore();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collector_lists_are_checked_entry_by_entry() {
        let list = parse_collectors("127.0.0.1:9464, http://h:1/", None).unwrap();
        assert_eq!(list[0].addr, "127.0.0.1:9464");
        assert_eq!(list[1].addr, "h:1");
        for bad in ["", "host", "host:port", ":80", "https://h:1"] {
            let err = parse_collectors(bad, None).unwrap_err().to_string();
            assert!(err.contains("--collector"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_small_terminal_gets_a_message_not_a_panic() {
        let top = Top::new(Vec::new(), 8, None);
        for (w, h) in [(1, 1), (20, 5), (79, 40), (200, 19)] {
            let mut terminal = Terminal::new(TestBackend::new(w, h)).unwrap();
            terminal.draw(|f| view::draw(f, &top.screen())).unwrap();
        }
        let mut terminal = Terminal::new(TestBackend::new(60, 10)).unwrap();
        terminal.draw(|f| view::draw(f, &top.screen())).unwrap();
        let text: String = terminal
            .backend()
            .buffer()
            .content()
            .iter()
            .map(|c| c.symbol())
            .collect();
        assert!(text.contains("at least 80x20"), "{text}");
    }

    /// One frame of a run of one rank at step 399, sampled every 10 steps,
    /// whose layer `fc` holds samples at `sampled`.
    fn frame_of_layer(sampled: &[u64]) -> String {
        use rankscope_collector::live::snapshot::{
            LayerLive, LayerPoint, RankLive, RunSummary, StepPoint,
        };
        let run = RunSnapshot {
            summary: RunSummary {
                run_id: "r".into(),
                world_size: 1,
                ranks_seen: 1,
                last_step: Some(399),
                ..Default::default()
            },
            sample_every: Some(10),
            ranks: vec![RankLive {
                rank: 0,
                steps: (368..400)
                    .map(|step| StepPoint {
                        step,
                        step_ms: 10.0,
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }],
            layers: vec![LayerLive {
                layer: "fc".into(),
                rank: 0,
                history: sampled
                    .iter()
                    .enumerate()
                    .map(|(i, &step)| LayerPoint {
                        step,
                        stable_rank: Some(4.0 - i as f64 * 0.1),
                        ..Default::default()
                    })
                    .collect(),
            }],
            ..Default::default()
        };
        frame(run)
    }

    /// One frame of `run`, as `top` draws it after a read (each rank's last
    /// 32 steps).
    fn frame(mut run: RunSnapshot) -> String {
        run.keep_last_steps(32);
        let mut top = Top::new(Vec::new(), 32, None);
        top.run = Some(run);
        let mut terminal = Terminal::new(TestBackend::new(240, 40)).unwrap();
        terminal.draw(|f| view::draw(f, &top.screen())).unwrap();
        let buffer = terminal.backend().buffer();
        (0..buffer.area.height)
            .map(|y| {
                let line: String = (0..buffer.area.width)
                    .map(|x| buffer[(x, y)].symbol())
                    .collect();
                line + "\n"
            })
            .collect()
    }

    #[test]
    fn a_thin_layer_says_so_instead_of_a_trend() {
        // The budget let 4 of the 32 planned samples since step 80 in.
        let text = frame_of_layer(&[80, 160, 240, 390]);
        assert!(
            text.contains("28 of 32 planned samples skipped: trends unreliable"),
            "{text}"
        );
        assert!(text.contains("28 of 32 skipped"), "{text}");
        // Every planned sample in: a trend, no note.
        let full: Vec<u64> = (0..32).map(|i| 80 + 10 * i).collect();
        let text = frame_of_layer(&full);
        assert!(!text.contains("planned samples"), "{text}");
        assert!(!text.contains("of 32 skipped"), "{text}");
    }

    #[test]
    fn each_rank_shows_what_the_agent_cost_it() {
        use rankscope_collector::live::snapshot::{RankLive, RunSummary, StepPoint};
        // Rank 0: 0.1 ms of 10 ms steps on the training thread (1 %); the
        // sampled steps (every 8th) and the next 0.4 ms slower (8 of 32 steps:
        // 1 %). Rank 1 has device figures too: 0.4 ms a sampled step (0.5 %).
        let rank = |rank: u32| RankLive {
            rank,
            steps: (368..400)
                .map(|step| StepPoint {
                    step,
                    step_ms: 10.0,
                    overhead_ms: 0.1,
                    overhead_observed_ms: (step % 8 < 2).then_some(0.4),
                    overhead_device_ms: (rank == 1).then_some(if step % 8 == 0 {
                        0.4
                    } else {
                        0.0
                    }),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        let run = RunSnapshot {
            summary: RunSummary {
                run_id: "r".into(),
                world_size: 2,
                ranks_seen: 2,
                last_step: Some(399),
                ..Default::default()
            },
            ranks: vec![rank(0), rank(1)],
            ..Default::default()
        };
        let text = frame(run);
        assert!(text.contains("agent % h/o/d"), "{text}");
        let row = |r: &str| {
            text.lines()
                .find(|l| l.trim_start_matches(['│', ' ']).starts_with(r))
                .unwrap_or_default()
                .to_string()
        };
        assert!(row("0 ").contains(" 1.0/1.0 "), "{text}");
        assert!(row("1 ").contains(" 1.0/1.0/0.5 "), "{text}");
    }
}
