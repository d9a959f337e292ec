//! The analysis core: change points in a series and diagnoses of a run, as pure
//! functions over plain structs, so `jumps`, a report and a run comparison share
//! them whatever reads the data.
//!
//! Layout:
//! - `agent_cost`: what the agent cost a rank, per share of its budget;
//! - `coverage`: whether a layer's series is thick enough for a trend;
//! - `stats`: normal tails, robust scale, least-squares lines, the binomial tail;
//! - `jumps`: the jump (change-point) detector and its false-alarm control;
//! - `validity`: the detector's fixtures and scoring, modelled on NDT's harness;
//! - `diagnoses`: what went wrong in a run, with thresholds and evidence;
//! - `live`: the diagnoses that run mid-run, over the collectors' live view,
//!   with the step at which each fired.

pub mod agent_cost;
pub mod coverage;
pub mod diagnoses;
pub mod jumps;
pub mod live;
pub mod stats;
#[cfg(test)]
pub mod validity;
