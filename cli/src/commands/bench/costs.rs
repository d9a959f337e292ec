//! `rankscope bench`'s single-operation costs: the training thread's cost of a
//! non-sampled observe and step, of handing off a sample, the worker's cost of
//! one sample, and the agent's start-up with 200 taps. Each runs its own agent,
//! streaming to the bench's collector, with every planned sample taken.

use std::time::{Duration, Instant};

use rankscope_agent::Agent;
use rankscope_agent::Phase;
use rankscope_agent::config::{AgentConfig, OverheadBudget};
use rankscope_agent::sampling::{self, MatrixOptions};
use tch::nn;
use tch::{Device, Tensor};

fn agent_for(addr: &str, sample_every: u64) -> anyhow::Result<Agent> {
    let config = AgentConfig::builder()
        .collector(addr.to_string())
        .run_id("bench-cost")
        .sample_every(sample_every)
        // These time single operations: every planned sample is taken.
        .overhead_budget(OverheadBudget::from_percent(100.0).unwrap_or_default())
        .rank(0u32)
        .world_size(1u32)
        .finish_timeout(Duration::from_secs(5))
        .build_with(|_| None)?;
    Ok(Agent::new(config))
}

/// Nanoseconds per observe call on a step that is not sampled.
pub(super) fn non_sampled_observe(addr: &str) -> anyhow::Result<f64> {
    let agent = agent_for(addr, u64::MAX)?;
    let t = Tensor::ones([32, 64], tch::kind::FLOAT_CPU);
    let s = agent.step(1);
    let n = 1_000_000u32;
    let started = Instant::now();
    for _ in 0..n {
        agent.observe(std::hint::black_box("fc1"), std::hint::black_box(&t));
    }
    let ns = started.elapsed().as_nanos() as f64 / n as f64;
    drop(s);
    agent.finish();
    Ok(ns)
}

/// Nanoseconds per whole non-sampled step guard with four phases.
pub(super) fn non_sampled_step(addr: &str) -> anyhow::Result<f64> {
    let agent = agent_for(addr, u64::MAX)?;
    let steps = 20_000u64;
    let started = Instant::now();
    for i in 1..=steps {
        let s = agent.step(i);
        for phase in [
            Phase::Data,
            Phase::Forward,
            Phase::Backward,
            Phase::Optimizer,
        ] {
            let _p = s.phase(phase);
        }
    }
    let ns = started.elapsed().as_nanos() as f64 / steps as f64;
    agent.finish();
    Ok(ns)
}

/// (training-thread µs per sampled observe, worker ms per sample, the shape), for
/// the transformer's activation: batch 64 × 16 tokens × 64 features.
pub(super) fn sampled_cost(addr: &str) -> anyhow::Result<(f64, f64, String)> {
    let activation = Tensor::randn([64, 16, 64], tch::kind::FLOAT_CPU);
    let agent = agent_for(addr, 1)?;
    let mut handoff = Vec::new();
    for step in 0..50u64 {
        let s = agent.step(step);
        for layer in ["a", "b", "c", "d"] {
            let started = Instant::now();
            agent.observe(layer, &activation);
            handoff.push(started.elapsed().as_secs_f64() * 1e6);
        }
        drop(s);
        // Let the worker drain, so every observe finds room in its queue.
        std::thread::sleep(Duration::from_millis(20));
    }
    agent.finish();

    let options = MatrixOptions {
        max_rows: rankscope_agent::config::DEFAULT_MAX_ROWS,
        centered: false,
        conv_layout: sampling::ConvLayout::default(),
        spectrum: sampling::SpectrumOptions::default(),
    };
    let compute = std::thread::spawn(move || {
        let mut ms = Vec::new();
        for _ in 0..50 {
            let started = Instant::now();
            std::hint::black_box(rankscope_agent::torch::compute(&activation, &options, 0));
            ms.push(started.elapsed().as_secs_f64() * 1e3);
        }
        median(&ms)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the metrics thread panicked"))?;
    Ok((median(&handoff), compute, "64x16x64".into()))
}

/// Milliseconds to start an agent and wrap 200 layers.
pub(super) fn init_cost(addr: &str) -> anyhow::Result<f64> {
    let vs = nn::VarStore::new(Device::Cpu);
    let layers: Vec<nn::Linear> = (0..200)
        .map(|i| nn::linear(vs.root() / format!("l{i}"), 8, 8, Default::default()))
        .collect();
    let started = Instant::now();
    let agent = agent_for(addr, 10)?;
    let taps: Vec<_> = layers
        .into_iter()
        .enumerate()
        .map(|(i, l)| agent.tap(&format!("l{i}"), l))
        .collect();
    let ms = started.elapsed().as_secs_f64() * 1e3;
    drop(taps);
    agent.finish();
    Ok(ms)
}

/// The upper median of `v` (NaN when empty): the figure every table of `bench` reports.
pub(super) fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}
