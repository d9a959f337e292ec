//! `rankscope report` and `rankscope compare` on real runs: PyTorch DDP ranks of the
//! Python package's example under the real `torchrun`, into the real collector
//! binary. The page is loaded by a real headless Chromium, which must render the
//! sections and their SVG plots and take a screenshot.
//!
//! `make test` installs Chromium (Debian's `chromium` package) when it is missing.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rankscope_tests::training::{ddp_example, run_ok};
use rankscope_tests::{CollectorProc, bin, count, rankscope};

/// The sections the page must have, by element id.
const SECTIONS: [&str; 8] = [
    "diagnoses",
    "loss",
    "step-time",
    "phases",
    "memory",
    "overhead",
    "layers",
    "model",
];

/// Layers `watch` finds in the example's default model (see ddp.rs).
const GPT_LAYERS: usize = 2 + 2 * 6 + 2;

fn chromium() -> PathBuf {
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        if let Ok(out) = Command::new("sh")
            .args(["-c", &format!("command -v {name}")])
            .output()
            && out.status.success()
        {
            return PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        }
    }
    panic!(
        "no headless browser: `make test` installs Debian's chromium package (apt-get install chromium)"
    );
}

/// Headless Chromium on a local file, with a profile of its own.
fn browser(page: &Path, profile: &Path, args: &[&str]) -> std::process::Output {
    Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(format!("file://{}", page.display()))
        .stdin(Stdio::null())
        .output()
        .expect("run chromium")
}

/// A 2-rank DDP run of `steps` steps into `collector`, rank 1 sleeping
/// `slow_ms` in each forward.
fn ddp_run(collector: &CollectorProc, run_id: &str, steps: u32, slow_ms: u32) {
    run_ok(ddp_example(
        &["--standalone", "--nproc-per-node", "2"],
        &[
            "--steps",
            &steps.to_string(),
            "--slow-rank",
            "1",
            "--slow-ms",
            &slow_ms.to_string(),
        ],
        &[
            ("RANKSCOPE_COLLECTOR", &collector.addr),
            ("RANKSCOPE_RUN_ID", run_id),
            ("RANKSCOPE_SAMPLE_EVERY", "5"),
        ],
    ));
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("the JSON was written"))
        .expect("valid JSON")
}

#[test]
fn the_report_renders_in_a_real_browser_and_compare_shows_directions() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let collector = CollectorProc::start(&out, &["--max-file-age", "1s"]);
    ddp_run(&collector, "straggler", 80, 30);
    ddp_run(&collector, "even", 80, 0);
    assert!(collector.stop());

    // The JSON summary of the straggler run.
    let page = dir.path().join("report.html");
    let summary = dir.path().join("report.json");
    let printed = rankscope(&[
        "report",
        out.to_str().unwrap(),
        "--run",
        "straggler",
        "--html",
        page.to_str().unwrap(),
        "--json",
        summary.to_str().unwrap(),
    ]);
    assert!(printed.contains("report: "), "{printed}");
    let r = json(&summary);
    assert_eq!(r["schema"], "rankscope.report");
    assert_eq!(r["schema_version"], 1);
    assert_eq!(r["run"]["run_id"], "straggler");
    assert_eq!(r["run"]["ranks_seen"], 2);
    assert_eq!(r["run"]["ranks_finished"], 2);
    let ranks = r["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2, "{r}");
    for rank in ranks {
        assert_eq!(rank["steps"], 80, "{rank}");
        for phase in ["step", "forward", "backward", "comm"] {
            let p = &rank["phases"][phase];
            let (p50, p95, p99) = (p["p50"].as_f64(), p["p95"].as_f64(), p["p99"].as_f64());
            assert!(p50 <= p95 && p95 <= p99, "{phase}: {p}");
        }
    }
    let layers = r["layers"].as_array().unwrap();
    assert_eq!(layers.len(), GPT_LAYERS, "{r}");
    for l in layers {
        assert_eq!(l["samples"], 2 * 16, "{l}"); // 2 ranks × steps 0, 5, …, 75
        assert!(l["stable_rank"]["final"].as_f64().unwrap() >= 1.0, "{l}");
    }
    assert_eq!(r["model"].as_array().unwrap().len(), GPT_LAYERS);
    let first = r["loss"]["first"].as_f64().unwrap();
    let last = r["loss"]["final"].as_f64().unwrap();
    assert!(last < first, "the example's loss falls: {}", r["loss"]);
    // Rank 1 sleeps 30 ms in every forward: it is the straggler, in that phase.
    let straggler = r["diagnoses"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["kind"] == "straggler")
        .unwrap_or_else(|| panic!("no straggler diagnosis: {}", r["diagnoses"]));
    assert_eq!(straggler["rank"], 1, "{straggler}");
    assert_eq!(straggler["phase"], "forward", "{straggler}");

    // The page in a real browser: every section, a plot in each, one per layer.
    let profile = dir.path().join("chromium-profile");
    let dom = browser(&page, &profile, &["--dump-dom"]);
    let dom_text = String::from_utf8_lossy(&dom.stdout);
    assert!(
        dom.status.success() && dom_text.contains("</html>"),
        "chromium --dump-dom failed: {}",
        String::from_utf8_lossy(&dom.stderr)
    );
    for id in SECTIONS {
        assert!(
            dom_text.contains(&format!("<section id=\"{id}\">")),
            "section {id} missing from the rendered DOM"
        );
    }
    let svgs = dom_text.matches("<svg").count();
    // loss, heatmap, phases, memory, overhead, and one per layer.
    assert!(
        svgs > 5 + GPT_LAYERS,
        "{svgs} SVG plots in the rendered DOM"
    );
    assert!(
        dom_text.contains("data-layer=\"blocks.0.attn.qkv\""),
        "layer plots missing"
    );
    assert!(
        !dom_text.contains("<script"),
        "the page must not need a script"
    );

    let png = dir.path().join("report.png");
    let shot = browser(
        &page,
        &profile,
        &[
            &format!("--screenshot={}", png.display()),
            "--window-size=1100,2400",
        ],
    );
    assert!(
        shot.status.success(),
        "chromium --screenshot failed: {}",
        String::from_utf8_lossy(&shot.stderr)
    );
    let bytes = std::fs::read(&png).expect("the screenshot was written");
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(
        bytes.len() > 20_000,
        "a blank screenshot? {} bytes",
        bytes.len()
    );

    // compare: both runs side by side, each difference with its direction.
    let text = rankscope(&[
        "compare",
        "even",
        "straggler",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        text.contains("A = even") && text.contains("B = straggler"),
        "{text}"
    );
    assert!(text.contains("step p50"), "{text}");
    let c: serde_json::Value = serde_json::from_str(&rankscope(&[
        "compare",
        "even",
        "straggler",
        "--out",
        out.to_str().unwrap(),
        "--json",
    ]))
    .expect("compare --json is JSON");
    assert_eq!(c["schema"], "rankscope.compare");
    let rows = c["rows"].as_array().unwrap();
    let layer_rows = rows.iter().filter(|r| r["section"] == "layers").count();
    assert_eq!(layer_rows, 2 * GPT_LAYERS, "{c}");
    for row in rows
        .iter()
        .filter(|r| !r["a"].is_null() && !r["b"].is_null())
    {
        let (a, b) = (row["a"].as_f64().unwrap(), row["b"].as_f64().unwrap());
        let expected = if (b - a).abs() <= 0.005 * a.abs() {
            "same"
        } else if b > a {
            "up"
        } else {
            "down"
        };
        assert_eq!(row["direction"], expected, "{row}");
    }
    assert!(
        c["diagnoses_b"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k == "straggler"),
        "{c}"
    );

    // An unknown run is a clear error that lists the runs there are.
    let failed = Command::new(bin("rankscope"))
        .args(["report", out.to_str().unwrap(), "--run", "nope"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&failed.stderr);
    assert!(!failed.status.success(), "{err}");
    assert!(
        err.contains("run \"nope\" is not in") && err.contains("straggler"),
        "{err}"
    );
}

#[test]
fn the_report_works_while_the_run_is_still_going() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let collector = CollectorProc::start(&out, &["--max-file-age", "1s"]);
    let mut ranks = ddp_example(
        &["--standalone", "--nproc-per-node", "2"],
        &["--steps", "100000"],
        &[
            ("RANKSCOPE_COLLECTOR", &collector.addr),
            ("RANKSCOPE_RUN_ID", "live"),
            ("RANKSCOPE_SAMPLE_EVERY", "5"),
        ],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .process_group(0)
    .spawn()
    .expect("start torchrun");
    // Wait for committed rows of both ranks' steps and of the layers.
    let deadline = Instant::now() + Duration::from_secs(120);
    while count(&out, "steps", "true") < 40 || count(&out, "layers", "true") == 0 {
        assert!(Instant::now() < deadline, "no rows committed in 120 s");
        assert!(
            ranks.try_wait().unwrap().is_none(),
            "the ranks exited early"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let summary = dir.path().join("live.json");
    rankscope(&[
        "report",
        out.to_str().unwrap(),
        "--json",
        summary.to_str().unwrap(),
    ]);
    let default_page = out.join("report-live.html");
    rankscope(&["report", out.to_str().unwrap()]);
    // The run goes on: stop it (the whole process group) now.
    let _ = Command::new("kill")
        .args(["-KILL", &format!("-{}", ranks.id())])
        .status();
    let _ = ranks.wait();
    let r = json(&summary);
    assert_eq!(r["run"]["run_id"], "live");
    assert_eq!(r["run"]["ranks_finished"], 0, "{}", r["run"]);
    assert!(
        r["run"]["last_step"].as_u64().unwrap() >= 10,
        "{}",
        r["run"]
    );
    assert!(!r["ranks"].as_array().unwrap().is_empty());
    let page = std::fs::read_to_string(&default_page).expect("the default page path");
    assert!(page.contains("covers the rows committed so far"));
    collector.kill();
}
