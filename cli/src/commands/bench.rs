//! `rankscope bench`: the agent's overhead, measured side by side in one run.
//!
//! The same training loop runs in rounds that interleave four configurations
//! (agent off, off again as a noise floor, sampling every 10 steps, sampling every
//! step), in a rotating order, all streaming to a collector in its own process as
//! in production, so machine noise hits them alike; the overhead is the ratio of
//! median round times. Each configuration trains in a process of its own (this
//! binary, started with the hidden `--child`), so the agent's overhead budget
//! measures against the CPU time of its own process, as in production. This is
//! done once per training thread count: all cores to training (nothing left for
//! the agent's threads), and one core left free (as on GPU nodes, where the
//! training process mostly waits on the device). For the sampling
//! configurations it reports the agent's measured CPU share against the budget
//! over the timed rounds (from the end of the warm-up round, so the one-time
//! start-up is reported apart, in the whole run's share), and the samples taken
//! against those the budget allows: the budget's share of the process's CPU time,
//! less the agent's time not spent on samples, over the measured cost of one. It also times the
//! training thread's cost of a non-sampled and of a sampled tap, the worker's
//! cost of one sample, and the agent's start-up with 200 taps. It prints a
//! Markdown report.
//!
//! `--spectrum` measures something else: the exact and the sketched spectrum of one
//! matrix per kind of spectrum, side by side (CPU time, relative errors and the sketch's
//! own error estimates), as in `docs/metrics.md`, and the targets of the sketch against
//! them: `stable_rank` and `participation_ratio` within 2 % at ≥ 10× less CPU,
//! `effective_rank` within 5 % at ≥ 5× less CPU, the exact path counted where the sketch
//! falls back to it.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use rankscope_agent::config::{AgentConfig, OverheadBudget};
use rankscope_agent::sampling;
use rankscope_agent::{Agent, Mode};
use tch::Device;
use tch::nn::{self, OptimizerConfig};

use crate::example_models::{self, Workload};

mod collector;
mod costs;
use costs::{init_cost, median, non_sampled_observe, non_sampled_step, sampled_cost};

/// Measure the agent's overhead (results for BENCHMARKS.md).
#[derive(clap::Args, Clone, Debug)]
#[command(after_help = "Examples:
  rankscope bench
  rankscope bench --model transformer --rounds 9 --steps-per-round 60
  rankscope bench --threads 16,15 --overhead-budget 1%
  rankscope bench --spectrum --rows 2048 --cols 4096
  rankscope bench collector   # the collector: rows per CPU second, peak RSS, bytes per row")]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    /// Another benchmark in place of the agent's overhead.
    #[command(subcommand)]
    pub what: Option<Other>,
    #[arg(long, value_enum, default_value_t = Workload::Transformer)]
    pub model: Workload,
    /// Interleaved rounds per configuration.
    #[arg(long, default_value_t = 7)]
    pub rounds: usize,
    /// Training steps per round.
    #[arg(long, default_value_t = 50)]
    pub steps_per_round: u64,
    #[arg(long, default_value_t = 64)]
    pub batch_size: i64,
    /// libtorch intra-op thread counts for training, one measurement each
    /// [default: all cores, then all cores but one].
    #[arg(long, value_delimiter = ',')]
    pub threads: Vec<usize>,
    /// The agent's share of its process's CPU time (RANKSCOPE_OVERHEAD_BUDGET).
    #[arg(long, default_value = "2%", value_parser = crate::overhead_budget_arg::parse)]
    pub overhead_budget: OverheadBudget,
    /// Internal: train one configuration, driven round by round through stdin.
    #[arg(long, hide = true, requires = "collector")]
    pub child: Option<usize>,
    /// Internal: the collector a `--child` sends to.
    #[arg(long, hide = true)]
    pub collector: Option<String>,
    /// Instead of the overhead: exact against sketched spectrum on synthetic spectra (the
    /// rounds are interleaved rounds of each run per kind).
    #[arg(long)]
    pub spectrum: bool,
    /// Rows of the --spectrum matrices.
    #[arg(long, default_value_t = 2048)]
    pub rows: i64,
    /// Columns of the --spectrum matrices.
    #[arg(long, default_value_t = 4096)]
    pub cols: i64,
}

/// Benchmarks other than the agent's overhead.
#[derive(clap::Subcommand, Clone, Debug)]
pub enum Other {
    /// The collector's throughput per CPU second, peak RSS and bytes per row.
    Collector(collector::Args),
}

struct Setup {
    label: &'static str,
    mode: Mode,
    sample_every: u64,
}

const SETUPS: [Setup; 4] = [
    Setup {
        label: "off",
        mode: Mode::Off,
        sample_every: 1,
    },
    // The same as the first: how far two identical configurations differ in this
    // run, i.e. the noise floor of the other ratios.
    Setup {
        label: "off again (noise floor)",
        mode: Mode::Off,
        sample_every: 1,
    },
    Setup {
        label: "every 10 steps",
        mode: Mode::Full,
        sample_every: 10,
    },
    Setup {
        label: "every step",
        mode: Mode::Full,
        sample_every: 1,
    },
];

pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(Other::Collector(collector)) = args.what {
        return collector::run(collector);
    }
    if args.spectrum {
        return spectrum(&args);
    }
    if let Some(setup) = args.child {
        return child(&args, setup);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = if args.threads.is_empty() {
        let mut t = vec![cores];
        if cores > 1 {
            t.push(cores - 1);
        }
        t
    } else {
        args.threads.clone()
    };
    if let Some(bad) = threads.iter().find(|&&t| t == 0) {
        anyhow::bail!("--threads {bad} is not a thread count: give counts of 1 or more");
    }
    let collector = ChildCollector::start()?;
    println!(
        "{} cores; collector in its own process; {} model, batch {}, {} rounds x {} steps per configuration, interleaved, each in its own process; overhead budget {}\n",
        cores,
        args.model.name(),
        args.batch_size,
        args.rounds,
        args.steps_per_round,
        args.overhead_budget
    );
    let bar = indicatif::ProgressBar::new((threads.len() * args.rounds * SETUPS.len()) as u64);
    let mut tables = Vec::new();
    for &n in &threads {
        let rounds = overhead_rounds(&args, n, &collector.addr, &bar)?;
        tables.push((n, rounds));
    }
    bar.finish_and_clear();
    for (n, rounds) in &tables {
        print_overhead(*n, cores, rounds, &args);
    }

    tch::set_num_threads(threads[0] as i32);
    let observe_ns = non_sampled_observe(&collector.addr)?;
    let step_ns = non_sampled_step(&collector.addr)?;
    let (handoff_us, compute_ms, shape) = sampled_cost(&collector.addr)?;
    let init_ms = init_cost(&collector.addr)?;
    println!("| measurement | value | target |");
    println!("|---|---|---|");
    println!(
        "| training thread, non-sampled step: one tap (observe) | {observe_ns:.1} ns | <= 1 us per step |"
    );
    println!(
        "| training thread, non-sampled step: step guard with 4 phases (row queued) | {step_ns:.0} ns | - |"
    );
    println!(
        "| training thread, sampled step: one tap of a {shape} activation (detach, copy, hand over) | {handoff_us:.1} us | - |"
    );
    println!(
        "| metrics worker: one {shape} sample (health, Gram, eigvalsh; 1 intra-op thread) | {compute_ms:.3} ms | - |"
    );
    println!("| agent start-up + 200 taps | {init_ms:.3} ms | <= 5 ms |");
    let summary = collector.stop()?;
    println!("\ncollector: {summary}");
    Ok(())
}

/// A configuration's agent at one moment: its samples and cumulative CPU times.
#[derive(Debug, Default, Clone, Copy)]
struct Snapshot {
    taken: u64,
    dropped: u64,
    skipped: u64,
    /// The agent's CPU time, and of it the part spent on samples (taking them on
    /// the training thread, measuring them on the metrics thread).
    agent_ns: u64,
    sample_ns: u64,
    process_ns: u64,
}

impl Snapshot {
    const FIELDS: usize = 6;

    fn of(agent: &Agent) -> Snapshot {
        let samples = agent.activation_samples();
        let overhead = agent.overhead();
        Snapshot {
            taken: samples.taken,
            dropped: samples.dropped,
            skipped: samples.skipped,
            agent_ns: overhead.map_or(0, |o| o.agent_ns),
            sample_ns: overhead.map_or(0, |o| o.training_sample_ns + o.metrics_ns),
            process_ns: overhead.map_or(0, |o| o.process_ns),
        }
    }

    fn to_line(self) -> String {
        format!(
            "{} {} {} {} {} {}",
            self.taken, self.dropped, self.skipped, self.agent_ns, self.sample_ns, self.process_ns
        )
    }

    fn parse(numbers: &[u64]) -> Option<Snapshot> {
        match *numbers {
            [taken, dropped, skipped, agent_ns, sample_ns, process_ns] => Some(Snapshot {
                taken,
                dropped,
                skipped,
                agent_ns,
                sample_ns,
                process_ns,
            }),
            _ => None,
        }
    }

    /// What happened between `earlier` and `self`.
    fn since(self, earlier: Snapshot) -> Snapshot {
        Snapshot {
            taken: self.taken.saturating_sub(earlier.taken),
            dropped: self.dropped.saturating_sub(earlier.dropped),
            skipped: self.skipped.saturating_sub(earlier.skipped),
            agent_ns: self.agent_ns.saturating_sub(earlier.agent_ns),
            sample_ns: self.sample_ns.saturating_sub(earlier.sample_ns),
            process_ns: self.process_ns.saturating_sub(earlier.process_ns),
        }
    }

    /// The agent's share of the process's CPU time.
    fn share(self) -> f64 {
        self.agent_ns as f64 / self.process_ns.max(1) as f64
    }

    /// The samples `budget` pays for: what the budget leaves after the agent's
    /// time not spent on samples (the transport thread, step rows), divided by the
    /// measured cost of one sample, at most the planned samples.
    fn allowed(self, budget: OverheadBudget) -> f64 {
        let planned = (self.taken + self.skipped) as f64;
        let per_sample = self.sample_ns as f64 / self.taken.max(1) as f64;
        let fixed = self.agent_ns.saturating_sub(self.sample_ns) as f64;
        let room = (budget.fraction() * self.process_ns as f64 - fixed).max(0.0);
        planned.min(room / per_sample.max(1.0))
    }
}

/// What a configuration's process reports at the end: its whole run (start-up
/// included), and the timed rounds alone (after the warm-up round).
#[derive(Debug, Default, Clone, Copy)]
struct ChildReport {
    whole: Snapshot,
    timed: Snapshot,
}

/// Per setup: the median round in seconds, and what its process reported.
struct Rounds {
    median: Vec<f64>,
    reports: Vec<ChildReport>,
}

/// One configuration's training process, driven round by round.
struct SetupProcess {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl SetupProcess {
    fn start(args: &Args, setup: usize, threads: usize, addr: &str) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("cannot find the rankscope binary")?;
        let mut child = Command::new(exe)
            .args(["bench", "--child", &setup.to_string(), "--collector", addr])
            .args(["--threads", &threads.to_string()])
            .args(["--model", args.model.name()])
            .args(["--steps-per-round", &args.steps_per_round.to_string()])
            .args(["--batch-size", &args.batch_size.to_string()])
            .args(["--overhead-budget", &args.overhead_budget.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("cannot start a bench configuration")?;
        let stdin = child.stdin.take().context("child stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("child stdout")?);
        let mut process = SetupProcess {
            child,
            stdin,
            stdout,
        };
        process.answer()?; // "ready": the model is built.
        Ok(process)
    }

    fn ask(&mut self, command: &str) -> anyhow::Result<String> {
        writeln!(self.stdin, "{command}")?;
        self.stdin.flush()?;
        self.answer()
    }

    fn answer(&mut self) -> anyhow::Result<String> {
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        anyhow::ensure!(!line.is_empty(), "a bench configuration exited early");
        Ok(line.trim().to_string())
    }
}

impl Drop for SetupProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Rounds interleaved over the setups, each in its own process; the first round
/// warms up.
fn overhead_rounds(
    args: &Args,
    threads: usize,
    addr: &str,
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<Rounds> {
    let mut processes = (0..SETUPS.len())
        .map(|i| SetupProcess::start(args, i, threads, addr))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); SETUPS.len()];
    for round in 0..=args.rounds {
        // Each round starts with the next configuration, so none always runs
        // right after another.
        for k in 0..processes.len() {
            let i = (round + k) % processes.len();
            let answer = processes[i].ask("round")?;
            let secs: f64 = answer
                .parse()
                .with_context(|| format!("a round answered {answer:?}"))?;
            if round > 0 {
                times[i].push(secs);
                bar.inc(1);
            }
        }
    }
    let mut reports = Vec::new();
    for p in &mut processes {
        let answer = p.ask("finish")?;
        let n: Vec<u64> = answer
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .with_context(|| format!("a configuration reported {answer:?}"))?;
        let (whole, warm) = n.split_at(n.len().min(Snapshot::FIELDS));
        let (Some(whole), Some(warm)) = (Snapshot::parse(whole), Snapshot::parse(warm)) else {
            anyhow::bail!("a configuration reported {answer:?}");
        };
        reports.push(ChildReport {
            whole,
            timed: whole.since(warm),
        });
    }
    Ok(Rounds {
        median: times.iter().map(|t| median(t)).collect(),
        reports,
    })
}

/// A configuration's process: builds its model, then runs a round per `round`
/// line on stdin (answering its seconds), and reports its samples and CPU times
/// on `finish`.
fn child(args: &Args, index: usize) -> anyhow::Result<()> {
    let setup = SETUPS
        .get(index)
        .with_context(|| format!("--child {index}: no such configuration"))?;
    let threads = args.threads.first().copied().unwrap_or(1).max(1);
    tch::set_num_threads(threads as i32);
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let config = AgentConfig::builder()
        .mode(setup.mode)
        .sample_every(setup.sample_every)
        .overhead_budget(args.overhead_budget)
        .collector(args.collector.clone().unwrap_or_default())
        .run_id(format!("bench-t{threads}-{index}-{}", std::process::id()))
        .rank(0u32)
        .world_size(1u32)
        .build_with(|_| None)?;
    let agent = Agent::new(config);
    let model = example_models::build(args.model, &vs.root(), &agent);
    let mut opt = nn::AdamW::default().build(&vs, 1e-3)?;
    let mut data = example_models::Data::new(args.model, 1, Device::Cpu);
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready")?;
    out.flush()?;
    let mut step = 0u64;
    // The agent after the warm-up round: the timed rounds are measured from here.
    let mut warm: Option<Snapshot> = None;
    for line in std::io::stdin().lock().lines() {
        match line?.trim() {
            "round" => {
                let started = Instant::now();
                for _ in 0..args.steps_per_round {
                    let s = agent.step(step);
                    step += 1;
                    example_models::train_step(
                        args.model,
                        &model,
                        &vs,
                        &mut opt,
                        &mut data,
                        args.batch_size,
                        &s,
                    );
                }
                writeln!(out, "{}", started.elapsed().as_secs_f64())?;
                warm.get_or_insert_with(|| Snapshot::of(&agent));
            }
            "finish" => {
                let report = agent.finish();
                if report.rows_unacked > 0 {
                    tracing::warn!(
                        unacked = report.rows_unacked,
                        "rows were not acknowledged by the bench collector"
                    );
                }
                let whole = Snapshot::of(&agent);
                writeln!(
                    out,
                    "{} {}",
                    whole.to_line(),
                    warm.unwrap_or_default().to_line()
                )?;
                out.flush()?;
                return Ok(());
            }
            other => anyhow::bail!("unknown bench command {other:?}"),
        }
        out.flush()?;
    }
    Ok(())
}

fn print_overhead(threads: usize, cores: usize, rounds: &Rounds, args: &Args) {
    let times = &rounds.median;
    let spare = cores.saturating_sub(threads);
    let budget = args.overhead_budget;
    println!(
        "### Training on {threads} intra-op thread(s), {spare} core(s) left for the agent and collector\n"
    );
    println!(
        "| configuration | median round | ms/step | overhead vs off | agent CPU share, timed rounds | target | whole run (start-up included) | samples taken / skipped / dropped, timed rounds | taken / allowed by the budget |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for ((setup, &m), r) in SETUPS.iter().zip(times).zip(&rounds.reports) {
        let sampling = setup.mode != Mode::Off;
        let cells = if sampling {
            let t = r.timed;
            [
                format!("{:.2} %", 100.0 * t.share()),
                format!("<= {budget}"),
                format!("{:.2} %", 100.0 * r.whole.share()),
                format!("{} / {} / {}", t.taken, t.skipped, t.dropped),
                format!(
                    "{:.0} %",
                    100.0 * t.taken as f64 / t.allowed(budget).max(1.0)
                ),
            ]
        } else {
            ["-", "-", "-", "-", "-"].map(String::from)
        };
        println!(
            "| {} | {:.3} s | {:.3} | {:+.2} % | {} |",
            setup.label,
            m,
            1e3 * m / args.steps_per_round as f64,
            100.0 * (m / times[0] - 1.0),
            cells.join(" | ")
        );
    }
    println!();
}

/// `rankscope collector` in a child process, on a free loopback port.
struct ChildCollector {
    child: Child,
    addr: String,
    out: std::path::PathBuf,
    lines: std::sync::mpsc::Receiver<String>,
}

impl ChildCollector {
    fn start() -> anyhow::Result<ChildCollector> {
        let out = std::env::temp_dir().join(format!("rankscope-bench-{}", std::process::id()));
        std::fs::create_dir_all(&out)?;
        let exe = std::env::current_exe().context("cannot find the rankscope binary")?;
        let mut child = Command::new(exe)
            .args(["collector", "--listen", "127.0.0.1:0", "--out"])
            .arg(&out)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("cannot start the bench collector")?;
        let stdout = child.stdout.take().context("collector stdout")?;
        let mut lines = std::io::BufReader::new(stdout).lines();
        let first = lines
            .next()
            .context("the bench collector exited before listening")??;
        let addr = first
            .strip_prefix("rankscope collector listening on ")
            .and_then(|rest| rest.split(',').next())
            .with_context(|| format!("unexpected collector output: {first}"))?
            .to_string();
        // Keep reading its output so it never blocks on a full pipe.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Ok(ChildCollector {
            child,
            addr,
            out,
            lines: rx,
        })
    }

    /// SIGTERM (the collector drains), then its closing summary line.
    fn stop(mut self) -> anyhow::Result<String> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait()?.is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let summary = self
            .lines
            .recv_timeout(Duration::from_secs(5))
            .unwrap_or_else(|_| "no summary".into());
        Ok(summary)
    }
}

impl Drop for ChildCollector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.out);
    }
}

/// `--spectrum`: one matrix per kind of spectrum, both methods, on one intra-op thread
/// (as the metrics worker runs).
fn spectrum(args: &Args) -> anyhow::Result<()> {
    use rankscope_agent::sampling::spectra::{self, SpectrumKind};
    let side = args.rows.min(args.cols);
    if side < sampling::SKETCH_MIN_SIDE {
        anyhow::bail!(
            "--rows {} --cols {}: the sketch needs at least {} of each",
            args.rows,
            args.cols,
            sampling::SKETCH_MIN_SIDE
        );
    }
    let rounds = args.rounds.max(1);
    println!(
        "{} kinds of spectra, {rounds} interleaved rounds of each run per kind, median CPU time of this thread\n",
        SpectrumKind::BENCH.len()
    );
    let bar = indicatif::ProgressBar::new(SpectrumKind::BENCH.len() as u64);
    let mut comparisons = Vec::new();
    for kind in SpectrumKind::BENCH {
        comparisons.push(spectra::compare(kind, args.rows, args.cols, rounds)?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    println!("{}", spectra::markdown(args.rows, args.cols, &comparisons));
    println!("{}", spectra::targets(&comparisons));
    Ok(())
}
