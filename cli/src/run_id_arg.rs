//! `--run-id` where a command names a new run (`launch`, `loadgen`): checked by the
//! rule the agents and the collector apply, so a bad one fails at once rather than
//! in every rank, or at the collector.

/// A run id the collector accepts; the error names the value and the rule.
pub fn parse(text: &str) -> Result<String, String> {
    if rankscope_proto::is_valid_run_id(text) {
        Ok(text.to_string())
    } else {
        Err(format!(
            "{text:?} is not a run id: use 1 to {} ASCII letters, digits, '.', '_' or '-', starting with a letter or digit, without '..'",
            rankscope_proto::MAX_RUN_ID_LEN
        ))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn run_ids_follow_the_collectors_rule() {
        assert_eq!(super::parse("exp-42.a_b"), Ok("exp-42.a_b".into()));
        for bad in ["", "../x", "bad id", "-x", "a..b"] {
            let error = super::parse(bad).unwrap_err();
            assert!(error.contains("is not a run id"), "{bad}: {error}");
        }
    }
}
