//! `rankscope bench collector`: the collector's throughput, memory and file size.
//!
//! The collector runs in a process of its own (this binary's `collector`
//! command), and so does the load (`loadgen`, or `train` ranks for the real-rows
//! run), as in production. For each run it reports:
//! - rows per second of collector CPU time (user + system, from `wait4` after a
//!   clean SIGTERM, so the final commit counts);
//! - the collector's peak RSS (`VmHWM`, read before it is stopped);
//! - Parquet bytes per `layers` row (every `layers` file, footers included).
//!
//! The runs: `--ranks` concurrent streams of `--layers` layers each, then
//! `--rss-ranks` streams for the memory bound, each twice, side by side: `layers`
//! as columns (this agent's format) and as rows (older agents' and their spill
//! files', `loadgen --layers-as-rows`); then a real training run
//! (`rankscope train`, a transformer on the CPU, sampling every step) for the
//! bytes of real `layers` rows, whose values are far less regular than
//! loadgen's. It prints a Markdown report.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};

/// Measure the collector (results for BENCHMARKS.md).
#[derive(clap::Args, Clone, Debug)]
#[command(after_help = "Examples:
  rankscope bench collector
  rankscope bench collector --ranks 256 --steps 400 --layers 48 --rss-ranks 1024
  rankscope bench collector --rss-ranks 0 --real-steps 0   # the throughput run only
  rankscope bench collector --collector-bin target/release/rankscope-collector
  rankscope bench collector --live-steps 0   # the collector without its live view, to compare
  rankscope bench collector --columns-only   # skip the row format's side-by-side runs")]
pub struct Args {
    /// Concurrent streams (simulated ranks) of the throughput run.
    #[arg(long, default_value_t = 256)]
    pub ranks: u32,
    /// Steps per simulated rank.
    #[arg(long, default_value_t = 200)]
    pub steps: u64,
    /// Layers per simulated rank (one `layers` row per layer per step).
    #[arg(long, default_value_t = 48)]
    pub layers: u32,
    /// Concurrent streams of the memory run (0: skip it).
    #[arg(long, default_value_t = 1024)]
    pub rss_ranks: u32,
    /// Steps per rank of the memory run.
    #[arg(long, default_value_t = 40)]
    pub rss_steps: u64,
    /// Steps of the real training run (0: skip it).
    #[arg(long, default_value_t = 1000)]
    pub real_steps: u64,
    /// The `rankscope` binary that runs the collector [default: this one]. Give
    /// the collector-only build (`make collector`), as deployed: a binary with
    /// libtorch linked starts with about 300 MiB more resident memory.
    #[arg(long)]
    pub collector_bin: Option<PathBuf>,
    /// The collector's memory bound, as `rankscope collector --max-memory-bytes`.
    #[arg(long, default_value_t = rankscope_collector::CollectorConfig::DEFAULT_MAX_MEMORY_BYTES)]
    pub max_memory_bytes: usize,
    /// The collector's `--live-steps` (0: the live view off). The collector
    /// serves `--http` on loopback, so the view is fed as in production.
    #[arg(long, default_value_t = rankscope_collector::live::DEFAULT_STEPS)]
    pub live_steps: usize,
    /// Run the loadgen loads with `layers` as columns only, without the
    /// side-by-side run of the row format.
    #[arg(long)]
    pub columns_only: bool,
}

/// What one run measured.
struct Measured {
    label: String,
    rows: u64,
    layers_rows: u64,
    wall_s: f64,
    collector_cpu_s: f64,
    load_cpu_s: f64,
    peak_rss_bytes: u64,
    layers_file_bytes: u64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    // The collector would refuse a bound it cannot work with: say so before any run.
    let mut config = rankscope_collector::CollectorConfig::new(".");
    config.max_memory_bytes = args.max_memory_bytes;
    config.live_steps = args.live_steps;
    config.check()?;
    let exe = std::env::current_exe().context("finding this binary to start the load")?;
    let collector_bin = match &args.collector_bin {
        Some(bin) if !bin.is_file() => bail!(
            "--collector-bin {}: no such file; build it with `make collector`",
            bin.display()
        ),
        Some(bin) => bin.clone(),
        None => exe.clone(),
    };
    let tmp = tempfile::tempdir().context("making a temporary output directory")?;
    let mut results = Vec::new();
    let loadgen = |ranks: u32, steps: u64| {
        let mut cmd = Command::new(&exe);
        cmd.args(["loadgen", "--run-id", "bench"])
            .args(["--ranks", &ranks.to_string()])
            .args(["--steps", &steps.to_string()])
            .args(["--layers", &args.layers.to_string()]);
        cmd
    };
    let sims = |ranks: u32, steps: u64| {
        let layers = ranks as u64 * steps * args.layers as u64;
        let rows = layers + ranks as u64 * (1 + args.layers as u64 + steps) + 1;
        (rows, layers)
    };
    let mut loads = vec![("throughput", args.ranks, args.steps)];
    if args.rss_ranks > 0 {
        loads.push(("memory", args.rss_ranks, args.rss_steps));
    }
    let formats: &[bool] = if args.columns_only {
        &[false]
    } else {
        &[false, true]
    };
    for (name, ranks, steps) in loads {
        for &as_rows in formats {
            let format = if as_rows { "rows" } else { "columns" };
            eprintln!(
                "{name}: {ranks} streams x {steps} steps x {} layers, layers as {format}",
                args.layers
            );
            let (rows, layers) = sims(ranks, steps);
            let mut load = loadgen(ranks, steps);
            if as_rows {
                load.arg("--layers-as-rows");
            }
            results.push(measure(
                &collector_bin,
                &tmp.path().join(format!("{name}-{format}")),
                format!("loadgen, {ranks} streams, layers as {format}"),
                &args,
                load,
                rows,
                layers,
            )?);
        }
    }
    if args.real_steps > 0 {
        eprintln!("real rows: 1 training rank x {} steps", args.real_steps);
        let mut train = Command::new(&exe);
        train
            .args(["train", "--model", "transformer", "--device", "cpu"])
            .args([
                "--steps",
                &args.real_steps.to_string(),
                "--sample-every",
                "1",
            ])
            .args(["--run-id", "bench-train"])
            .env("RANKSCOPE_OVERHEAD_BUDGET", "100%");
        // The row counts of a training run are what it sent, read back below.
        results.push(measure(
            &collector_bin,
            &tmp.path().join("real"),
            "rankscope train (transformer, every step)".into(),
            &args,
            train,
            0,
            0,
        )?);
    }
    print_report(&args, &results);
    Ok(())
}

/// Runs `load` against a fresh collector writing to `out`.
fn measure(
    collector_bin: &Path,
    out: &Path,
    label: String,
    args: &Args,
    mut load: Command,
    rows: u64,
    layers_rows: u64,
) -> anyhow::Result<Measured> {
    let (mut collector, addr) = start_collector(collector_bin, out, args)?;
    let started = Instant::now();
    let before = children_cpu_s();
    let status = load
        .arg("--collector")
        .arg(&addr)
        .env("RANKSCOPE_LOG", "error")
        .env("RANKSCOPE_SPILL_DIR", out.with_extension("spill"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .with_context(|| format!("starting the load of {label:?}"))?;
    let load_cpu_s = children_cpu_s() - before;
    let wall_s = started.elapsed().as_secs_f64();
    if !status.success() {
        let _ = collector.kill();
        bail!("the load of {label:?} failed ({status}): run it alone to see why");
    }
    let peak_rss_bytes = peak_rss(collector.id()).unwrap_or(0);
    // SIGTERM: the collector drains, makes its final commit and exits 0.
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(collector.id() as libc::pid_t, libc::SIGTERM) };
    let before = children_cpu_s();
    let exit = collector.wait().context("waiting for the collector")?;
    let collector_cpu_s = children_cpu_s() - before;
    if !exit.success() {
        bail!("the collector of {label:?} exited with {exit}");
    }
    let layers_file_bytes = parquet_bytes(&out.join("layers"))?;
    let (rows, layers_rows) = if rows == 0 {
        count_rows(out)?
    } else {
        (rows, layers_rows)
    };
    Ok(Measured {
        label,
        rows,
        layers_rows,
        wall_s,
        collector_cpu_s,
        load_cpu_s,
        peak_rss_bytes,
        layers_file_bytes,
    })
}

fn start_collector(exe: &Path, out: &Path, args: &Args) -> anyhow::Result<(Child, String)> {
    let mut child = Command::new(exe)
        .args(["collector", "--listen", "127.0.0.1:0", "--out"])
        .arg(out)
        .args(["--max-memory-bytes", &args.max_memory_bytes.to_string()])
        .args(["--http", "127.0.0.1:0"])
        .args(["--live-steps", &args.live_steps.to_string()])
        .env("RANKSCOPE_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting the collector")?;
    let stdout = child.stdout.take().context("the collector's stdout")?;
    let mut first = String::new();
    let mut reader = BufReader::new(stdout);
    reader
        .read_line(&mut first)
        .context("reading the collector's address")?;
    // Keep reading what it prints (its shutdown summary), so its stdout stays open.
    std::thread::spawn(move || std::io::copy(&mut reader, &mut std::io::sink()));
    let Some(addr) = first
        .split_whitespace()
        .find(|w| w.starts_with("127.0.0.1:"))
    else {
        let _ = child.kill();
        bail!("no address in the collector's first line: {first:?}");
    };
    Ok((child, addr.trim_end_matches([',', '.', ')']).to_string()))
}

/// User + system CPU seconds of every waited-for child so far.
fn children_cpu_s() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage);
        usage
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// `VmHWM` of a live process, in bytes.
fn peak_rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Bytes of every committed Parquet file under `dir`.
fn parquet_bytes(dir: &Path) -> anyhow::Result<u64> {
    Ok(parquet_files(dir)?
        .iter()
        .map(|f| f.metadata().map_or(0, |m| m.len()))
        .sum())
}

fn parquet_files(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    if !dir.exists() {
        return Ok(files);
    }
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            files.extend(parquet_files(&path)?);
        } else if path.extension().is_some_and(|e| e == "parquet") {
            files.push(path);
        }
    }
    Ok(files)
}

/// Rows of every table and of `layers`, from the files' footers.
fn count_rows(out: &Path) -> anyhow::Result<(u64, u64)> {
    let mut all = 0;
    let mut layers = 0;
    for table in rankscope_proto::Table::ALL {
        for file in parquet_files(&out.join(table.name()))? {
            let reader = parquet::file::reader::SerializedFileReader::new(
                std::fs::File::open(&file).with_context(|| format!("{}", file.display()))?,
            )
            .with_context(|| format!("reading {}", file.display()))?;
            use parquet::file::reader::FileReader;
            let n = reader.metadata().file_metadata().num_rows() as u64;
            all += n;
            if table == rankscope_proto::Table::Layers {
                layers += n;
            }
        }
    }
    Ok((all, layers))
}

fn print_report(args: &Args, results: &[Measured]) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let binary = args
        .collector_bin
        .as_ref()
        .map_or("this binary".to_string(), |b| b.display().to_string());
    println!(
        "\n`rankscope bench collector`: {} layers per rank, memory bound {} MiB, live view {}, \
         {cores} CPU(s); collector ({binary}) and load in separate processes on the same machine.\n",
        args.layers,
        args.max_memory_bytes >> 20,
        if args.live_steps == 0 {
            "off".to_string()
        } else {
            format!("{} steps per rank", args.live_steps)
        }
    );
    println!(
        "| load | rows | wall s | collector CPU s | rows / collector CPU s | load CPU s | collector peak RSS MiB | layers bytes / row |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for m in results {
        let per_row = if m.layers_rows > 0 {
            format!("{:.2}", m.layers_file_bytes as f64 / m.layers_rows as f64)
        } else {
            "-".into()
        };
        println!(
            "| {} | {} | {:.2} | {:.2} | {:.0} | {:.2} | {:.0} | {} |",
            m.label,
            m.rows,
            m.wall_s,
            m.collector_cpu_s,
            m.rows as f64 / m.collector_cpu_s.max(1e-9),
            m.load_cpu_s,
            m.peak_rss_bytes as f64 / (1 << 20) as f64,
            per_row
        );
    }
    // Each load's columns run against its rows run, measured in this run.
    for pair in results.windows(2) {
        let (columns, rows) = (&pair[0], &pair[1]);
        if let Some(load) = columns.label.strip_suffix(", layers as columns")
            && rows.label == format!("{load}, layers as rows")
        {
            let speed = |m: &Measured| m.rows as f64 / m.collector_cpu_s.max(1e-9);
            println!(
                "\n{load}: columns {:.2}x the rows per collector CPU second of rows",
                speed(columns) / speed(rows)
            );
        }
    }
    println!(
        "\nTargets: >= 2,000,000 rows per collector CPU second at 256 and at 1,024 streams; \
         peak RSS <= 512 MiB at 1,024 streams; <= 12 bytes per loadgen `layers` row."
    );
}
