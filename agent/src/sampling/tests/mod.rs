//! The sampling side's tests: the metrics against `docs/metrics.md` ([`metrics`]), and
//! the sketch against the exact spectrum ([`sketch`]).

mod metrics;
mod sketch;
