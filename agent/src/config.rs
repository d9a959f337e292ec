//! Agent configuration: rank identity from torchrun's or SLURM's variables, the
//! agent's own `RANKSCOPE_*` variables, and a builder. Precedence: code (the
//! builder) > environment > default. Inconsistent values are errors that name the
//! variable and the fix, never guesses.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK` | torchrun's rank identity | rank 0 of 1 |
//! | `SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NTASKS`, `SLURM_NODEID` | SLURM's, used when torchrun's are absent | |
//! | `TORCHELASTIC_RUN_ID`, `SLURM_JOB_ID` | run id fallbacks | |
//! | `MASTER_ADDR`, `MASTER_PORT` | last run id fallback for multi-rank jobs | |
//! | `RANKSCOPE_COLLECTOR` | collector address, or a comma-separated list of them: rank `r` sends to entry `r % len` (see [`CollectorList`]) | `127.0.0.1:50051` |
//! | `RANKSCOPE_RUN_ID` | run id | see [`AgentConfig::run_id`] |
//! | `RANKSCOPE_MODE` | `full`, `rank0`, `steps` or `off` | `full` |
//! | `RANKSCOPE_SAMPLE_EVERY` | sample layer activations every N steps | `10` |
//! | `RANKSCOPE_LAYERS` | comma-separated layer name patterns, `*` wildcard | all layers |
//! | `RANKSCOPE_MAX_ROWS` | row cap of the activation matrix | `4096` |
//! | `RANKSCOPE_CENTER` | centre columns before the spectrum (`1`/`0`) | `0` |
//! | `RANKSCOPE_CONV_LAYOUT` | `channelwise` or `flatten` | `channelwise` |
//! | `RANKSCOPE_SPECTRUM` | `auto`, `exact` or `sketch`: how the spectral columns are computed (`auto` sketches matrices with at least `RANKSCOPE_SKETCH_THRESHOLD` rows and columns; the `layers.method` column says which ran) | `auto` |
//! | `RANKSCOPE_SKETCH_THRESHOLD` | the smaller side (min of rows and columns) from which `auto` sketches | `1536` |
//! | `RANKSCOPE_OVERHEAD_BUDGET` | the agent's share of the process's CPU time, measured (its threads' CPU clocks plus its time on the training thread) over a sliding window; planned samples it has no room for are skipped, and counted (see [`crate::budget`]); `100%` takes every planned sample | `2%` |
//! | `RANKSCOPE_ON_CONFIG_ERROR` | `fail` or `disable`: what a wrong configuration does | `fail` |
//! | `RANKSCOPE_TOKEN` | bearer token the collector requires (`--token-file`) | none |
//! | `RANKSCOPE_SPILL_DIR` | where unacknowledged batches wait on disk (`off`: memory only) | `rankscope-spill-$USER` in the temporary directory |
//! | `RANKSCOPE_TLS_CA` | PEM CA that signed the collector's certificate: connect with TLS | plaintext |
//! | `RANKSCOPE_TLS_CERT`, `RANKSCOPE_TLS_KEY` | PEM client certificate and key, for a collector with `--tls-client-ca` | none |
//! | `RANKSCOPE_TLS_DOMAIN` | name to verify in the collector's certificate | the address's host |
//! | `RANKSCOPE_SPILL_MAX_BYTES` | bound on one rank's spill (`K`, `M`, `G` suffixes) | `1G` |

use std::path::PathBuf;
use std::time::Duration;

pub use crate::budget::OverheadBudget;
pub use crate::collector_list::CollectorList;
pub use crate::layer_filter::LayerFilter;
pub use crate::transport::client_tls::ClientTls;
pub use crate::transport::{DEFAULT_QUEUE_ROWS, DEFAULT_SPILL_MAX_BYTES};

mod modes;
mod tls;
pub use modes::{Mode, SpectrumMode};
pub use tls::client_tls_from_env;
use tls::client_tls_with;

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

/// A wrong configuration, naming the variable and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{var}={value:?} is not a whole number: {hint}")]
    NotANumber {
        var: &'static str,
        value: String,
        hint: &'static str,
    },
    #[error("{rank_var}={rank} but {size_var}={size}: a rank must be below the world size")]
    RankOutOfRange {
        rank_var: &'static str,
        rank: u32,
        size_var: &'static str,
        size: u32,
    },
    #[error("{var}=0: the world size must be at least 1")]
    ZeroWorldSize { var: &'static str },
    #[error("{set} is set but {missing} is not: set both (torchrun and SLURM set them together)")]
    Incomplete {
        set: &'static str,
        missing: &'static str,
    },
    #[error("{RANKSCOPE_MODE}={0:?} is not a mode: use full, rank0, steps or off")]
    Mode(String),
    #[error(
        "run id {0:?} is not allowed: use 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit (set {RANKSCOPE_RUN_ID})"
    )]
    RunId(String),
    #[error(
        "{RANKSCOPE_SAMPLE_EVERY}=0: sample every 1 or more steps, or set {RANKSCOPE_MODE}=steps"
    )]
    SampleEvery,
    #[error("{RANKSCOPE_MAX_ROWS}=0: the row cap must be at least 1")]
    MaxRows,
    #[error("{var}={value:?} is not a boolean: use 1/0, true/false, yes/no")]
    Bool { var: &'static str, value: String },
    #[error("{RANKSCOPE_CONV_LAYOUT}={0:?} is not a layout: use channelwise or flatten")]
    ConvLayout(String),
    #[error("{RANKSCOPE_SPECTRUM}={0:?} is not a spectrum method: use auto, exact or sketch")]
    Spectrum(String),
    #[error("{RANKSCOPE_ON_CONFIG_ERROR}={0:?}: use fail or disable")]
    OnError(String),
    #[error(
        "{RANKSCOPE_OVERHEAD_BUDGET}={0:?} is not a budget: give the agent's share of the process's CPU time as a percentage above 0 and at most 100, with the % sign, e.g. 2% or 0.5% (100% takes every planned sample)"
    )]
    OverheadBudget(String),
    #[error(
        "{RANKSCOPE_WORKER_PRIORITY}={0:?} is no longer read: the metrics thread now runs within {RANKSCOPE_OVERHEAD_BUDGET} (default 2%); unset {RANKSCOPE_WORKER_PRIORITY}, and set {RANKSCOPE_OVERHEAD_BUDGET}=100% to measure every planned sample as `normal` did"
    )]
    WorkerPriority(String),
    #[error(
        "{RANKSCOPE_SPILL_MAX_BYTES}={0:?} is not a size: use bytes with an optional K, M or G suffix, e.g. 512M"
    )]
    SpillMaxBytes(String),
    #[error("cannot read {var}={path:?}: {error}")]
    TlsFile {
        var: &'static str,
        path: String,
        error: String,
    },
    #[error("{set} is set but {missing} is not: set both (a client certificate and its key)")]
    TlsPair {
        set: &'static str,
        missing: &'static str,
    },
    #[error(
        "{RANKSCOPE_TLS_CERT} and {RANKSCOPE_TLS_KEY} are set but {RANKSCOPE_TLS_CA} is not: set the CA that signed the collector's certificate"
    )]
    TlsCa,
    #[error(
        "collector address {0:?} asks for TLS: set {RANKSCOPE_TLS_CA} to the CA that signed its certificate"
    )]
    TlsNeeded(String),
    #[error(
        "{var}={list:?}: entry {entry} is empty: list collector addresses separated by commas, e.g. 10.0.0.1:50051,10.0.0.2:50051"
    )]
    CollectorEmpty {
        var: &'static str,
        list: String,
        entry: usize,
    },
    #[error(
        "{var}={list:?}: {address:?} is not a collector address ({why}): use HOST:PORT, http://HOST:PORT or https://HOST:PORT"
    )]
    CollectorAddress {
        var: &'static str,
        list: String,
        address: String,
        why: &'static str,
    },
    #[error(
        "{var}={list:?} mixes TLS ({tls:?}) and plaintext ({plain:?}) collectors: write https:// on every address or on none"
    )]
    CollectorMixed {
        var: &'static str,
        list: String,
        tls: String,
        plain: String,
    },
}

/// The agent's whole configuration, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentConfig {
    pub rank: u32,
    pub local_rank: u32,
    pub world_size: u32,
    pub local_world_size: u32,
    pub node_rank: u32,
    /// `RANKSCOPE_RUN_ID`, else torchrun's `TORCHELASTIC_RUN_ID` (unless `none`),
    /// else `slurm-<SLURM_JOB_ID>`, else `job-<MASTER_ADDR>-<MASTER_PORT>` for a
    /// multi-rank job, else `local-<pid>` for a single process.
    pub run_id: String,
    /// The collector this rank sends to: its entry of the `RANKSCOPE_COLLECTOR`
    /// list (see [`CollectorList`]).
    pub collector: String,
    pub mode: Mode,
    pub sample_every: u64,
    /// Which layers are sampled (`RANKSCOPE_LAYERS`; the `runs.layer_filter` column).
    pub layer_filter: LayerFilter,
    pub max_rows: usize,
    /// Subtract column means before the spectrum (`RANKSCOPE_CENTER`; the
    /// `centered` columns).
    pub centered: bool,
    /// `channelwise` or `flatten`.
    pub conv_layout: String,
    /// `RANKSCOPE_SPECTRUM`.
    pub spectrum: SpectrumMode,
    /// `RANKSCOPE_SKETCH_THRESHOLD`.
    pub sketch_threshold: usize,
    /// How long `finish()` waits for the collector to acknowledge everything.
    pub finish_timeout: Duration,
    /// Rows the training thread may queue before rows are dropped (and counted).
    pub queue_rows: usize,
    /// The workload name recorded in the `runs` table.
    pub workload: String,
    /// Bearer token for the collector.
    pub token: Option<String>,
    /// Root of the spill directories; `None` keeps unacknowledged batches in memory.
    pub spill_dir: Option<PathBuf>,
    /// Bound on one rank's spill, in bytes.
    pub spill_max_bytes: u64,
    /// TLS to the collector (`RANKSCOPE_TLS_*`); `None` is plaintext.
    pub tls: Option<ClientTls>,
    /// The agent's share of the process's CPU time (`RANKSCOPE_OVERHEAD_BUDGET`).
    pub overhead_budget: OverheadBudget,
}

impl AgentConfig {
    /// Reads the process environment (see the module docs).
    pub fn from_env() -> Result<AgentConfig, ConfigError> {
        AgentConfigBuilder::default().build()
    }

    pub fn builder() -> AgentConfigBuilder {
        AgentConfigBuilder::default()
    }

    /// Whether this rank records anything at all.
    pub fn active(&self) -> bool {
        match self.mode {
            Mode::Off => false,
            Mode::Rank0 => self.rank == 0,
            Mode::Full | Mode::Steps => true,
        }
    }

    /// Whether this rank samples layer activations.
    pub fn samples_layers(&self) -> bool {
        self.active() && self.mode != Mode::Steps
    }
}

/// What to do when the configuration is wrong: fail (the default), or run with
/// the agent disabled, an explicit choice that is logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnConfigError {
    #[default]
    Fail,
    Disable,
}

/// Overrides from code; unset fields come from the environment, then defaults.
#[derive(Debug, Clone, Default)]
pub struct AgentConfigBuilder {
    pub rank: Option<u32>,
    pub local_rank: Option<u32>,
    pub world_size: Option<u32>,
    pub node_rank: Option<u32>,
    pub run_id: Option<String>,
    pub collector: Option<String>,
    pub mode: Option<Mode>,
    pub sample_every: Option<u64>,
    pub layer_filter: Option<String>,
    pub max_rows: Option<usize>,
    pub centered: Option<bool>,
    pub conv_layout: Option<String>,
    pub spectrum: Option<SpectrumMode>,
    pub sketch_threshold: Option<usize>,
    pub finish_timeout: Option<Duration>,
    pub queue_rows: Option<usize>,
    pub workload: Option<String>,
    pub token: Option<String>,
    /// `Some(None)` turns the spill off.
    pub spill_dir: Option<Option<PathBuf>>,
    pub spill_max_bytes: Option<u64>,
    pub overhead_budget: Option<OverheadBudget>,
    pub on_config_error: Option<OnConfigError>,
}

macro_rules! setter {
    ($name:ident: $ty:ty) => {
        pub fn $name(mut self, value: impl Into<$ty>) -> Self {
            self.$name = Some(value.into());
            self
        }
    };
}

impl AgentConfigBuilder {
    setter!(rank: u32);
    setter!(local_rank: u32);
    setter!(world_size: u32);
    setter!(node_rank: u32);
    setter!(run_id: String);
    setter!(collector: String);
    setter!(mode: Mode);
    setter!(sample_every: u64);
    setter!(layer_filter: String);
    setter!(max_rows: usize);
    setter!(centered: bool);
    setter!(conv_layout: String);
    setter!(spectrum: SpectrumMode);
    setter!(sketch_threshold: usize);
    setter!(finish_timeout: Duration);
    setter!(queue_rows: usize);
    setter!(workload: String);
    setter!(token: String);
    setter!(spill_dir: Option<PathBuf>);
    setter!(spill_max_bytes: u64);
    setter!(overhead_budget: OverheadBudget);
    setter!(on_config_error: OnConfigError);

    /// Reads the process environment for whatever was not set in code.
    pub fn build(&self) -> Result<AgentConfig, ConfigError> {
        self.build_with(|var| std::env::var(var).ok())
    }

    /// What a wrong configuration should do: the builder's choice, else
    /// `RANKSCOPE_ON_CONFIG_ERROR`.
    pub fn on_error(&self) -> Result<OnConfigError, ConfigError> {
        self.on_error_with(|var| std::env::var(var).ok())
    }

    fn on_error_with(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<OnConfigError, ConfigError> {
        if let Some(choice) = self.on_config_error {
            return Ok(choice);
        }
        match env(RANKSCOPE_ON_CONFIG_ERROR).as_deref().map(str::trim) {
            None | Some("") | Some("fail") => Ok(OnConfigError::Fail),
            Some("disable") => Ok(OnConfigError::Disable),
            Some(other) => Err(ConfigError::OnError(other.into())),
        }
    }

    /// [`Self::build`] with the environment given as a lookup function (tests).
    pub fn build_with(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<AgentConfig, ConfigError> {
        let env = |var: &str| env(var).filter(|v| !v.trim().is_empty());
        let num = |var: &'static str, hint: &'static str| -> Result<Option<u32>, ConfigError> {
            env(var)
                .map(|v| {
                    v.trim()
                        .parse::<u32>()
                        .map_err(|_| ConfigError::NotANumber {
                            var,
                            value: v,
                            hint,
                        })
                })
                .transpose()
        };
        let rank_hint = "it is the process's rank (0, 1, ...), set by the launcher";
        let size_hint = "it is the number of processes, set by the launcher";

        // Rank identity: torchrun's variables, else SLURM's, else a single process.
        let (rank_var, size_var) = if env(RANK).is_some() || env(WORLD_SIZE).is_some() {
            (RANK, WORLD_SIZE)
        } else {
            (SLURM_PROCID, SLURM_NTASKS)
        };
        let torchrun = rank_var == RANK;
        let env_rank = num(rank_var, rank_hint)?;
        let env_size = num(size_var, size_hint)?;
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
        let rank = self.rank.or(env_rank).unwrap_or(0);
        let world_size = self.world_size.or(env_size).unwrap_or(1);
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
        let local_rank = self
            .local_rank
            .or(num(local_rank_var, rank_hint)?)
            .unwrap_or(rank);
        let local_world_size = if torchrun {
            num(local_size_var, size_hint)?
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
        let node_rank = self
            .node_rank
            .or(num(node_var, rank_hint)?)
            .unwrap_or(rank / local_world_size.max(1));

        let run_id = match self.run_id.clone().or_else(|| env(RANKSCOPE_RUN_ID)) {
            Some(id) => id,
            None => default_run_id(&env, world_size),
        };
        if !rankscope_proto::is_valid_run_id(&run_id) {
            return Err(ConfigError::RunId(run_id));
        }
        let mode = match self.mode {
            Some(m) => m,
            None => match env(RANKSCOPE_MODE) {
                Some(text) => Mode::parse(&text).ok_or(ConfigError::Mode(text))?,
                None => Mode::Full,
            },
        };
        let sample_every = match self.sample_every {
            Some(n) => n,
            None => env(RANKSCOPE_SAMPLE_EVERY)
                .map(|v| {
                    v.trim()
                        .parse::<u64>()
                        .map_err(|_| ConfigError::NotANumber {
                            var: RANKSCOPE_SAMPLE_EVERY,
                            value: v,
                            hint: "sample layer activations every N steps",
                        })
                })
                .transpose()?
                .unwrap_or(DEFAULT_SAMPLE_EVERY),
        };
        if sample_every == 0 {
            return Err(ConfigError::SampleEvery);
        }
        let max_rows = match self.max_rows {
            Some(n) => n,
            None => num(RANKSCOPE_MAX_ROWS, "the row cap of the activation matrix")?
                .map_or(DEFAULT_MAX_ROWS, |n| n as usize),
        };
        if max_rows == 0 {
            return Err(ConfigError::MaxRows);
        }
        let centered = match self.centered {
            Some(c) => c,
            None => match env(RANKSCOPE_CENTER) {
                Some(v) => parse_bool(&v).ok_or(ConfigError::Bool {
                    var: RANKSCOPE_CENTER,
                    value: v,
                })?,
                None => false,
            },
        };
        let conv_layout = self
            .conv_layout
            .clone()
            .or_else(|| env(RANKSCOPE_CONV_LAYOUT))
            .unwrap_or_else(|| "channelwise".into());
        if !matches!(conv_layout.as_str(), "channelwise" | "flatten") {
            return Err(ConfigError::ConvLayout(conv_layout));
        }
        let spectrum = match self.spectrum {
            Some(s) => s,
            None => match env(RANKSCOPE_SPECTRUM) {
                Some(text) => SpectrumMode::parse(&text).ok_or(ConfigError::Spectrum(text))?,
                None => SpectrumMode::Auto,
            },
        };
        let sketch_threshold = match self.sketch_threshold {
            Some(n) => n,
            None => num(
                RANKSCOPE_SKETCH_THRESHOLD,
                "the smaller side (rows or columns) from which auto sketches the spectrum, e.g. 1536",
            )?
            .map_or(DEFAULT_SKETCH_THRESHOLD, |n| n as usize),
        };
        let spill_dir = match self.spill_dir.clone() {
            Some(dir) => dir,
            None => match env(RANKSCOPE_SPILL_DIR) {
                Some(v) if v.trim() == "off" => None,
                Some(v) => Some(PathBuf::from(v)),
                None => Some(default_spill_dir()),
            },
        };
        let spill_max_bytes = match self.spill_max_bytes {
            Some(n) => n,
            None => match env(RANKSCOPE_SPILL_MAX_BYTES) {
                Some(v) => parse_size(&v).ok_or(ConfigError::SpillMaxBytes(v))?,
                None => DEFAULT_SPILL_MAX_BYTES,
            },
        };
        let collectors = CollectorList::parse(
            RANKSCOPE_COLLECTOR,
            &self
                .collector
                .clone()
                .or_else(|| env(RANKSCOPE_COLLECTOR))
                .unwrap_or_else(|| DEFAULT_COLLECTOR.into()),
        )?;
        let collector = collectors.for_rank(rank).to_string();
        let tls = client_tls_with(&env)?;
        if tls.is_none() && collectors.tls() {
            return Err(ConfigError::TlsNeeded(collector));
        }
        if let Some(v) = env(RANKSCOPE_WORKER_PRIORITY) {
            return Err(ConfigError::WorkerPriority(v));
        }
        let overhead_budget = match self.overhead_budget {
            Some(b) => b,
            None => match env(RANKSCOPE_OVERHEAD_BUDGET) {
                Some(v) => OverheadBudget::parse(&v).ok_or(ConfigError::OverheadBudget(v))?,
                None => OverheadBudget::DEFAULT,
            },
        };
        self.on_error_with(env)?;
        Ok(AgentConfig {
            rank,
            local_rank,
            world_size,
            local_world_size,
            node_rank,
            run_id,
            collector,
            mode,
            sample_every,
            layer_filter: LayerFilter::parse(
                &self
                    .layer_filter
                    .clone()
                    .or_else(|| env(RANKSCOPE_LAYERS))
                    .unwrap_or_default(),
            ),
            max_rows,
            centered,
            conv_layout,
            spectrum,
            sketch_threshold,
            finish_timeout: self.finish_timeout.unwrap_or(DEFAULT_FINISH_TIMEOUT),
            queue_rows: self.queue_rows.unwrap_or(DEFAULT_QUEUE_ROWS),
            workload: self.workload.clone().unwrap_or_default(),
            token: self.token.clone().or_else(|| env(RANKSCOPE_TOKEN)),
            spill_dir,
            spill_max_bytes,
            tls,
            overhead_budget,
        })
    }
}

/// Bytes, with an optional binary `K`, `M` or `G` suffix.
fn parse_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, shift) = match text.char_indices().last()? {
        (i, 'k' | 'K') => (&text[..i], 10),
        (i, 'm' | 'M') => (&text[..i], 20),
        (i, 'g' | 'G') => (&text[..i], 30),
        _ => (text, 0),
    };
    digits.trim().parse::<u64>().ok()?.checked_mul(1 << shift)
}

fn parse_bool(text: &str) -> Option<bool> {
    match text.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
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

#[cfg(test)]
mod tests;
