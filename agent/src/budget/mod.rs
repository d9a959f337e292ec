//! The budget: the agent's own cost, measured (its CPU time, its device time, and
//! the slowdown the step times show), and the share of each it may take
//! (`RANKSCOPE_OVERHEAD_BUDGET`).
//!
//! - [`controller`]: [`OverheadBudget`] and the controller that keeps the agent
//!   within it by taking fewer activation samples (plain arithmetic on CPU times);
//! - [`counts`]: what the sampler reports, the samples' counts and the agent's cost;
//! - [`cpu_clock`]: the process's and each thread's CPU clock;
//! - [`observed`]: the observed slowdown, what sampling costs the training's step
//!   times (plain arithmetic on them);
//! - `sampler`: the training side's sample gate and counters, which read the clocks
//!   and ask the controller.
//!
//! The budget imports nothing else of the agent; the transport (its thread's clock),
//! config (the budget's value), sampling (the worker's CPU time) and the training
//! side import it.

pub mod controller;
pub mod counts;
pub mod cpu_clock;
pub mod observed;
pub(crate) mod sampler;

pub use controller::OverheadBudget;
pub use counts::{ActivationSamples, Overhead};
pub use sampler::Share;
