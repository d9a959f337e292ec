//! `rankscope spectrum`: the metrics of a saved matrix, for activations dumped
//! with `numpy.save` and analysed offline. Same definitions as the agent, and the same
//! sketch: each sketched value with its error estimate (`<column>_err`), and the exact
//! path where the sketch cannot vouch for a value (`method` = `fallback`).

use std::path::PathBuf;

use anyhow::Context;
use rankscope_agent::config::{DEFAULT_SKETCH_THRESHOLD, SpectrumMode};
use rankscope_agent::sampling::{ConvLayout, MatrixOptions, SpectrumOptions};

/// Compute the dimensionality metrics of a .npy file.
#[derive(clap::Args, Clone, Debug)]
#[command(after_help = "Examples:
  rankscope spectrum activations.npy
  rankscope spectrum conv_out.npy --conv-layout flatten --center --json
  rankscope spectrum wide.npy --spectrum sketch")]
pub struct Args {
    /// A NumPy .npy file (float32/float64/int, C order, any rank: reshaped as the agent does).
    pub file: PathBuf,
    /// Subtract column means first (the `centered` column).
    #[arg(long = "center")]
    pub centered: bool,
    /// channelwise or flatten, for 4-D (B, C, H, W) arrays.
    #[arg(long, default_value = "channelwise")]
    pub conv_layout: String,
    /// Row cap (rows beyond it are sampled with a fixed seed).
    #[arg(long, default_value_t = 1_000_000)]
    pub max_rows: usize,
    /// auto, exact or sketch (RANKSCOPE_SPECTRUM): how the spectral columns are computed.
    #[arg(long, default_value = "auto")]
    pub spectrum: String,
    /// The smaller side from which auto sketches (RANKSCOPE_SKETCH_THRESHOLD).
    #[arg(long, default_value_t = DEFAULT_SKETCH_THRESHOLD)]
    pub sketch_threshold: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let conv_layout = ConvLayout::parse(&args.conv_layout).with_context(|| {
        format!(
            "--conv-layout {:?}: use channelwise or flatten",
            args.conv_layout
        )
    })?;
    if args.max_rows == 0 {
        anyhow::bail!("--max-rows 0: the row cap must be at least 1");
    }
    let mode = SpectrumMode::parse(&args.spectrum)
        .with_context(|| format!("--spectrum {:?}: use auto, exact or sketch", args.spectrum))?;
    let tensor = crate::npy_reader::read_npy(&args.file)?;
    let options = MatrixOptions {
        max_rows: args.max_rows,
        centered: args.centered,
        conv_layout,
        spectrum: SpectrumOptions {
            mode,
            sketch_threshold: args.sketch_threshold,
            ..SpectrumOptions::default()
        },
    };
    let m = rankscope_agent::torch::compute(&tensor, &options, 0);
    let fields: Vec<(&str, serde_json::Value)> = vec![
        ("file", args.file.display().to_string().into()),
        ("shape", tensor.size().into()),
        ("rows", m.rows.into()),
        ("cols", m.cols.into()),
        ("centered", m.centered.into()),
        ("conv_layout", m.conv_layout.into()),
        ("method", m.method.into()),
        ("stable_rank", m.spectral.stable_rank.into()),
        ("participation_ratio", m.spectral.participation_ratio.into()),
        (
            "participation_ratio_sv",
            m.spectral.participation_ratio_sv.into(),
        ),
        ("cum_energy_90", m.spectral.cum_energy_90.into()),
        ("nuclear_norm_ratio", m.spectral.nuclear_norm_ratio.into()),
        ("effective_rank", m.spectral.effective_rank.into()),
        ("stable_rank_err", m.errors.stable_rank.into()),
        (
            "participation_ratio_err",
            m.errors.participation_ratio.into(),
        ),
        (
            "participation_ratio_sv_err",
            m.errors.participation_ratio_sv.into(),
        ),
        ("cum_energy_90_err", m.errors.cum_energy_90.into()),
        ("nuclear_norm_ratio_err", m.errors.nuclear_norm_ratio.into()),
        ("effective_rank_err", m.errors.effective_rank.into()),
        ("mean", m.mean.into()),
        ("std", m.std.into()),
        ("zero_fraction", m.zero_fraction.into()),
        ("nonfinite", m.nonfinite.into()),
    ];
    if args.json {
        let map: serde_json::Map<String, serde_json::Value> = fields
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        println!("{}", serde_json::Value::Object(map));
    } else {
        for (k, v) in fields {
            let shown = match &v {
                serde_json::Value::Null if k.ends_with("_err") => "-".to_string(),
                serde_json::Value::Null
                    if m.errors.named().iter().any(|&(n, e)| n == k && !e.is_nan()) =>
                {
                    "null (the sketch cannot vouch for it; its error estimate is below)".to_string()
                }
                serde_json::Value::Null => "null (non-finite input)".to_string(),
                serde_json::Value::String(s) if s.is_empty() => "-".to_string(),
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            println!("{k:<26} {shown}");
        }
    }
    Ok(())
}
