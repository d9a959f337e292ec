//! Parsers of variable values that more than one setting shares: whole numbers, sizes
//! and booleans. It imports only [`ConfigError`].

use super::error::ConfigError;

/// The whole number in `var`, if set; `hint` says what it is when it is not a number.
pub(super) fn number(
    env: &impl Fn(&str) -> Option<String>,
    var: &'static str,
    hint: &'static str,
) -> Result<Option<u32>, ConfigError> {
    env(var)
        .map(|v| {
            v.trim()
                .parse::<u32>()
                .map_err(|_| ConfigError::NotANumber {
                    var,
                    value: v,
                    hint,
                })
        })
        .transpose()
}

/// Bytes, with an optional binary `K`, `M` or `G` suffix.
pub fn parse_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, shift) = match text.char_indices().last()? {
        (i, 'k' | 'K') => (&text[..i], 10),
        (i, 'm' | 'M') => (&text[..i], 20),
        (i, 'g' | 'G') => (&text[..i], 30),
        _ => (text, 0),
    };
    digits.trim().parse::<u64>().ok()?.checked_mul(1 << shift)
}

pub(super) fn parse_bool(text: &str) -> Option<bool> {
    match text.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}
