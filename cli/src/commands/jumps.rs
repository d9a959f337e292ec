//! `rankscope jumps`: the jump detector on one series from a CSV file.

use std::path::{Path, PathBuf};

use crate::analysis::jumps::{self, Detection, JumpConfig};
use anyhow::Context;

/// Find jumps (sudden level shifts) in one series.
#[derive(clap::Args, Clone, Debug)]
#[command(
    after_help = "The file is CSV with the header `step,value`, one row per step, steps in increasing
order (gaps are fine: sampled layers come every N steps). A jump is reported at the first
step of the new level, with its size in units of the series' noise and a confidence; drift,
smooth curves and single-step spikes are not jumps. The method and its measured error rates
are in docs/metrics.md.

Examples:
  rankscope jumps stable_rank.csv
  rankscope jumps loss.csv --json | jq '.[].step'
  duckdb -csv -c \"select step, stable_rank as value from read_parquet('rankscope-out/layers/*/*.parquet')
    where run_id = 'RUN' and rank = 0 and layer = 'blocks.0.mlp.0' order by step\" > sr.csv
  rankscope jumps sr.csv

`rankscope summary` names a run's id and `layers` rows name their layers."
)]
pub struct Args {
    /// CSV file with the header `step,value`.
    pub file: PathBuf,
    /// Print a JSON list of jumps instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Points on each side of a boundary in the local fits.
    #[arg(long, default_value_t = JumpConfig::default().window)]
    pub window: usize,
    /// Expected false jumps per point on a series without any (sets the threshold).
    #[arg(long, default_value_t = JumpConfig::default().false_alarm_rate)]
    pub false_alarm_rate: f64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let config = JumpConfig {
        window: args.window,
        false_alarm_rate: args.false_alarm_rate,
        ..JumpConfig::default()
    };
    if config.window < config.min_side {
        anyhow::bail!(
            "--window {}: use at least {} points per side",
            config.window,
            config.min_side
        );
    }
    if !(config.false_alarm_rate > 0.0 && config.false_alarm_rate < 0.5) {
        anyhow::bail!(
            "--false-alarm-rate {}: use a rate between 0 and 0.5 (the default is 1e-4)",
            config.false_alarm_rate
        );
    }
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let points = parse_csv(&args.file, &text)?;
    if points.is_empty() {
        anyhow::bail!(
            "{} has no rows under its header: nothing to look for jumps in (did the query \
             select a run, rank and layer that exist?)",
            args.file.display()
        );
    }
    let detection = jumps::detect(&points, &config)
        .with_context(|| format!("{}: not a series", args.file.display()))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&detection.jumps)?);
    } else {
        print!("{}", table(&detection));
    }
    Ok(())
}

/// Reads `step,value` rows; every error names the line and what to do.
pub fn parse_csv(path: &Path, text: &str) -> anyhow::Result<Vec<(u64, f64)>> {
    let name = path.display();
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l));
    let header = lines
        .next()
        .map(|(_, l)| l.trim_start_matches('\u{feff}').trim())
        .unwrap_or("");
    let columns: Vec<&str> = header.split(',').map(str::trim).collect();
    if columns != ["step", "value"] {
        anyhow::bail!(
            "{name}: line 1 is {header:?}; the first line must be the header `step,value`"
        );
    }
    let mut points: Vec<(u64, f64)> = Vec::new();
    let mut previous_line = 0;
    for (number, line) in lines {
        if line.trim().is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let [step, value] = fields[..] else {
            anyhow::bail!(
                "{name}: line {number} has {} fields ({line:?}); each row is `step,value`",
                fields.len()
            );
        };
        let step: u64 = step.parse().map_err(|_| {
            anyhow::anyhow!(
                "{name}: line {number}: step {step:?} is not a whole number of 0 or more"
            )
        })?;
        let value: f64 = value.parse().map_err(|_| {
            anyhow::anyhow!("{name}: line {number}: value {value:?} is not a number")
        })?;
        if !value.is_finite() {
            anyhow::bail!(
                "{name}: line {number}: value {value} is not finite; drop the row or fix the series"
            );
        }
        if let Some(&(last, _)) = points.last() {
            if step == last {
                anyhow::bail!(
                    "{name}: line {number}: step {step} appears twice (lines {previous_line} and {number}); give one value per step (from one run, rank and layer)"
                );
            }
            if step < last {
                anyhow::bail!(
                    "{name}: line {number}: step {step} comes after step {last} (line {previous_line}); sort the rows by step"
                );
            }
        }
        points.push((step, value));
        previous_line = number;
    }
    Ok(points)
}

fn table(d: &Detection) -> String {
    let mut text = String::new();
    if !d.jumps.is_empty() {
        text += "     step  direction   size (noise units)   confidence           before            after\n";
    }
    for j in &d.jumps {
        text += &format!(
            "{:>9}  {:<9}   {:>18.1}   {:>10.4}   {:>14.6}   {:>14.6}\n",
            j.step, j.direction, j.size, j.confidence, j.before, j.after
        );
    }
    let found = match d.jumps.len() {
        0 => "no jumps".to_string(),
        1 => "1 jump".to_string(),
        n => format!("{n} jumps"),
    };
    text += &format!(
        "{found} in {} points (noise {:.6}, lag-1 correlation {:.2}, threshold |z| >= {:.2}, {} spike{} ignored)\n",
        d.points,
        d.noise,
        d.correlation,
        d.threshold_z,
        d.spikes,
        if d.spikes == 1 { "" } else { "s" }
    );
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<(u64, f64)>, String> {
        parse_csv(Path::new("s.csv"), text).map_err(|e| e.to_string())
    }

    #[test]
    fn reads_rows_and_names_bad_ones() {
        assert_eq!(
            parse("step,value\n1,2.5\n3,-1e3\n\n").unwrap(),
            vec![(1, 2.5), (3, -1000.0)]
        );
        assert_eq!(
            parse("\u{feff}step, value\r\n1,2\r\n").unwrap(),
            vec![(1, 2.0)]
        );
        assert!(parse("").unwrap_err().contains("header `step,value`"));
        assert!(parse("x,y\n1,2").unwrap_err().contains("line 1 is \"x,y\""));
        let e = parse("step,value\n1,2\n2,abc\n").unwrap_err();
        assert!(
            e.contains("line 3") && e.contains("\"abc\" is not a number"),
            "{e}"
        );
        assert!(
            parse("step,value\n1,nan\n")
                .unwrap_err()
                .contains("not finite")
        );
        assert!(
            parse("step,value\n-1,2\n")
                .unwrap_err()
                .contains("step \"-1\"")
        );
        assert!(
            parse("step,value\n1,2,3\n")
                .unwrap_err()
                .contains("3 fields")
        );
        let e = parse("step,value\n1,2\n1,3\n").unwrap_err();
        assert!(e.contains("appears twice (lines 2 and 3)"), "{e}");
        let e = parse("step,value\n5,2\n4,3\n").unwrap_err();
        assert!(e.contains("step 4 comes after step 5"), "{e}");
    }
}
