//! Parses durations written as `10s`, `500ms`, `2m` or plain seconds (`1.5`).

use std::time::Duration;

/// Parses a user-written duration; the error names the value and the accepted forms.
pub fn parse(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let (number, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else {
        (t, 1.0)
    };
    match number.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(Duration::from_secs_f64(v * scale)),
        _ => Err(format!(
            "{text:?} is not a duration: write e.g. 10s, 500ms, 2m or 1.5"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms() {
        assert_eq!(parse("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse("1.5"), Ok(Duration::from_millis(1500)));
        assert!(parse("ten").unwrap_err().contains("\"ten\""));
        assert!(parse("-1s").is_err());
    }
}
