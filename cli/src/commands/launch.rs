//! `rankscope launch`: starts N local ranks of a command with exactly the
//! variables `torchrun` sets, waits for them, and stops them all when one fails
//! (as torchrun does). No rendezvous: for several nodes run it once per node with
//! `--nnodes`, `--node-rank` and the same `--master-addr`/`--master-port`.

use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

use anyhow::{Context, bail};

/// Launch local ranks the way torchrun does.
#[derive(clap::Args, Clone, Debug)]
#[command(after_help = "Examples:
  rankscope launch --nproc-per-node 4 -- python train.py
  rankscope launch --nproc-per-node 4 -- rankscope train --model mlp   # a build with libtorch
  rankscope launch --nnodes 2 --node-rank 1 --nproc-per-node 8 --master-addr node0 -- ./my_trainer

Each child gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_MAX_RESTARTS.")]
pub struct Args {
    /// Ranks on this node.
    #[arg(long, default_value_t = 1)]
    pub nproc_per_node: u32,
    /// Nodes in the job.
    #[arg(long, default_value_t = 1)]
    pub nnodes: u32,
    /// This node's index.
    #[arg(long, default_value_t = 0)]
    pub node_rank: u32,
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    #[arg(long, default_value_t = 29500)]
    pub master_port: u16,
    /// TORCHELASTIC_RUN_ID for every rank (the agent's default run id); a fresh
    /// one when not given.
    #[arg(long, value_parser = crate::run_id_arg::parse)]
    pub run_id: Option<String>,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// The environment of one rank, as torchrun sets it.
pub fn rank_env(args: &Args, local_rank: u32, run_id: &str) -> Vec<(&'static str, String)> {
    let world = args.nnodes * args.nproc_per_node;
    let rank = args.node_rank * args.nproc_per_node + local_rank;
    let mut env = vec![
        ("RANK", rank.to_string()),
        ("LOCAL_RANK", local_rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_WORLD_SIZE", args.nproc_per_node.to_string()),
        ("GROUP_RANK", args.node_rank.to_string()),
        ("GROUP_WORLD_SIZE", args.nnodes.to_string()),
        ("ROLE_RANK", rank.to_string()),
        ("ROLE_WORLD_SIZE", world.to_string()),
        ("ROLE_NAME", "default".into()),
        ("MASTER_ADDR", args.master_addr.clone()),
        ("MASTER_PORT", args.master_port.to_string()),
        ("TORCHELASTIC_RUN_ID", run_id.to_string()),
        ("TORCHELASTIC_RESTART_COUNT", "0".into()),
        ("TORCHELASTIC_MAX_RESTARTS", "0".into()),
    ];
    if args.nproc_per_node > 1 && std::env::var_os("OMP_NUM_THREADS").is_none() {
        env.push(("OMP_NUM_THREADS", "1".into()));
    }
    env
}

/// A fresh run id: the launch time, so every launch is its own run.
pub fn fresh_run_id() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    format!("run-{}-{:03}", now.as_secs(), now.subsec_millis())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let statuses = launch(&args, &[])?;
    if let Some(failed) = failure(&statuses) {
        bail!("{failed}");
    }
    Ok(())
}

/// Which local ranks failed, where some did: the first, and how many of all.
pub fn failure(statuses: &[ExitStatus]) -> Option<String> {
    let failed: Vec<_> = statuses
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.success())
        .collect();
    let (rank, status) = failed.first()?;
    Some(format!(
        "local rank {rank} failed ({status}); {} of {} ranks failed",
        failed.len(),
        statuses.len()
    ))
}

/// Starts every local rank with `extra_env` added, and waits for all of them.
pub fn launch(args: &Args, extra_env: &[(&str, String)]) -> anyhow::Result<Vec<ExitStatus>> {
    if args.nproc_per_node == 0 || args.nnodes == 0 {
        bail!("--nproc-per-node and --nnodes must be at least 1");
    }
    if args.node_rank >= args.nnodes {
        bail!(
            "--node-rank {} but --nnodes {}: the node rank must be below the node count",
            args.node_rank,
            args.nnodes
        );
    }
    let run_id = args.run_id.clone().unwrap_or_else(fresh_run_id);
    let (program, rest) = args
        .command
        .split_first()
        .context("no command to launch after --")?;
    let mut children: Vec<Child> = Vec::new();
    for local_rank in 0..args.nproc_per_node {
        let child = Command::new(program)
            .args(rest)
            .envs(rank_env(args, local_rank, &run_id))
            .envs(extra_env.iter().map(|(k, v)| (*k, v.as_str())))
            .spawn()
            .with_context(|| format!("cannot start {program:?} for local rank {local_rank}"));
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                for mut c in children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(e);
            }
        }
    }
    // Poll: when one rank fails, stop the others (torchrun's behaviour).
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; children.len()];
    loop {
        for (i, child) in children.iter_mut().enumerate() {
            if statuses[i].is_none() {
                statuses[i] = child.try_wait().context("waiting for a rank")?;
            }
        }
        if statuses.iter().any(|s| s.is_some_and(|s| !s.success())) {
            for (i, child) in children.iter_mut().enumerate() {
                if statuses[i].is_none() {
                    let _ = child.kill();
                    statuses[i] = child.wait().ok();
                }
            }
        }
        if statuses.iter().all(Option::is_some) {
            return Ok(statuses.into_iter().map(|s| s.expect("all done")).collect());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_follow_torchrun() {
        let args = Args {
            nproc_per_node: 4,
            nnodes: 2,
            node_rank: 1,
            master_addr: "n0".into(),
            master_port: 1234,
            run_id: None,
            command: vec!["x".into()],
        };
        let env = rank_env(&args, 2, "r");
        let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("RANK"), Some("6"));
        assert_eq!(get("LOCAL_RANK"), Some("2"));
        assert_eq!(get("WORLD_SIZE"), Some("8"));
        assert_eq!(get("LOCAL_WORLD_SIZE"), Some("4"));
        assert_eq!(get("GROUP_RANK"), Some("1"));
        assert_eq!(get("TORCHELASTIC_RUN_ID"), Some("r"));
    }
}
