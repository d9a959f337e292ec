//! Parses byte counts written as `1048576`, `512K`, `64M` or `2G` (binary units), as
//! the agent's `RANKSCOPE_SPILL_MAX_BYTES` reads them.

/// A byte count; the error names the value and the forms accepted.
pub fn parse(text: &str) -> Result<u64, String> {
    rankscope_agent::config::parse_size(text).ok_or_else(|| {
        format!("{text:?} is not a byte count: give a whole number of bytes, or one with K, M or G (binary units), e.g. 268435456 or 256M")
    })
}

/// [`parse`] for a setting held as `usize`.
pub fn parse_usize(text: &str) -> Result<usize, String> {
    parse(text).and_then(|n| usize::try_from(n).map_err(|_| format!("{text:?} is too large")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_binary_suffixes_and_errors_name_the_value() {
        assert_eq!(parse("4096"), Ok(4096));
        assert_eq!(parse("1G"), Ok(1 << 30));
        assert_eq!(parse_usize("256M"), Ok(256 << 20));
        let error = parse("1GB").unwrap_err();
        assert!(error.starts_with("\"1GB\" is not a byte count"), "{error}");
        assert!(parse("-1").is_err());
    }
}
