//! Parses durations written as `10s`, `500ms`, `2m` or plain seconds (`1.5`).

use std::fmt;
use std::time::Duration;

/// A duration argument: parsed by [`parse`], shown in `--help` defaults as `10s` or
/// `500ms`, so clap's defaults can come from the library's own constants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arg(pub Duration);

impl fmt::Display for Arg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        if d.subsec_nanos() == 0 {
            write!(f, "{}s", d.as_secs())
        } else if d.subsec_nanos().is_multiple_of(1_000_000) {
            write!(f, "{}ms", d.as_millis())
        } else {
            write!(f, "{}", d.as_secs_f64())
        }
    }
}

/// [`parse`] as a clap value parser for [`Arg`].
pub fn parse_arg(text: &str) -> Result<Arg, String> {
    parse(text).map(Arg)
}

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
    let seconds = match number.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => v * scale,
        _ => {
            return Err(format!(
                "{text:?} is not a duration: write e.g. 10s, 500ms, 2m or 1.5"
            ));
        }
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| {
        format!(
            "{text:?} is too long a duration (at most {} seconds): write e.g. 10s, 500ms or 2m",
            u64::MAX
        )
    })
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
        assert!(parse("inf").is_err());
        assert!(parse("NaN").is_err());
    }

    #[test]
    fn shown_as_parsed() {
        for d in [
            Duration::from_secs(10),
            Duration::from_millis(1500),
            Duration::ZERO,
            Duration::from_micros(1),
        ] {
            assert_eq!(parse_arg(&Arg(d).to_string()), Ok(Arg(d)));
        }
        assert_eq!(Arg(Duration::from_secs(30)).to_string(), "30s");
    }

    #[test]
    fn huge_values_are_errors_not_panics() {
        for huge in ["1e20", "1e20s", "1e300m", "18446744073709551616"] {
            let err = parse(huge).unwrap_err();
            assert!(err.contains(huge) && err.contains("too long"), "{err}");
        }
        assert!(parse("1e9").is_ok());
    }
}
