//! `rankscope report` and `rankscope compare` on real runs: `rankscope train` ranks
//! (the tch transformer) under `rankscope launch`, into the real collector binary. The page is loaded by a real headless Chromium, which must render the
//! sections and their SVG plots and take a screenshot.
//!
//! `make test` installs Chromium (Debian's `chromium` package) when it is missing.

use std::path::Path;
use std::process::{Command, Stdio};

use rankscope_tests::training::{SAMPLE_EVERY, launch, train, wait_ok};
use rankscope_tests::{CollectorProc, bin, chromium, rankscope};

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

/// Layers `rankscope train --model transformer` taps: embed, attn, mlp, head.
const LAYERS: usize = 4;
/// Rows of its model profile: the taps, plus ln1, ln2 and pos.
const MODEL_ROWS: usize = 7;
const STEPS: u64 = 100;

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

/// A 2-rank run of `STEPS` steps into `collector`.
fn two_ranks(collector: &CollectorProc, run_id: &str, spill: &Path) {
    let mut ranks = launch(2, &[], &train(&collector.addr, run_id, STEPS, spill, "30s"));
    wait_ok(
        ranks.spawn().expect("start rankscope launch"),
        "rankscope launch",
    );
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
    let spill = dir.path().join("spill");
    two_ranks(&collector, "second", &spill);
    two_ranks(&collector, "even", &spill);
    assert!(collector.stop());

    // The JSON summary of the second run.
    let page = dir.path().join("report.html");
    let summary = dir.path().join("report.json");
    let printed = rankscope(&[
        "report",
        out.to_str().unwrap(),
        "--run",
        "second",
        "--html",
        page.to_str().unwrap(),
        "--json",
        summary.to_str().unwrap(),
    ]);
    assert!(printed.contains("report: "), "{printed}");
    let r = json(&summary);
    assert_eq!(r["schema"], "rankscope.report");
    assert_eq!(r["schema_version"], 1);
    assert_eq!(r["run"]["run_id"], "second");
    assert_eq!(r["run"]["ranks_seen"], 2);
    assert_eq!(r["run"]["ranks_finished"], 2);
    assert_eq!(
        r["run"]["overhead_budget"], 1.0,
        "RANKSCOPE_OVERHEAD_BUDGET=100%"
    );
    let ranks = r["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2, "{r}");
    for rank in ranks {
        assert_eq!(rank["steps"], STEPS, "{rank}");
        for phase in ["step", "forward", "backward", "optimizer"] {
            let p = &rank["phases"][phase];
            let (p50, p95, p99) = (p["p50"].as_f64(), p["p95"].as_f64(), p["p99"].as_f64());
            assert!(p50 <= p95 && p95 <= p99, "{phase}: {p}");
        }
    }
    let layers = r["layers"].as_array().unwrap();
    assert_eq!(layers.len(), LAYERS, "{r}");
    for l in layers {
        assert_eq!(l["samples"], 2 * STEPS / SAMPLE_EVERY, "{l}");
        assert!(l["stable_rank"]["final"].as_f64().unwrap() >= 1.0, "{l}");
    }
    assert_eq!(r["model"].as_array().unwrap().len(), MODEL_ROWS);
    let first = r["loss"]["first"].as_f64().unwrap();
    let last = r["loss"]["final"].as_f64().unwrap();
    assert!(last < first, "the example's loss falls: {}", r["loss"]);
    for d in r["diagnoses"].as_array().unwrap() {
        assert!(d["kind"].is_string() && d["message"].is_string(), "{d}");
    }

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
    assert!(
        dom_text.contains("overhead budget: 100% of each process's CPU time"),
        "the overhead section states the run's budget"
    );
    let svgs = dom_text.matches("<svg").count();
    // loss, heatmap, phases, memory, overhead, and one per layer.
    assert!(svgs >= 5 + LAYERS, "{svgs} SVG plots in the rendered DOM");
    for l in r["layers"].as_array().unwrap() {
        let name = l["layer"].as_str().unwrap();
        assert!(
            dom_text.contains(&format!("data-layer=\"{name}\"")),
            "no plot of layer {name}"
        );
    }
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
    let text = rankscope(&["compare", "even", "second", "--out", out.to_str().unwrap()]);
    assert!(
        text.contains("A = even") && text.contains("B = second"),
        "{text}"
    );
    assert!(text.contains("step p50"), "{text}");
    let c: serde_json::Value = serde_json::from_str(&rankscope(&[
        "compare",
        "even",
        "second",
        "--out",
        out.to_str().unwrap(),
        "--json",
    ]))
    .expect("compare --json is JSON");
    assert_eq!(c["schema"], "rankscope.compare");
    let rows = c["rows"].as_array().unwrap();
    let layer_rows = rows.iter().filter(|r| r["section"] == "layers").count();
    assert_eq!(layer_rows, 2 * LAYERS, "{c}");
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

    // An unknown run is a clear error that lists the runs there are.
    let failed = Command::new(bin("rankscope"))
        .args(["report", out.to_str().unwrap(), "--run", "nope"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&failed.stderr);
    assert!(!failed.status.success(), "{err}");
    assert!(
        err.contains("run \"nope\" is not in") && err.contains("second"),
        "{err}"
    );
}
