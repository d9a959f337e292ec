//! The rank environment: which process this is (torchrun's variables, else SLURM's,
//! else a single process) and which run it belongs to (the run id and its
//! fallbacks). It imports the variable names, their number parser and [`ConfigError`].

use super::error::ConfigError;
use super::parse::number;
use super::variables::*;

/// A process's place in the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct RankIdentity {
    pub rank: u32,
    pub local_rank: u32,
    pub world_size: u32,
    pub local_world_size: u32,
    pub node_rank: u32,
}

/// Values set in code win over the environment.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RankOverrides {
    pub rank: Option<u32>,
    pub local_rank: Option<u32>,
    pub world_size: Option<u32>,
    pub node_rank: Option<u32>,
}

/// The rank identity from `overrides`, then the launcher's variables, then rank 0 of 1.
/// Inconsistent values (a rank without a world size, a rank past it) are errors.
pub(super) fn rank_identity(
    env: &impl Fn(&str) -> Option<String>,
    overrides: RankOverrides,
) -> Result<RankIdentity, ConfigError> {
    let rank_hint = "it is the process's rank (0, 1, ...), set by the launcher";
    let size_hint = "it is the number of processes, set by the launcher";

    // Rank identity: torchrun's variables, else SLURM's, else a single process.
    let (rank_var, size_var) = if env(RANK).is_some() || env(WORLD_SIZE).is_some() {
        (RANK, WORLD_SIZE)
    } else {
        (SLURM_PROCID, SLURM_NTASKS)
    };
    let torchrun = rank_var == RANK;
    let env_rank = number(env, rank_var, rank_hint)?;
    let env_size = number(env, size_var, size_hint)?;
    match (env_rank, env_size) {
        (Some(_), None) => {
            return Err(ConfigError::Incomplete {
                set: rank_var,
                missing: size_var,
            });
        }
        (None, Some(_)) => {
            return Err(ConfigError::Incomplete {
                set: size_var,
                missing: rank_var,
            });
        }
        _ => {}
    }
    let (local_rank_var, local_size_var, node_var) = if torchrun {
        (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK)
    } else {
        (SLURM_LOCALID, "SLURM_NTASKS_PER_NODE", SLURM_NODEID)
    };
    let rank = overrides.rank.or(env_rank).unwrap_or(0);
    let world_size = overrides.world_size.or(env_size).unwrap_or(1);
    if world_size == 0 {
        return Err(ConfigError::ZeroWorldSize { var: size_var });
    }
    if rank >= world_size {
        return Err(ConfigError::RankOutOfRange {
            rank_var,
            rank,
            size_var,
            size: world_size,
        });
    }
    let local_rank = overrides
        .local_rank
        .or(number(env, local_rank_var, rank_hint)?)
        .unwrap_or(rank);
    let local_world_size = if torchrun {
        number(env, local_size_var, size_hint)?
    } else {
        None
    }
    .unwrap_or(world_size);
    if local_rank >= local_world_size {
        return Err(ConfigError::RankOutOfRange {
            rank_var: local_rank_var,
            rank: local_rank,
            size_var: if torchrun { local_size_var } else { size_var },
            size: local_world_size,
        });
    }
    let node_rank = overrides
        .node_rank
        .or(number(env, node_var, rank_hint)?)
        .unwrap_or(rank / local_world_size.max(1));
    Ok(RankIdentity {
        rank,
        local_rank,
        world_size,
        local_world_size,
        node_rank,
    })
}

/// The run id: `given` (code or `RANKSCOPE_RUN_ID`), else a launcher's (see
/// [`super::AgentConfig::run_id`]); an id the collector would refuse is an error.
pub(super) fn run_id(
    given: Option<String>,
    env: &impl Fn(&str) -> Option<String>,
    world_size: u32,
) -> Result<String, ConfigError> {
    let run_id = match given {
        Some(id) => id,
        None => default_run_id(env, world_size),
    };
    if !rankscope_proto::is_valid_run_id(&run_id) {
        return Err(ConfigError::RunId(run_id));
    }
    Ok(run_id)
}

fn default_run_id(env: &impl Fn(&str) -> Option<String>, world_size: u32) -> String {
    if let Some(id) = env(TORCHELASTIC_RUN_ID).filter(|id| id != "none") {
        return sanitize(&id);
    }
    if let Some(job) = env(SLURM_JOB_ID) {
        return sanitize(&format!("slurm-{job}"));
    }
    if world_size > 1
        && let (Some(addr), Some(port)) = (env(MASTER_ADDR), env(MASTER_PORT))
    {
        tracing::warn!(
            "no run id given: using job-{addr}-{port}; set {RANKSCOPE_RUN_ID} to tell runs apart"
        );
        return sanitize(&format!("job-{addr}-{port}"));
    }
    format!("local-{}", std::process::id())
}

/// Replaces what a run id may not contain, so launcher-made ids always work.
fn sanitize(id: &str) -> String {
    let mut s: String = id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.') {
                c
            } else {
                '-'
            }
        })
        .take(124)
        .collect();
    // Not a leading separator, no `..`, and not all digits (DuckDB would read an
    // all-digit `run_id=` partition as a number).
    s = s.replace("..", "-");
    if !s.starts_with(|c: char| c.is_ascii_alphanumeric()) || s.bytes().all(|b| b.is_ascii_digit())
    {
        s.insert_str(0, "run-");
        s.truncate(128);
    }
    s
}
