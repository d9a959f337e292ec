//! [`ConfigError`]: a wrong configuration, naming the variable and the fix. It
//! imports only the variable names its messages quote.

use super::variables::*;

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
    #[error(
        "{RANKSCOPE_METRICS_THREADS}={0}: give between 1 and {MAX_METRICS_THREADS} metrics threads (default {DEFAULT_METRICS_THREADS})"
    )]
    MetricsThreads(usize),
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
    #[error("{0} is set to bytes that are not UTF-8 text ({1:?}): set it to text, or unset it")]
    NotUnicode(String, String),
    #[error(
        "{RANKSCOPE_TOKEN} holds a line break or another character a request header cannot carry: give the token alone, as the collector's --token-file holds it"
    )]
    Token,
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
