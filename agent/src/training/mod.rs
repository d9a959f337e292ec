//! The training side: what runs on the training thread, called by training code.
//!
//! - [`agent`]: [`Agent`], the handle training code holds (a cheap clone);
//! - `recorder`: the running agent of an active rank, which the handle, its step
//!   guards and its taps share;
//! - [`step`]: step and phase timing, the `steps` row;
//! - [`comm`]: collectives counted by kind, the `comm` rows;
//! - [`profile`]: the static model profile, the `model` rows;
//! - [`memory`]: RSS, and the accelerator allocator's bytes as the adapter reads
//!   them, for the `steps` row.
//!
//! The training side is the top of the agent's core: it may import every other part
//! (config, sampling, the budget, the transport), and none of them imports it; only
//! the adapters (with the `torch` feature, [`crate::torch`]) sit above it. Within it
//! the handle imports the others; step and profile import only the recorder (and step
//! comm), and the recorder only comm and memory.

pub mod agent;
pub mod comm;
pub mod memory;
pub mod profile;
pub(crate) mod recorder;
pub mod step;

pub use agent::Agent;

#[cfg(test)]
mod tests {
    //! docs/columns.md against the code: the numbers and names it quotes.

    use super::profile;
    use super::recorder::WORKER_QUEUE;
    use crate::budget::sampler::SECOND_STEP_BYTES;
    use crate::transport::TransportConfig;

    const COLUMNS_MD: &str = include_str!("../../../docs/columns.md");

    #[test]
    fn columns_doc_quotes_the_bounds_and_kinds_of_the_code() {
        let transport = TransportConfig::new("unused");
        for quoted in [
            format!("metrics queue ({WORKER_QUEUE} samples)"),
            format!("(twice that within {} MiB", SECOND_STEP_BYTES >> 20),
            format!(
                "row queue ({} rows)",
                group_digits(transport.queue_rows as u64)
            ),
            format!("memory ({} MiB", transport.outbox_bytes >> 20),
            format!(
                "({} GiB, `RANKSCOPE_SPILL_MAX_BYTES`",
                transport.spill_max_bytes >> 30
            ),
            "`VmRSS` of `/proc/self/status`".to_string(),
        ] {
            assert!(
                COLUMNS_MD.contains(&quoted),
                "docs/columns.md does not say {quoted:?}"
            );
        }
        for kind in crate::rows::event_kind::ALL {
            assert!(
                COLUMNS_MD.contains(&format!("| `{kind}` |")),
                "docs/columns.md lists no event kind {kind}"
            );
        }
        for kind in profile::MODEL_KINDS {
            assert!(
                COLUMNS_MD.contains(&format!("`{kind}`")),
                "docs/columns.md lists no model kind {kind}"
            );
        }
        let comm = &COLUMNS_MD[COLUMNS_MD.find("## `comm`").expect("a comm section")..];
        for kind in super::comm::CommKind::ALL {
            assert!(
                comm.contains(&format!("`{}`", kind.label())),
                "docs/columns.md's comm section lists no kind {}",
                kind.label()
            );
        }
    }

    /// 65536 as the docs write it: 65,536.
    fn group_digits(n: u64) -> String {
        let digits = n.to_string();
        let mut out = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i).is_multiple_of(3) {
                out.push(',');
            }
            out.push(c);
        }
        out
    }
}
