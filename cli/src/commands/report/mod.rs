//! `rankscope report`: a run's answers in one self-contained HTML page and a
//! versioned JSON summary, from SQL over the collector's output directory. It
//! reads whatever files are committed, so it works while the run is going.
//!
//! Layout:
//! - `json_summary`: the JSON summary's schema and how it is built (SQL, the
//!   diagnoses, jumps);
//! - `plots`: the SVG charts (plotters);
//! - `html`: the page.

pub mod html;
pub mod json_summary;
pub mod plots;

use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::output_query::{Dataset, RunArgs};
pub use json_summary::Report;
use rankscope_collector::output::{DeltaRoot, Output};

/// Write a run's report: diagnoses, loss, step time, phases, memory, overhead,
/// layer dimensionality with jumps, and the model profile.
#[derive(clap::Args, Clone, Debug)]
#[command(
    after_help = "Without --html or --json, the page is written to OUT/report-<run>.html.

Examples:
  rankscope report rankscope-out                          # the latest run
  rankscope report rankscope-out --run-id run-1763790000-123 --html report.html
  rankscope report rankscope-out --json - | jq '.diagnoses[].kind'"
)]
pub struct Args {
    #[command(flatten)]
    pub input: RunArgs,
    /// Write the HTML page here.
    #[arg(long)]
    pub html: Option<PathBuf>,
    /// Write the JSON summary here (`-` for standard output).
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let out = args.input.out();
    let dataset = Dataset::open(&out)?;
    let (report, data) = build(&dataset, args.input.run_id.as_deref())?;
    let html_path = match (&args.html, &args.json) {
        (Some(p), _) => Some(p.clone()),
        (None, None) => Some(default_path(&out, &report.run.info.run_id)),
        (None, Some(_)) => None,
    };
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report)?;
        if path.as_os_str() == "-" {
            use std::io::Write;
            // A closed pipe (`| head`) ends the output, not the program.
            match writeln!(std::io::stdout().lock(), "{json}") {
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => return Err(e.into()),
                _ => {}
            }
        } else {
            write(path, &json)?;
            eprintln!("JSON summary: {}", path.display());
        }
    }
    if let Some(path) = html_path {
        write(&path, &html::page(&report, &data)?)?;
        for d in &report.diagnoses {
            eprintln!("{}: {}", d.evidence.kind(), d.message);
        }
        if report.diagnoses.is_empty() {
            eprintln!("no problem found");
        }
        println!("report: {}", path.display());
    }
    Ok(())
}

/// The report of `run` (the latest when `None`) and the rows it was made from.
pub fn build(
    dataset: &Dataset,
    run: Option<&str>,
) -> anyhow::Result<(Report, crate::analysis::diagnoses::RunData)> {
    let info = dataset.run(run)?;
    let data = dataset.run_data(&info.run_id)?;
    let report = json_summary::build(dataset, &info, &data)?;
    Ok((report, data))
}

/// Where the page goes when no path is given: into the output folder, or the
/// current directory for Delta tables on object storage.
pub fn default_path(out: &Path, run_id: &str) -> PathBuf {
    let page = format!("report-{run_id}.html");
    match out.to_str().and_then(|t| Output::parse(t).ok()) {
        Some(Output::Delta(DeltaRoot::Local(dir))) => dir.join(page),
        Some(Output::Delta(DeltaRoot::Url(_))) => PathBuf::from(page),
        _ => out.join(page),
    }
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the folder {}", dir.display()))?;
    }
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}
