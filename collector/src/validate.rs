//! Checks on everything that arrives from the network, before it touches memory
//! bounds or the filesystem. Every error names the bad value and the fix.

#[cfg(any(test, feature = "fuzzing"))]
use rankscope_proto::MAX_EVENT_MESSAGE_BYTES;
#[cfg(any(test, feature = "fuzzing"))]
use rankscope_proto::v1::Batch;
use rankscope_proto::v1::Hello;
use rankscope_proto::{MAX_LABEL_BYTES, MAX_ROWS_PER_BATCH, MAX_RUN_ID_LEN, SCHEMA_MAJOR};

/// Why a stream was refused.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum Invalid {
    #[error(
        "run id {0:?} is not allowed: use 1 to {MAX_RUN_ID_LEN} characters of letters, digits, '.', '_' or '-', starting with a letter or digit, without '..'"
    )]
    RunId(String),
    #[error(
        "schema major version {0} is not supported: this collector speaks {SCHEMA_MAJOR}; run agent and collector of the same major release"
    )]
    Schema(u32),
    #[error("rank {rank} is not below world_size {world_size}: check RANK and WORLD_SIZE")]
    Rank { rank: u32, world_size: u32 },
    #[error("{field} of {len} bytes is too long (at most {max})")]
    TooLong {
        field: &'static str,
        len: usize,
        max: usize,
    },
    #[error("{field} {value:?} contains control characters")]
    Control { field: &'static str, value: String },
    #[error("batch of {0} rows is too large (at most {MAX_ROWS_PER_BATCH}): send smaller batches")]
    TooManyRows(usize),
    /// A `layer_columns` entry that cannot be read as rows.
    #[error("{0}")]
    Columns(#[from] rankscope_proto::columns::ColumnsError),
}

/// Checks a run id before it names a folder: no separators, no `..`, bounded.
pub fn run_id(id: &str) -> Result<(), Invalid> {
    let ok = rankscope_proto::is_valid_run_id(id);
    if ok {
        Ok(())
    } else {
        let shown: String = id.chars().take(MAX_RUN_ID_LEN + 8).collect();
        Err(Invalid::RunId(shown))
    }
}

/// Checks a stream's opening message.
pub fn hello(h: &Hello) -> Result<(), Invalid> {
    if h.schema_major != SCHEMA_MAJOR {
        return Err(Invalid::Schema(h.schema_major));
    }
    run_id(&h.run_id)?;
    if h.rank >= h.world_size {
        return Err(Invalid::Rank {
            rank: h.rank,
            world_size: h.world_size,
        });
    }
    label("hostname", &h.hostname, MAX_LABEL_BYTES)?;
    label("agent_version", &h.agent_version, MAX_LABEL_BYTES)
}

/// Checks the sizes and labels of a prost-decoded batch: the reference for the
/// checks the wire decoder makes as it reads a batch ([`crate::table::TableBuilder`]
/// runs [`label`] and [`at_most`] on the columns `table` marks), for the tests and
/// the fuzz targets, which compare the two.
#[cfg(any(test, feature = "fuzzing"))]
pub fn batch(b: &Batch) -> Result<(), Invalid> {
    let rows = b.rows();
    if rows > MAX_ROWS_PER_BATCH {
        return Err(Invalid::TooManyRows(rows));
    }
    for l in &b.layers {
        label("layer", &l.layer, MAX_LABEL_BYTES)?;
        label("conv_layout", &l.conv_layout, MAX_LABEL_BYTES)?;
        label("method", &l.method, MAX_LABEL_BYTES)?;
    }
    for m in &b.model {
        label("layer", &m.layer, MAX_LABEL_BYTES)?;
        label("kind", &m.kind, MAX_LABEL_BYTES)?;
        label("output_shape", &m.output_shape, MAX_LABEL_BYTES)?;
    }
    for e in &b.events {
        label("kind", &e.kind, MAX_LABEL_BYTES)?;
        at_most("message", &e.message, MAX_EVENT_MESSAGE_BYTES)?;
    }
    for c in &b.comm {
        label("kind", &c.kind, MAX_LABEL_BYTES)?;
    }
    for r in &b.runs {
        label("layer_filter", &r.layer_filter, MAX_LABEL_BYTES)?;
        label("agent_version", &r.agent_version, MAX_LABEL_BYTES)?;
        label("workload", &r.workload, MAX_LABEL_BYTES)?;
    }
    for r in &b.ranks {
        label("hostname", &r.hostname, MAX_LABEL_BYTES)?;
    }
    Ok(())
}

/// Checks a free-text value's size: at most `max` bytes.
pub fn at_most(field: &'static str, value: &str, max: usize) -> Result<(), Invalid> {
    if value.len() > max {
        return Err(Invalid::TooLong {
            field,
            len: value.len(),
            max,
        });
    }
    Ok(())
}

/// Checks a label (a name users read in tables and terminals): at most `max`
/// bytes, no control characters.
pub fn label(field: &'static str, value: &str, max: usize) -> Result<(), Invalid> {
    at_most(field, value, max)?;
    // Printable ASCII (nearly every label) passes in one pass over the bytes;
    // any other ASCII byte is a control character; the rest is checked char by
    // char.
    let control = if value.bytes().all(|b| (b' '..=b'~').contains(&b)) {
        false
    } else if value.is_ascii() {
        true
    } else {
        value.chars().any(char::is_control)
    };
    if control {
        return Err(Invalid::Control {
            field,
            value: value.escape_debug().take(64).collect(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rankscope_proto::v1::LayerRow;

    #[test]
    fn run_ids() {
        for good in ["run", "r-1", "2026-11-22_a.b", &"x".repeat(MAX_RUN_ID_LEN)] {
            assert_eq!(run_id(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "..",
            "a/../b",
            "/etc",
            "a/b",
            "a\\b",
            ".hidden",
            "-x",
            "a..b",
            "run id",
            "ü",
            "a\0b",
            &"x".repeat(MAX_RUN_ID_LEN + 1),
        ] {
            let err = run_id(bad).unwrap_err().to_string();
            assert!(err.contains("is not allowed"), "{bad}: {err}");
        }
    }

    #[test]
    fn hello_checks_schema_and_rank() {
        let mut h = Hello {
            run_id: "r".into(),
            rank: 0,
            world_size: 1,
            schema_major: SCHEMA_MAJOR,
            ..Default::default()
        };
        assert_eq!(hello(&h), Ok(()));
        h.schema_major = 2;
        assert!(hello(&h).unwrap_err().to_string().contains("speaks 1"));
        h.schema_major = SCHEMA_MAJOR;
        h.rank = 1;
        assert!(hello(&h).unwrap_err().to_string().contains("WORLD_SIZE"));
    }

    #[test]
    fn batch_labels_are_bounded() {
        let mut b = Batch::default();
        b.layers.push(LayerRow {
            layer: "x".repeat(MAX_LABEL_BYTES + 1),
            ..Default::default()
        });
        assert!(matches!(batch(&b), Err(Invalid::TooLong { .. })));
        b.layers[0].layer = "bad\u{1b}[31m".into();
        assert!(matches!(batch(&b), Err(Invalid::Control { .. })));
        b.layers[0].layer = "encoder.layers.0.attn".into();
        assert_eq!(batch(&b), Ok(()));
    }
}
