//! Several "nodes" on one machine, joined by real network paths: Linux network
//! namespaces and veth links, made with iproute2's `ip` (root only).
//!
//! [`Star::make`] gives each node a namespace of its own and joins it by its own
//! veth pair to a hub namespace (where the collector runs): node `i` is
//! `10.77.<i>.2/24` and reaches the hub at `10.77.<i>.1`. [`Star::cut`] takes a
//! node's end of its link down (the kernel then drops that node's routes to the
//! hub, and its peer loses carrier), [`Star::restore`] brings it back.
//! [`Star::drop_connections`] makes the hub forget its TCP connections with a
//! node (`ss -K`), as a server does with a peer whose keepalive went unanswered.
//!
//! Namespace names carry the test process id, a counter and the clock, so
//! parallel test runs never share one; the veth devices live only inside the
//! namespaces. Dropping the [`Star`] deletes its namespaces, and with them their
//! veth links, even when the test panics.

use std::ffi::OsStr;
use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// A tool of iproute2 (`ip`, `ss`), wherever it was put (a PATH may lack the
/// sbin folders).
fn iproute2(name: &str) -> PathBuf {
    ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
        .iter()
        .map(|dir| PathBuf::from(dir).join(name))
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from(name))
}

/// `ip`.
pub fn ip() -> PathBuf {
    iproute2("ip")
}

/// Runs `ip ARGS...`; the error names the command and what it printed.
fn run_ip<S: AsRef<OsStr>>(args: &[S]) -> Result<(), String> {
    let shown = args
        .iter()
        .map(|a| a.as_ref().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let output = Command::new(ip())
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip {shown}` ({e}): install iproute2"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {shown}` failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// Prints `text` framed in stars straight to stderr: the test harness captures
/// `eprintln!` of a passing test, and a skipped check must be seen.
pub fn shout(text: &str) {
    let bar = "*".repeat(72);
    let _ = std::io::stderr().write_all(format!("\n{bar}\n{text}\n{bar}\n").as_bytes());
}

/// The veth device of every node, on both ends (each end in its own namespace).
const NODE_DEV: &str = "uplink";

/// Nodes joined to a hub, each by a veth link of its own.
#[derive(Debug)]
pub struct Star {
    /// The hub's namespace.
    pub hub: String,
    /// Each node's namespace.
    pub nodes: Vec<String>,
    /// Every namespace made so far, deleted on drop.
    made: Vec<String>,
}

impl Star {
    /// Makes the hub and `nodes` node namespaces and their links. Err says why
    /// not (not root, no `ip`, namespaces not allowed here); what was made by
    /// then is removed.
    pub fn make(nodes: usize) -> Result<Star, String> {
        static MADE: AtomicU32 = AtomicU32::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let tag = format!(
            "rankscope-{}-{}-{nanos:x}",
            std::process::id(),
            MADE.fetch_add(1, Ordering::Relaxed)
        );
        let mut star = Star {
            hub: format!("{tag}-hub"),
            nodes: (0..nodes).map(|i| format!("{tag}-node{i}")).collect(),
            made: Vec::new(),
        };
        for name in std::iter::once(star.hub.clone()).chain(star.nodes.clone()) {
            run_ip(&["netns", "add", &name])?;
            star.made.push(name.clone());
            run_ip(&["-n", &name, "link", "set", "lo", "up"])?;
        }
        for (i, node) in star.nodes.iter().enumerate() {
            let hub_dev = format!("{NODE_DEV}{i}");
            run_ip(&[
                "-n", node, "link", "add", NODE_DEV, "type", "veth", "peer", "name", &hub_dev,
                "netns", &star.hub,
            ])?;
            let node_addr = format!("{}/24", Self::node_addr(i));
            let hub_addr = format!("{}/24", Self::hub_addr(i));
            run_ip(&["-n", node, "addr", "add", &node_addr, "dev", NODE_DEV])?;
            run_ip(&["-n", &star.hub, "addr", "add", &hub_addr, "dev", &hub_dev])?;
            run_ip(&["-n", node, "link", "set", NODE_DEV, "up"])?;
            run_ip(&["-n", &star.hub, "link", "set", &hub_dev, "up"])?;
        }
        Ok(star)
    }

    /// [`Star::make`], or `None` after a loud SKIPPED message when namespaces
    /// cannot be made here (not root, no `ip`, a container without the
    /// privilege). Where the `CI` variable is set it panics instead: CI runs as
    /// root, and a test skipped there would pass without having run.
    pub fn make_or_skip(nodes: usize, test: &str) -> Option<Star> {
        match Star::make(nodes) {
            Ok(star) => Some(star),
            Err(why) if std::env::var_os("CI").is_some() => {
                panic!("{test}: cannot make network namespaces under CI: {why}")
            }
            Err(why) => {
                shout(&format!(
                    "SKIPPED {test}: cannot make network namespaces: {why}\n\
                     It needs root and iproute2 (`ip`); run `make test` as root to run it."
                ));
                None
            }
        }
    }

    /// Node `i`'s address.
    pub fn node_addr(i: usize) -> String {
        format!("10.77.{i}.2")
    }

    /// The hub's address as node `i` reaches it.
    pub fn hub_addr(i: usize) -> String {
        format!("10.77.{i}.1")
    }

    /// `inner` (program, arguments, environment, working directory) run inside
    /// namespace `netns` by `ip netns exec`, which execs it: the child's pid is
    /// the program's own, so signals reach it directly.
    pub fn exec_in(netns: &str, inner: &Command) -> Command {
        crate::wrapped(ip(), &["netns", "exec", netns], inner)
    }

    /// Takes node `i`'s end of its link down: nothing passes until [`Star::restore`].
    pub fn cut(&self, i: usize) {
        run_ip(&["-n", &self.nodes[i], "link", "set", NODE_DEV, "down"]).unwrap();
    }

    /// The hub destroys its TCP sockets with node `i` (`ss -K`, which sends a
    /// reset the node sees once packets pass again). Returns false where the
    /// kernel cannot destroy sockets (built without `CONFIG_INET_DIAG_DESTROY`):
    /// the connections are then still there.
    pub fn drop_connections(&self, i: usize) -> bool {
        let ss = |args: &[&str]| {
            let mut cmd = Command::new(iproute2("ss"));
            cmd.args(args).arg("dst").arg(Self::node_addr(i));
            let output = Self::exec_in(&self.hub, &cmd).output().expect("run ss");
            assert!(
                output.status.success(),
                "ss {args:?}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            String::from_utf8_lossy(&output.stdout).into_owned()
        };
        ss(&["-K", "-t"]);
        ss(&["-H", "-t", "-n"]).trim().is_empty()
    }

    /// Brings node `i`'s end of its link back up (its address and route return).
    pub fn restore(&self, i: usize) {
        run_ip(&["-n", &self.nodes[i], "link", "set", NODE_DEV, "up"]).unwrap();
    }
}

impl Drop for Star {
    fn drop(&mut self) {
        // A namespace's veth ends go with it, and each pair with either end.
        for name in self.made.iter().rev() {
            if let Err(e) = run_ip(&["netns", "del", name]) {
                eprintln!("could not remove network namespace {name}: {e}");
            }
        }
    }
}
