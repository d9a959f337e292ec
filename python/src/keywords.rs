//! `init`'s keywords, taken as the Python values the user wrote: each is checked and
//! converted here, so a wrong one raises an error that names the keyword, the value
//! and the fix (`TypeError` for a wrong type, `ConfigError` for a value out of range)
//! instead of pyo3's generic wording. The ranges and parsers themselves are the
//! agent's (`rankscope_agent::config`); this module only converts.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyString};
use rankscope_agent::Mode;
use rankscope_agent::config::{AgentConfigBuilder, OverheadBudget};

use crate::ConfigError;

/// `value`'s `repr`, cut to a readable length.
fn shown(value: &Bound<'_, PyAny>) -> String {
    let text = value
        .repr()
        .map_or_else(|_| "<unprintable>".to_string(), |r| r.to_string());
    if text.chars().count() > 80 {
        format!("{}…", text.chars().take(80).collect::<String>())
    } else {
        text
    }
}

fn wrong_type(name: &str, value: &Bound<'_, PyAny>, expected: &str, example: &str) -> PyErr {
    let kind = value
        .get_type()
        .name()
        .map_or_else(|_| "object".to_string(), |n| n.to_string());
    PyTypeError::new_err(format!(
        "{name}={} has type {kind}, not {expected}: e.g. {name}={example}",
        shown(value)
    ))
}

/// A keyword that takes a string.
pub fn text(
    name: &str,
    value: Option<&Bound<'_, PyAny>>,
    example: &str,
) -> PyResult<Option<String>> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    match value.cast::<PyString>() {
        Ok(s) => s.to_cow().map(|t| Some(t.into_owned())).map_err(|_| {
            ConfigError::new_err(format!(
                "{name}={} is not valid Unicode text (it holds a lone surrogate): give plain text, e.g. {name}={example}",
                shown(value)
            ))
        }),
        Err(_) => Err(wrong_type(name, value, "a string", example)),
    }
}

/// A keyword that takes a whole number of at least `least` (a bool is refused,
/// although Python counts it as an int).
pub fn whole(
    name: &str,
    value: Option<&Bound<'_, PyAny>>,
    least: u64,
    meaning: &str,
    example: &str,
) -> PyResult<Option<u64>> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    if value.is_instance_of::<PyBool>() || !value.is_instance_of::<PyInt>() {
        return Err(wrong_type(name, value, "a whole number", example));
    }
    match value.extract::<i128>() {
        Ok(n) if n >= i128::from(least) && n <= i128::from(u64::MAX) => Ok(Some(n as u64)),
        _ => Err(ConfigError::new_err(format!(
            "{name}={} is out of range: {meaning} is a whole number of at least {least}, e.g. {name}={example}",
            shown(value)
        ))),
    }
}

/// `overhead_budget`: a fraction of the process's CPU time (`0.05`, the form the
/// `runs` table stores) or a percentage string (`"5%"`, the form of
/// `RANKSCOPE_OVERHEAD_BUDGET`).
pub fn overhead_budget(value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<OverheadBudget>> {
    const NAME: &str = "overhead_budget";
    const FIX: &str = "give the agent's share of the process's CPU time as a fraction above 0 and at most 1 or as a percentage string, e.g. overhead_budget=0.05 or overhead_budget=\"5%\"";
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    let budget = if let Ok(s) = value.cast::<PyString>() {
        s.to_cow().ok().and_then(|t| OverheadBudget::parse(&t))
    } else if !value.is_instance_of::<PyBool>()
        && (value.is_instance_of::<PyFloat>() || value.is_instance_of::<PyInt>())
    {
        // An int past a float's range is no budget either.
        value
            .extract::<f64>()
            .ok()
            .and_then(OverheadBudget::from_fraction)
    } else {
        return Err(wrong_type(
            NAME,
            value,
            "a fraction or a percentage string",
            "0.05 or \"5%\"",
        ));
    };
    budget.map(Some).ok_or_else(|| {
        ConfigError::new_err(format!("{NAME}={} is not a budget: {FIX}", shown(value)))
    })
}

/// `init`'s keywords as given (`None`: not given, left to its variable).
pub struct Keywords<'a, 'py> {
    pub collector: Option<&'a Bound<'py, PyAny>>,
    pub run_id: Option<&'a Bound<'py, PyAny>>,
    pub mode: Option<&'a Bound<'py, PyAny>>,
    pub sample_every: Option<&'a Bound<'py, PyAny>>,
    pub layers: Option<&'a Bound<'py, PyAny>>,
    pub max_rows: Option<&'a Bound<'py, PyAny>>,
    pub workload: Option<&'a Bound<'py, PyAny>>,
    pub overhead_budget: Option<&'a Bound<'py, PyAny>>,
    pub metrics_threads: Option<&'a Bound<'py, PyAny>>,
}

impl Keywords<'_, '_> {
    /// The agent's configuration builder from the keywords: a wrong type raises
    /// `TypeError`, a wrong value `ConfigError`.
    pub fn builder(&self) -> PyResult<AgentConfigBuilder> {
        let mode = text("mode", self.mode, "\"rank0\"")?;
        let mode = match mode.as_deref().map(|m| (m, Mode::parse(m))) {
            Some((text, None)) => {
                return Err(ConfigError::new_err(format!(
                    "mode={text:?} is not a mode: use full, rank0, steps or off"
                )));
            }
            Some((_, m)) => m,
            None => None,
        };
        let workload = text("workload", self.workload, "\"gpt-small\"")?;
        Ok(AgentConfigBuilder {
            collector: text("collector", self.collector, "\"10.0.0.1:50051\"")?,
            run_id: text("run_id", self.run_id, "\"exp-42\"")?,
            mode,
            sample_every: whole(
                "sample_every",
                self.sample_every,
                1,
                "the sampling interval in steps (RANKSCOPE_SAMPLE_EVERY)",
                "10",
            )?,
            layer_filter: text("layers", self.layers, "\"blocks.*.mlp\"")?,
            max_rows: whole(
                "max_rows",
                self.max_rows,
                1,
                "the row cap of an activation matrix (RANKSCOPE_MAX_ROWS)",
                "4096",
            )?
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            overhead_budget: overhead_budget(self.overhead_budget)?,
            metrics_threads: whole(
                "metrics_threads",
                self.metrics_threads,
                1,
                "how many threads measure samples (RANKSCOPE_METRICS_THREADS)",
                "2",
            )?
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            workload: Some(workload.unwrap_or_else(|| "python".into())),
            ..Default::default()
        })
    }
}
