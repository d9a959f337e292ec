//! The subcommands, one module each, named after the subcommand (`lib.rs` parses the
//! command line and calls the module's `run`):
//! - `collector`: `rankscope collector`;
//! - `loadgen`: `rankscope loadgen`, simulated ranks on the real protocol;
//! - `launch`: `rankscope launch`, local ranks with torchrun's variables;
//! - `replay`: `rankscope replay`, sends what ranks left in their spill directories;
//! - `summary`: `rankscope summary`, a run's summary from its Parquet files;
//! - `report`: `rankscope report`, the HTML page and JSON summary of a run;
//! - `compare`: `rankscope compare`, two runs side by side;
//! - `compact`: `rankscope compact`, a finished run's small files merged in each
//!   Delta table (`delta` feature);
//! - `jumps`: `rankscope jumps`, change points in one series;
//! - `top`: `rankscope top`, every rank of a run live, from the collectors' live
//!   view;
//! - `train`: `rankscope train`, the example models with the agent (`torch` feature);
//! - `demo`: `rankscope demo`, the README's `make demo`;
//! - `spectrum`: `rankscope spectrum`, metrics of a saved `.npy` matrix (`torch`
//!   feature);
//! - `bench`: `rankscope bench`, the agent's overhead for BENCHMARKS.md, and its
//!   `collector` module: `rankscope bench collector`, the collector's throughput
//!   (`torch` feature).

#[cfg(feature = "torch")]
pub mod bench;
pub mod collector;
#[cfg(feature = "delta")]
pub mod compact;
pub mod compare;
pub mod demo;
pub mod jumps;
pub mod launch;
pub mod loadgen;
pub mod replay;
pub mod report;
#[cfg(feature = "torch")]
pub mod spectrum;
pub mod summary;
pub mod top;
#[cfg(feature = "torch")]
pub mod train;
