//! Agent configuration: rank identity from torchrun's or SLURM's variables, the
//! agent's own `RANKSCOPE_*` variables, and a builder. Precedence: code (the
//! builder) > environment > default. Inconsistent values are errors that name the
//! variable and the fix, never guesses.
//!
//! - this module: [`AgentConfig`], the builder and the checks across settings;
//! - `rank_env`: the rank identity and the run id, from the launcher's variables;
//! - `variables`: the variables' names and defaults; `parse`: their value parsers;
//! - `error`: [`ConfigError`];
//! - `collectors`: [`CollectorList`]; `layer_filter`: [`LayerFilter`]; `modes`:
//!   [`Mode`] and [`SpectrumMode`]; `tls`: the `RANKSCOPE_TLS_*` variables.
//!
//! Config imports the budget (its value type) and the transport (TLS and the queue and
//! spill defaults); sampling and the training side import it. Within it, `error` and
//! `variables` are the floor every other part stands on.
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
//! | `RANKSCOPE_METRICS_THREADS` | threads that measure samples (each a core at most; the overhead budget holds their CPU time together) | `1` (an adapter may set another: the Python package starts 2 on a CUDA rank) |
//! | `RANKSCOPE_SKETCH_THRESHOLD` | the smaller side (min of rows and columns) from which `auto` sketches | `1536`; `1024` where a GPU runs the sketch's Krylov process (the Python package) |
//! | `RANKSCOPE_OVERHEAD_BUDGET` | the agent's share, held on three shares: of the process's CPU time (its threads' CPU clocks plus its time on the training thread, over a sliding window), and of the wall time, its device time and the observed slowdown of the steps; planned samples it has no room for are skipped, and counted, and one sampled step every 100 steps is taken within 2.5 times the budget (see [`crate::budget`]); `100%` takes every planned sample | `2%` |
//! | `RANKSCOPE_ON_CONFIG_ERROR` | `fail` or `disable`: what a wrong configuration does | `fail` |
//! | `RANKSCOPE_TOKEN` | bearer token the collector requires (`--token-file`) | none |
//! | `RANKSCOPE_SPILL_DIR` | where unacknowledged batches wait on disk (`off`: memory only) | `rankscope-spill-$USER` in the temporary directory |
//! | `RANKSCOPE_TLS_CA` | PEM CA that signed the collector's certificate: connect with TLS | plaintext |
//! | `RANKSCOPE_TLS_CERT`, `RANKSCOPE_TLS_KEY` | PEM client certificate and key, for a collector with `--tls-client-ca` | none |
//! | `RANKSCOPE_TLS_DOMAIN` | name to verify in the collector's certificate | the address's host |
//! | `RANKSCOPE_SPILL_MAX_BYTES` | bound on one rank's spill (`K`, `M`, `G` suffixes) | `1G` |

use std::path::PathBuf;
use std::time::Duration;

mod collectors;
mod error;
mod layer_filter;
mod modes;
mod parse;
mod rank_env;
mod tls;
mod variables;

pub use crate::budget::OverheadBudget;
pub use crate::transport::ClientTls;
pub use collectors::CollectorList;
pub use error::ConfigError;
pub use layer_filter::LayerFilter;
pub use modes::{Mode, SpectrumMode};
pub use parse::parse_size;
use parse::{number, parse_bool};
use rank_env::{RankIdentity, RankOverrides, rank_identity, run_id};
pub use tls::client_tls_from_env;
use tls::client_tls_with;
pub use variables::*;

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
    /// The same where a device runs the sketch's Krylov process: the value set, or
    /// [`DEFAULT_DEVICE_SKETCH_THRESHOLD`].
    pub device_sketch_threshold: usize,
    /// `RANKSCOPE_METRICS_THREADS`.
    pub metrics_threads: usize,
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
    /// The agent's share of the process's CPU time, and of the steps' wall time on
    /// the device and observed shares (`RANKSCOPE_OVERHEAD_BUDGET`).
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
    pub metrics_threads: Option<usize>,
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
    setter!(metrics_threads: usize);
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
        with_process_env(|env| self.build_with(env))
    }

    /// What a wrong configuration should do: the builder's choice, else
    /// `RANKSCOPE_ON_CONFIG_ERROR`.
    pub fn on_error(&self) -> Result<OnConfigError, ConfigError> {
        with_process_env(|env| self.on_error_with(env))
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
        let identity = rank_identity(
            &env,
            RankOverrides {
                rank: self.rank,
                local_rank: self.local_rank,
                world_size: self.world_size,
                node_rank: self.node_rank,
            },
        )?;
        let RankIdentity {
            rank,
            local_rank,
            world_size,
            local_world_size,
            node_rank,
        } = identity;
        let run_id = run_id(
            self.run_id.clone().or_else(|| env(RANKSCOPE_RUN_ID)),
            &env,
            world_size,
        )?;
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
            None => number(
                &env,
                RANKSCOPE_MAX_ROWS,
                "the row cap of the activation matrix",
            )?
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
            Some(n) => Some(n),
            None => number(
                &env,
                RANKSCOPE_SKETCH_THRESHOLD,
                "the smaller side (rows or columns) from which auto sketches the spectrum, e.g. 1536",
            )?
            .map(|n| n as usize),
        };
        let device_sketch_threshold = sketch_threshold.unwrap_or(DEFAULT_DEVICE_SKETCH_THRESHOLD);
        let metrics_threads = match self.metrics_threads {
            Some(n) => n,
            None => number(
                &env,
                RANKSCOPE_METRICS_THREADS,
                "how many threads measure samples, e.g. 2",
            )?
            .map_or(DEFAULT_METRICS_THREADS, |n| n as usize),
        };
        if !(1..=MAX_METRICS_THREADS).contains(&metrics_threads) {
            return Err(ConfigError::MetricsThreads(metrics_threads));
        }
        let sketch_threshold = sketch_threshold.unwrap_or(DEFAULT_SKETCH_THRESHOLD);
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
        // An error names where the list came from: the code's `collector` (the
        // Python keyword, `train --collector`) or the variable.
        let collectors = match &self.collector {
            Some(list) => CollectorList::parse("collector", list)?,
            None => CollectorList::parse(
                RANKSCOPE_COLLECTOR,
                &env(RANKSCOPE_COLLECTOR).unwrap_or_else(|| DEFAULT_COLLECTOR.into()),
            )?,
        };
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
            device_sketch_threshold,
            metrics_threads,
            finish_timeout: self.finish_timeout.unwrap_or(DEFAULT_FINISH_TIMEOUT),
            queue_rows: self.queue_rows.unwrap_or(DEFAULT_QUEUE_ROWS),
            workload: self.workload.clone().unwrap_or_default(),
            token: checked_token(self.token.clone().or_else(|| env(RANKSCOPE_TOKEN)))?,
            spill_dir,
            spill_max_bytes,
            tls,
            overhead_budget,
        })
    }
}

/// The bearer token, if it can travel in a request header (no line breaks or other
/// control characters); else an error naming where it came from.
fn checked_token(token: Option<String>) -> Result<Option<String>, ConfigError> {
    match token {
        Some(t) if tonic::metadata::MetadataValue::try_from(format!("Bearer {t}")).is_err() => {
            Err(ConfigError::Token)
        }
        token => Ok(token),
    }
}

/// Runs `read` over the process environment. A variable it reads that holds bytes
/// which are not UTF-8 is an error naming it, rather than read as unset.
fn with_process_env<T>(
    read: impl FnOnce(&dyn Fn(&str) -> Option<String>) -> Result<T, ConfigError>,
) -> Result<T, ConfigError> {
    let not_unicode = std::cell::RefCell::new(None);
    let env = |var: &str| match std::env::var(var) {
        Ok(value) => Some(value),
        Err(std::env::VarError::NotPresent) => None,
        Err(std::env::VarError::NotUnicode(value)) => {
            not_unicode
                .borrow_mut()
                .get_or_insert_with(|| (var.to_string(), value.to_string_lossy().into_owned()));
            None
        }
    };
    let result = read(&env);
    match not_unicode.into_inner() {
        Some((var, value)) => Err(ConfigError::NotUnicode(var, value)),
        None => result,
    }
}

#[cfg(test)]
mod tests;
