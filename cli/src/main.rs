//! The `rankscope` binary: everything lives in the library (`lib.rs`).

fn main() -> anyhow::Result<()> {
    rankscope::run_from(std::env::args_os())
}
