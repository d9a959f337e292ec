//! `--overhead-budget`'s parser, shared by `demo` and `bench`.

use rankscope_agent::config::OverheadBudget;

/// Reads `2%` or `0.5%` as the agent's `RANKSCOPE_OVERHEAD_BUDGET` does; the
/// error names the value and the form to write.
pub(crate) fn parse(text: &str) -> Result<OverheadBudget, String> {
    OverheadBudget::parse(text).ok_or_else(|| {
        format!(
            "{text:?}: give a percentage above 0 and at most 100, with the % sign, e.g. 2% or 0.5%"
        )
    })
}
