//! `rankscope loadgen`: simulated ranks that speak the real protocol through the
//! real agent transport, one thread each, with realistic values.

use std::time::Duration;

use anyhow::bail;
use rand::{Rng, SeedableRng};
use rankscope_agent::config::CollectorList;
use rankscope_agent::{FinishReport, Row, Transport, TransportConfig, now_us};
use rankscope_proto::v1::{Hello, LayerRow, ModelRow, RankRow, RecordingMode, RunRow, StepRow};

/// Simulate training ranks streaming to a collector.
#[derive(clap::Args, Clone)]
#[command(after_help = "Examples:
  rankscope loadgen --ranks 8 --steps 200 --layers 12 --collector 127.0.0.1:50051
  rankscope loadgen --ranks 64 --steps 1000 --layers 48 --run-id load-1 --step-interval 0ms
  rankscope loadgen --ranks 8 --collector 127.0.0.1:50051,127.0.0.1:50052

Each rank sends, exactly: 1 ranks row, `layers` model rows, `steps` steps rows and
steps x layers layers rows; rank 0 also sends 1 runs row. Exits non-zero if any row
was not acknowledged as durable. With a comma-separated list of collectors, rank r
sends to entry r % len, as training ranks do. For a TLS collector, give https://HOST:PORT and set
RANKSCOPE_TLS_CA (and RANKSCOPE_TLS_CERT / RANKSCOPE_TLS_KEY for mutual TLS).")]
pub struct Args {
    /// Number of simulated ranks.
    #[arg(long, default_value_t = 4)]
    pub ranks: u32,
    /// Steps per rank.
    #[arg(long, default_value_t = 100)]
    pub steps: u64,
    /// Layers per rank (one layers row per layer per step).
    #[arg(long, default_value_t = 8)]
    pub layers: u32,
    /// Collector address, or a comma-separated list (rank r sends to entry r % len).
    #[arg(long, default_value = "127.0.0.1:50051", env = "RANKSCOPE_COLLECTOR")]
    pub collector: String,
    /// Run id.
    #[arg(long, default_value = "loadgen", value_parser = crate::run_id_arg::parse)]
    pub run_id: String,
    /// Pause between steps of one rank.
    #[arg(long, default_value = "0ms", value_parser = crate::duration_arg::parse)]
    pub step_interval: Duration,
    /// Bearer token, if the collector requires one.
    #[arg(long, env = "RANKSCOPE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// How long each rank waits at the end for its rows to become durable.
    #[arg(long, default_value = "60s", value_parser = crate::duration_arg::parse)]
    pub finish_timeout: Duration,
    /// Send `layers` as rows, as agents before schema minor 3 do, instead of as
    /// columns (to compare the two formats).
    #[arg(long)]
    pub layers_as_rows: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.ranks == 0 {
        bail!("--ranks 0: simulate at least one rank");
    }
    let collectors = CollectorList::parse("--collector", &args.collector)?;
    // Read once for every simulated rank.
    let tls = rankscope_agent::config::client_tls_from_env()?;
    let bar = indicatif::ProgressBar::new(args.ranks as u64 * args.steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} steps {per_sec} {eta}")
            .expect("valid template"),
    );
    let reports: Vec<anyhow::Result<FinishReport>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..args.ranks)
            .map(|rank| {
                let (args, bar, tls) = (&args, &bar, &tls);
                let collector = collectors.for_rank(rank);
                scope.spawn(move || simulate_rank(args, rank, collector, tls.clone(), bar))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| bail!("rank thread panicked")))
            .collect()
    });
    bar.finish_and_clear();
    let mut incomplete = 0;
    let mut total = FinishReport::default();
    for (rank, report) in reports.into_iter().enumerate() {
        let report = report?;
        if !report.complete() {
            incomplete += 1;
            eprintln!("rank {rank}: {report:?}");
        }
        total.rows_queued += report.rows_queued;
        total.rows_acked += report.rows_acked;
        total.rows_dropped += report.rows_dropped;
        total.rows_unacked += report.rows_unacked;
    }
    println!(
        "loadgen: {} ranks, {} rows queued, {} acknowledged, {} dropped, {} unacknowledged",
        args.ranks, total.rows_queued, total.rows_acked, total.rows_dropped, total.rows_unacked
    );
    if incomplete > 0 {
        bail!(
            "{incomplete} of {} ranks did not get every row acknowledged by {}: is the collector running?",
            args.ranks,
            args.collector
        );
    }
    Ok(())
}

fn simulate_rank(
    args: &Args,
    rank: u32,
    collector: &str,
    tls: Option<rankscope_agent::ClientTls>,
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<FinishReport> {
    let started_at = now_us();
    let hello = Hello {
        run_id: args.run_id.clone(),
        rank,
        local_rank: rank % 8,
        node_rank: rank / 8,
        world_size: args.ranks,
        hostname: format!("loadgen-node{}", rank / 8),
        pid: std::process::id(),
        mode: RecordingMode::Full as i32,
        agent_version: env!("CARGO_PKG_VERSION").into(),
        schema_major: rankscope_proto::SCHEMA_MAJOR,
        schema_minor: rankscope_proto::SCHEMA_MINOR,
        started_at,
    };
    let mut config = TransportConfig::new(collector);
    config.token = args.token.clone();
    config.tls = tls;
    config.layer_columns = !args.layers_as_rows;
    let transport = Transport::start(config, hello.clone())?;
    // A simulated rank produces rows far faster than a real one: it waits for room
    // in the queue instead of dropping, so the row counts stay exact.
    let send = |row: Row| {
        let mut row = row;
        while let Err(back) = transport.try_send(row) {
            row = back;
            std::thread::sleep(Duration::from_micros(200));
        }
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(rank as u64);
    if rank == 0 {
        send(Row::Run(RunRow {
            started_at,
            world_size: args.ranks,
            mode: RecordingMode::Full as i32,
            sample_every: 1,
            max_rows: 4096,
            centered: false,
            layer_filter: String::new(),
            agent_version: env!("CARGO_PKG_VERSION").into(),
            workload: "loadgen".into(),
            overhead_budget: None,
        }));
    }
    let width = 1024u64;
    for layer in 0..args.layers {
        send(Row::Model(ModelRow {
            layer: layer_name(layer),
            kind: "linear".into(),
            params: width * width + width,
            param_bytes: 4 * (width * width + width),
            grad_bytes: 4 * (width * width + width),
            optimizer_bytes: 8 * (width * width + width),
            forward_flops: 2 * 256 * width * width,
            output_shape: format!("[256, {width}]"),
        }));
    }
    for step in 0..args.steps {
        let progress = step as f64 / args.steps.max(1) as f64;
        let step_ms = 95.0 + rng.random_range(0.0..10.0) + if rank == 3 { 8.0 } else { 0.0 };
        send(Row::Step(StepRow {
            step,
            time: now_us(),
            step_ms,
            data_ms: Some(step_ms * 0.08),
            forward_ms: Some(step_ms * 0.3),
            backward_ms: Some(step_ms * 0.5),
            optimizer_ms: Some(step_ms * 0.1),
            loss: Some(2.5 * (-3.0 * progress).exp() + rng.random_range(0.0..0.05)),
            grad_norm: Some(1.0 + rng.random_range(0.0..0.5)),
            // Rank 3 is the straggler: the others wait for it in the all-reduce.
            comm_ms: Some(rng.random_range(0.5..1.5) + if rank == 3 { 0.0 } else { 8.0 }),
            lr: Some(3e-4),
            samples: Some(256),
            overhead_ms: 0.02,
            overhead_device_ms: Some(0.05),
            overhead_observed_ms: None,
            rss_bytes: Some(4 << 30),
            device_allocated_bytes: Some(20 << 30),
            device_reserved_bytes: Some(24 << 30),
            device_peak_bytes: Some(22 << 30),
        }));
        for layer in 0..args.layers {
            let depth = layer as f64 / args.layers.max(1) as f64;
            let stable = 4.0 + 20.0 * (1.0 - depth) * (1.0 - 0.5 * progress);
            send(Row::Layer(LayerRow {
                step,
                time: now_us(),
                layer: layer_name(layer),
                rows: 256,
                cols: width as u32,
                centered: false,
                stable_rank: Some(stable),
                participation_ratio: Some(stable * 1.6),
                participation_ratio_sv: Some(stable * 4.0),
                cum_energy_90: Some((stable * 6.0) as u32),
                nuclear_norm_ratio: Some(stable * 3.0),
                effective_rank: Some(stable * 8.0),
                mean: Some(0.01),
                std: Some(1.0 - 0.3 * depth),
                zero_fraction: Some(0.0),
                nonfinite: 0,
                compute_ms: 1.5 + rng.random_range(0.0..0.5),
                conv_layout: String::new(),
                method: "exact".into(),
                stable_rank_err: None,
                participation_ratio_err: None,
                participation_ratio_sv_err: None,
                cum_energy_90_err: None,
                nuclear_norm_ratio_err: None,
                effective_rank_err: None,
            }));
        }
        bar.inc(1);
        if !args.step_interval.is_zero() {
            std::thread::sleep(args.step_interval);
        }
    }
    let rank_row = Row::Rank(RankRow::from_hello(&hello, Some(now_us())));
    Ok(transport.finish(vec![rank_row], args.finish_timeout))
}

fn layer_name(layer: u32) -> String {
    format!("blocks.{layer}.mlp")
}
