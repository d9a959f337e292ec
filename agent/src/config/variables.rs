//! The variables the agent reads, by name, and their defaults. It imports only the
//! transport's defaults, which it re-exports.

use std::path::PathBuf;
use std::time::Duration;

pub use crate::transport::{DEFAULT_QUEUE_ROWS, DEFAULT_SPILL_MAX_BYTES};

pub const RANK: &str = "RANK";
pub const LOCAL_RANK: &str = "LOCAL_RANK";
pub const WORLD_SIZE: &str = "WORLD_SIZE";
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
pub const GROUP_RANK: &str = "GROUP_RANK";
pub const MASTER_ADDR: &str = "MASTER_ADDR";
pub const MASTER_PORT: &str = "MASTER_PORT";
pub const TORCHELASTIC_RUN_ID: &str = "TORCHELASTIC_RUN_ID";
pub const SLURM_PROCID: &str = "SLURM_PROCID";
pub const SLURM_LOCALID: &str = "SLURM_LOCALID";
pub const SLURM_NTASKS: &str = "SLURM_NTASKS";
pub const SLURM_NODEID: &str = "SLURM_NODEID";
pub const SLURM_JOB_ID: &str = "SLURM_JOB_ID";
pub const RANKSCOPE_COLLECTOR: &str = "RANKSCOPE_COLLECTOR";
pub const RANKSCOPE_RUN_ID: &str = "RANKSCOPE_RUN_ID";
pub const RANKSCOPE_MODE: &str = "RANKSCOPE_MODE";
pub const RANKSCOPE_SAMPLE_EVERY: &str = "RANKSCOPE_SAMPLE_EVERY";
pub const RANKSCOPE_LAYERS: &str = "RANKSCOPE_LAYERS";
pub const RANKSCOPE_MAX_ROWS: &str = "RANKSCOPE_MAX_ROWS";
pub const RANKSCOPE_CENTER: &str = "RANKSCOPE_CENTER";
pub const RANKSCOPE_CONV_LAYOUT: &str = "RANKSCOPE_CONV_LAYOUT";
pub const RANKSCOPE_SPECTRUM: &str = "RANKSCOPE_SPECTRUM";
pub const RANKSCOPE_SKETCH_THRESHOLD: &str = "RANKSCOPE_SKETCH_THRESHOLD";
pub const RANKSCOPE_METRICS_THREADS: &str = "RANKSCOPE_METRICS_THREADS";
pub const RANKSCOPE_ON_CONFIG_ERROR: &str = "RANKSCOPE_ON_CONFIG_ERROR";
pub const RANKSCOPE_TOKEN: &str = "RANKSCOPE_TOKEN";
pub const RANKSCOPE_SPILL_DIR: &str = "RANKSCOPE_SPILL_DIR";
pub const RANKSCOPE_OVERHEAD_BUDGET: &str = "RANKSCOPE_OVERHEAD_BUDGET";
/// No longer read: an error that points to [`RANKSCOPE_OVERHEAD_BUDGET`].
pub const RANKSCOPE_WORKER_PRIORITY: &str = "RANKSCOPE_WORKER_PRIORITY";
pub const RANKSCOPE_TLS_CA: &str = "RANKSCOPE_TLS_CA";
pub const RANKSCOPE_TLS_CERT: &str = "RANKSCOPE_TLS_CERT";
pub const RANKSCOPE_TLS_KEY: &str = "RANKSCOPE_TLS_KEY";
pub const RANKSCOPE_TLS_DOMAIN: &str = "RANKSCOPE_TLS_DOMAIN";
pub const RANKSCOPE_SPILL_MAX_BYTES: &str = "RANKSCOPE_SPILL_MAX_BYTES";

pub const DEFAULT_COLLECTOR: &str = "127.0.0.1:50051";
pub const DEFAULT_SAMPLE_EVERY: u64 = 10;
pub const DEFAULT_MAX_ROWS: usize = 4096;
/// `auto` sketches a matrix with at least this many rows and columns: there the exact
/// path costs over a second of CPU (`docs/metrics.md`, "Sketch mode").
pub const DEFAULT_SKETCH_THRESHOLD: usize = 1536;
/// The same where a device runs the sketch's Krylov process (the Python package on a
/// GPU) and the host only analyses it: there the exact path's float64 eigen-solve at a
/// side of 1,024 (74 ms of host CPU on an H200 machine) is 20 times the analysis, and
/// a GPT's 1,024-wide layers sampled every 10 steps would outrun the metrics thread
/// (`docs/metrics.md`, "Method"). `RANKSCOPE_SKETCH_THRESHOLD` sets both.
pub const DEFAULT_DEVICE_SKETCH_THRESHOLD: usize = 1024;
/// Metrics threads: one, the CPU-share budget's unit. More measure more samples at once
/// where a rank has cores to spare (a GPU job); the budget holds their CPU time together.
pub const DEFAULT_METRICS_THREADS: usize = 1;
/// The most metrics threads a rank may ask for.
pub const MAX_METRICS_THREADS: usize = 64;
pub const DEFAULT_FINISH_TIMEOUT: Duration = Duration::from_secs(10);

/// The default spill root: `rankscope-spill-$USER` in the temporary directory (one
/// per user, so users of a shared node never collide).
pub fn default_spill_dir() -> PathBuf {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .ok()
        .filter(|u| {
            !u.is_empty()
                && u.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        });
    match user {
        Some(user) => std::env::temp_dir().join(format!("rankscope-spill-{user}")),
        None => std::env::temp_dir().join("rankscope-spill"),
    }
}
