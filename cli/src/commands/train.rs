//! `rankscope train`: example workloads on synthetic data, instrumented with the
//! agent. Each rank trains on its own shard (its own data seed). tch has no
//! gradient all-reduce, so these replicas do not synchronise: they show what the
//! agent records, not distributed training.

use std::time::Duration;

use anyhow::Context;
use rankscope_agent::Optimizer;
use rankscope_agent::config::{AgentConfig, OnConfigError};
use rankscope_agent::{Agent, Mode};
use tch::Device;
use tch::nn::{self, Module, OptimizerConfig};

use crate::example_models::{self, Workload};

/// Train an example model with the agent attached.
#[derive(clap::Args, Clone, Debug)]
#[command(after_help = "Examples:
  rankscope train --model mlp --steps 200
  RANKSCOPE_COLLECTOR=127.0.0.1:50051 rankscope launch --nproc-per-node 4 -- rankscope train --model cnn
  torchrun --no-python --nproc-per-node 2 rankscope train --model transformer

Rank identity comes from torchrun's or SLURM's variables; agent settings from
RANKSCOPE_* variables, which the flags below override.")]
pub struct Args {
    /// The workload: mlp (seed 000's 5-D regression MLP, 8,769 parameters), cnn or transformer.
    #[arg(long, value_enum, default_value_t = Workload::Mlp)]
    pub model: Workload,
    /// Training steps.
    #[arg(long, default_value_t = 200)]
    pub steps: u64,
    /// Examples per step on this rank.
    #[arg(long, default_value_t = 64)]
    pub batch_size: i64,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Base seed; each rank adds its rank to it for its data shard.
    #[arg(long, default_value_t = 0)]
    pub seed: i64,
    /// cpu, cuda, or auto (cuda:LOCAL_RANK when CUDA is available).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Overrides RANKSCOPE_COLLECTOR.
    #[arg(long)]
    pub collector: Option<String>,
    /// Overrides RANKSCOPE_RUN_ID.
    #[arg(long)]
    pub run_id: Option<String>,
    /// Overrides RANKSCOPE_MODE: full, rank0, steps or off.
    #[arg(long, value_parser = parse_mode)]
    pub mode: Option<Mode>,
    /// Overrides RANKSCOPE_SAMPLE_EVERY.
    #[arg(long)]
    pub sample_every: Option<u64>,
    /// How long to wait at the end for the collector to acknowledge everything.
    #[arg(long, default_value = "20s", value_parser = crate::duration_arg::parse)]
    pub finish_timeout: Duration,
    /// Run with the agent disabled (and a logged error) if its configuration is wrong.
    #[arg(long)]
    pub disable_on_config_error: bool,
}

fn parse_mode(text: &str) -> Result<Mode, String> {
    Mode::parse(text)
        .ok_or_else(|| format!("{text:?} is not a mode: use full, rank0, steps or off"))
}

/// The agent for `args`: flags > environment > defaults.
pub fn agent(args: &Args) -> anyhow::Result<Agent> {
    let mut builder = AgentConfig::builder()
        .finish_timeout(args.finish_timeout)
        .workload(args.model.name());
    if let Some(c) = &args.collector {
        builder = builder.collector(c.clone());
    }
    if let Some(r) = &args.run_id {
        builder = builder.run_id(r.clone());
    }
    if let Some(m) = args.mode {
        builder = builder.mode(m);
    }
    if let Some(n) = args.sample_every {
        builder = builder.sample_every(n);
    }
    if args.disable_on_config_error {
        builder = builder.on_config_error(OnConfigError::Disable);
    }
    let agent = Agent::from_builder(builder).context("rankscope agent configuration is wrong")?;
    agent.use_libtorch_memory();
    Ok(agent)
}

fn device(spec: &str, local_rank: u32) -> anyhow::Result<Device> {
    match spec {
        "cpu" => Ok(Device::Cpu),
        "cuda" if !tch::Cuda::is_available() => {
            anyhow::bail!("--device cuda but CUDA is not available here: use --device cpu or auto")
        }
        "cuda" | "auto" if tch::Cuda::is_available() => Ok(Device::Cuda(
            local_rank as usize % tch::Cuda::device_count().max(1) as usize,
        )),
        "auto" => Ok(Device::Cpu),
        other => anyhow::bail!("--device {other:?}: use cpu, cuda or auto"),
    }
}

/// What one rank did.
#[derive(Debug)]
pub struct TrainSummary {
    pub rank: u32,
    pub steps: u64,
    pub final_loss: f64,
    pub report: rankscope_agent::FinishReport,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let agent = agent(&args)?;
    let summary = train(&args, &agent)?;
    println!(
        "rank {}: {} steps, final loss {:.4}, telemetry: {} rows queued, {} acknowledged, {} dropped, {} unacknowledged",
        summary.rank,
        summary.steps,
        summary.final_loss,
        summary.report.rows_queued,
        summary.report.rows_acked,
        summary.report.rows_dropped,
        summary.report.rows_unacked
    );
    if let Some(dir) = summary
        .report
        .rank_spill_dir
        .as_ref()
        .filter(|_| summary.report.rows_spilled > 0)
    {
        println!(
            "rank {}: {} rows wait in {}; they are sent when this rank runs again under the same run id, or by `rankscope replay`",
            summary.rank,
            summary.report.rows_spilled,
            dir.display()
        );
    }
    Ok(())
}

/// Trains with `agent` attached; returns after `agent.finish()`.
pub fn train(args: &Args, agent: &Agent) -> anyhow::Result<TrainSummary> {
    // The rank identity even when the agent is inert (rank0 mode on rank 1).
    let identity = AgentConfig::builder()
        .mode(Mode::Off)
        .build()
        .unwrap_or_else(|_| {
            AgentConfig::builder()
                .build_with(|_| None)
                .expect("defaults")
        });
    let rank = identity.rank;
    tch::manual_seed(args.seed + rank as i64);
    let device = device(&args.device, identity.local_rank)?;
    let vs = nn::VarStore::new(device);
    let model = example_models::build(args.model, &vs.root(), agent);
    let mut opt = nn::AdamW::default()
        .build(&vs, args.lr)
        .context("building the AdamW optimizer")?;
    let mut data =
        example_models::Data::new(args.model, args.seed + 1000 * (rank as i64 + 1), device);
    let probe = data.batch(args.batch_size).0;
    agent.profile_model(&vs, Optimizer::Adam, || {
        let _ = model.forward(&probe);
    });

    let bar = if rank == 0 {
        let bar = indicatif::ProgressBar::new(args.steps);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{prefix} {bar:40} {pos}/{len} steps, loss {msg} {eta}",
            )
            .expect("valid template"),
        );
        bar.set_prefix(format!("rank 0/{}", identity.world_size));
        bar
    } else {
        indicatif::ProgressBar::hidden()
    };
    let mut final_loss = f64::NAN;
    for step in 0..args.steps {
        let s = agent.step(step);
        final_loss = example_models::train_step(
            args.model,
            &model,
            &vs,
            &mut opt,
            &mut data,
            args.batch_size,
            &s,
        );
        s.lr(args.lr);
        s.samples(args.batch_size as u64);
        drop(s);
        bar.inc(1);
        if step % 10 == 0 {
            bar.set_message(format!("{final_loss:.4}"));
        }
    }
    bar.finish_and_clear();
    let report = agent.finish();
    Ok(TrainSummary {
        rank,
        steps: args.steps,
        final_loss,
        report,
    })
}
