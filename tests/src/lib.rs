//! Harness for the end-to-end tests: starts the real `rankscope` binary, and
//! queries its output with the real DuckDB CLI.
//!
//! Layout:
//! - [`bin`]: where the built binaries and the venv's tools are;
//! - [`CollectorProc`]: a collector process on 127.0.0.1:0 with its own directory;
//! - [`duckdb`]: queries run through the `duckdb` command.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// A binary built next to the running test (`target/<profile>/<name>`).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built: run `make test` (or `cargo build --workspace --bins` first)",
        path.display()
    );
    path
}

/// A tool of the project venv (`duckdb`, `torchrun`), or from PATH.
pub fn tool(name: &str) -> PathBuf {
    let venv = workspace().join(".venv/bin").join(name);
    if venv.exists() {
        venv
    } else {
        PathBuf::from(name)
    }
}

/// A collector process on 127.0.0.1 with a port of its own.
pub struct CollectorProc {
    pub addr: String,
    pub out: PathBuf,
    child: Child,
}

impl CollectorProc {
    /// Starts `rankscope collector --listen 127.0.0.1:0 --out OUT ARGS...`.
    pub fn start(out: &Path, args: &[&str]) -> CollectorProc {
        Self::start_on("127.0.0.1:0", out, args)
    }

    /// Starts the collector on a given address (for restarts on the same port).
    pub fn start_on(listen: &str, out: &Path, args: &[&str]) -> CollectorProc {
        let mut child = Command::new(bin("rankscope"))
            .args(["collector", "--listen", listen, "--out"])
            .arg(out)
            .args(args)
            .env("RANKSCOPE_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start rankscope collector");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut lines = BufReader::new(stdout).lines();
        let first = lines
            .next()
            .expect("collector printed its address")
            .expect("utf-8");
        let addr = first
            .split_whitespace()
            .find(|w| w.starts_with("127.0.0.1:"))
            .unwrap_or_else(|| panic!("no address in {first:?}"))
            .trim_end_matches(',')
            .to_string();
        // Keep draining stdout so the collector never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        CollectorProc {
            addr,
            out: out.to_path_buf(),
            child,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, then waits for exit; returns whether it exited 0.
    pub fn stop(mut self) -> bool {
        signal(self.child.id(), "TERM");
        wait_for(&mut self.child, Duration::from_secs(60))
    }

    /// SIGKILL: a crash.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for CollectorProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends a signal by name to a process.
pub fn signal(pid: u32, name: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status();
}

fn wait_for(child: &mut Child, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Ok(Some(status)) = child.try_wait() {
            return status.success();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    false
}

/// Runs `sql` in the DuckDB CLI and returns its CSV output without header.
pub fn duckdb(sql: &str) -> String {
    let output = Command::new(tool("duckdb"))
        .args(["-csv", "-noheader", "-c", sql])
        .output()
        .expect("run the duckdb CLI (make setup installs it)");
    assert!(
        output.status.success(),
        "duckdb failed on {sql}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("utf-8")
}

/// `read_parquet(...)` of one table of an output directory.
pub fn table(out: &Path, name: &str) -> String {
    format!(
        "read_parquet('{}/{name}/*/*.parquet', hive_partitioning=true, union_by_name=true)",
        out.display()
    )
}

/// `select count(*)` of a table, with an optional `where` clause.
pub fn count(out: &Path, name: &str, filter: &str) -> u64 {
    let filter = if filter.is_empty() {
        String::new()
    } else {
        format!(" where {filter}")
    };
    duckdb(&format!(
        "select count(*) from {}{filter}",
        table(out, name)
    ))
    .trim()
    .parse()
    .expect("a count")
}

/// Rows of `select rank, count(*) ... group by rank order by rank`.
pub fn count_by_rank(out: &Path, name: &str) -> Vec<(u32, u64)> {
    duckdb(&format!(
        "select rank, count(*) from {} group by rank order by rank",
        table(out, name)
    ))
    .lines()
    .map(|l| {
        let (r, c) = l.split_once(',').expect("rank,count");
        (r.parse().expect("rank"), c.parse().expect("count"))
    })
    .collect()
}

/// Runs the real binary with arguments; panics with its output on failure.
pub fn rankscope(args: &[&str]) -> String {
    let output = Command::new(bin("rankscope"))
        .args(args)
        .env("RANKSCOPE_LOG", "warn")
        .output()
        .expect("run rankscope");
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "rankscope {args:?} failed:\n{text}"
    );
    text
}
