//! The live view as a person uses it, while a real PyTorch DDP job (the
//! package's example under the real `torchrun`) trains with one slow rank into
//! the real collector binary: `rankscope top` in a real terminal (tmux), and the
//! `/live` page in a real headless Chromium.
//!
//! `make test` installs tmux and Chromium (Debian's packages) and the Python
//! package first.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rankscope_tests::training::{ddp_example as torchrun, one_ddp_job};
use rankscope_tests::{CollectorProc, bin, chromium, signal, signal_group};

/// The longest the test waits for something to show; a failure, not a timing.
const LIMIT: Duration = Duration::from_secs(180);

fn tmux(args: &[&str]) -> std::process::Output {
    Command::new("tmux")
        .args(args)
        .output()
        .expect("run tmux (`make test` installs it: apt-get install tmux)")
}

/// A tmux session running one command on a server of its own (`-L`), so the
/// test never touches a user's sessions.
struct Session {
    socket: String,
}

impl Session {
    fn start(command: &str, width: u16, height: u16) -> Session {
        let socket = format!("rankscope-top-{}", std::process::id());
        let out = tmux(&[
            "-L",
            &socket,
            "new-session",
            "-d",
            "-s",
            "top",
            "-x",
            &width.to_string(),
            "-y",
            &height.to_string(),
            command,
        ]);
        assert!(
            out.status.success(),
            "tmux new-session: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Session { socket }
    }

    /// The screen as text.
    fn capture(&self) -> String {
        let out = tmux(&["-L", &self.socket, "capture-pane", "-p", "-t", "top"]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn keys(&self, keys: &str) {
        tmux(&["-L", &self.socket, "send-keys", "-t", "top", keys]);
    }

    fn alive(&self) -> bool {
        tmux(&["-L", &self.socket, "has-session", "-t", "top"])
            .status
            .success()
    }

    /// Waits until the screen satisfies `ok`; panics with the last screen after
    /// [`LIMIT`].
    fn wait_for(&self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let screen = self.capture();
            if ok(&screen) {
                return screen;
            }
            assert!(self.alive(), "top exited; its last screen:\n{screen}");
            assert!(
                start.elapsed() < LIMIT,
                "top never showed {what}; its screen:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = tmux(&["-L", &self.socket, "kill-server"]);
    }
}

/// Headless Chromium on `url`, then `args`' output (a screenshot, the DOM). The
/// page is asked to stop after two updates from its event stream (`snapshots=2`):
/// the browser's virtual clock, which decides when the screenshot is taken,
/// waits while a request is open.
fn browser(url: &str, profile: &Path, args: &[&str]) -> String {
    let out = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            "--window-size=1280,1400",
            "--virtual-time-budget=2000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(url)
        .stdin(Stdio::null())
        .output()
        .expect("run chromium");
    assert!(
        out.status.success(),
        "chromium {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The step shown in the row of `rank` (the ranks table's rows start with `│`
/// and the rank).
fn step_of(screen: &str, rank: u32) -> Option<u64> {
    screen.lines().find_map(|line| {
        let mut cells = line.trim_start_matches('│').split_whitespace();
        (cells.next()? == rank.to_string())
            .then(|| cells.next()?.parse().ok())
            .flatten()
    })
}

/// The torchrun job, in a process group of its own; stopped with every rank
/// when dropped, so a failed test leaves no ranks behind. torchrun starts its
/// ranks in sessions of their own, outside its group: SIGTERM to torchrun
/// stops them, and only a torchrun that does not exit is killed with its group.
struct Job(Child);

impl Job {
    fn still_running(&mut self) -> bool {
        self.0.try_wait().expect("poll torchrun").is_none()
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        signal(self.0.id(), "TERM");
        let start = Instant::now();
        while start.elapsed() < LIMIT {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        signal_group(self.0.id(), "KILL");
        let _ = self.0.wait();
    }
}

#[test]
fn top_shows_every_rank_advancing_and_names_the_straggler_while_the_job_runs() {
    let _one = one_ddp_job();
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &["--http", "127.0.0.1:0"]);
    let http = collector.http.clone().expect("an ops address");
    let mut job = torchrun(
        &["--standalone", "--nproc-per-node", "2"],
        &["--steps", "100000", "--slow-rank", "1", "--slow-ms", "40"],
        &[
            ("RANKSCOPE_COLLECTOR", &collector.addr),
            ("RANKSCOPE_RUN_ID", "top-ddp"),
            ("RANKSCOPE_MODE", "steps"),
        ],
    );
    // Its own process group, so the test can stop torchrun and its ranks.
    std::os::unix::process::CommandExt::process_group(&mut job, 0);
    let mut job = Job(job
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start torchrun"));
    let command = format!(
        "{} top --collector {http} --interval 500ms",
        bin("rankscope").display()
    );
    let session = Session::start(&command, 160, 45);

    let first = session.wait_for("both ranks' rows", |s| {
        step_of(s, 0).is_some() && step_of(s, 1).is_some()
    });
    assert!(first.contains("run top-ddp"), "{first}");
    let (a0, a1) = (step_of(&first, 0).unwrap(), step_of(&first, 1).unwrap());
    let later = session.wait_for("the steps advancing", |s| {
        step_of(s, 0).is_some_and(|s0| s0 > a0) && step_of(s, 1).is_some_and(|s1| s1 > a1)
    });
    println!("first capture:\n{first}\nlater capture:\n{later}");

    let named = session.wait_for("the straggler", |s| s.contains("rank 1 is the straggler"));
    assert!(
        job.still_running(),
        "the straggler must be named while the job runs:\n{named}"
    );
    assert!(
        named.contains("[step "),
        "with the step it fired at:\n{named}"
    );
    assert!(
        !named.contains("rank 0 is the straggler"),
        "the fast rank named:\n{named}"
    );

    // The page, in a real browser, while the job still runs: one row per rank,
    // the straggler named, and its values moving between two screenshots.
    let url = format!("http://{http}/live?snapshots=2");
    let profile = dir.path().join("chromium-profile");
    let start = Instant::now();
    let dom = loop {
        let dom = browser(&url, &profile, &["--dump-dom"]);
        if dom.contains("rank 1 is the straggler") || start.elapsed() > LIMIT {
            break dom;
        }
    };
    assert!(
        dom.contains("rank 1 is the straggler"),
        "the page never named the straggler:\n{dom}"
    );
    assert_eq!(
        dom.matches("<tr data-rank=").count(),
        2,
        "one row per rank:\n{dom}"
    );
    assert!(job.still_running(), "the page was read after the job ended");
    let shots: Vec<Vec<u8>> = ["first.png", "second.png"]
        .iter()
        .map(|name| {
            let path = dir.path().join(name);
            browser(
                &url,
                &profile,
                &[&format!("--screenshot={}", path.display())],
            );
            std::fs::read(&path).expect("chromium wrote the screenshot")
        })
        .collect();
    assert!(shots[0].len() > 10_000, "a blank screenshot");
    assert_ne!(
        shots[0], shots[1],
        "the page did not change between two screenshots"
    );

    // `s` re-sorts; `q` quits and gives the terminal back.
    session.keys("s");
    session.wait_for("the new sort", |s| s.contains("sort (now: comm ms"));
    session.keys("q");
    let start = Instant::now();
    while session.alive() {
        assert!(start.elapsed() < LIMIT, "top did not quit on q");
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(job);
    assert!(collector.stop());
}
