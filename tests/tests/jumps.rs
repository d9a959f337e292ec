//! `rankscope jumps` end to end: the real binary on CSV files, its table, its
//! JSON, and its errors for files a user could really pass.

use std::path::Path;
use std::process::{Command, Output};

use rankscope_tests::{bin, rankscope};

/// Approximately standard normal noise, deterministic (xorshift, sum of 12 uniforms).
fn noise(state: &mut u64) -> f64 {
    let mut sum = 0.0;
    for _ in 0..12 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        sum += (*state >> 11) as f64 / (1u64 << 53) as f64;
    }
    sum - 6.0
}

/// A layer metric sampled every 10 steps: slow drift, then a drop of 8σ at step
/// 3000, as when a layer's representation collapses.
fn write_series(path: &Path) {
    let mut state = 0x2545_f491_4f6c_dd1d;
    let mut text = String::from("step,value\n");
    for i in 0..500u64 {
        let step = 10 * i;
        let level = if step >= 3000 { 12.0 } else { 20.0 };
        let value = level - 0.0004 * step as f64 + noise(&mut state);
        text += &format!("{step},{value}\n");
    }
    std::fs::write(path, text).unwrap();
}

fn run(args: &[&str]) -> Output {
    Command::new(bin("rankscope"))
        .args(args)
        .env("RANKSCOPE_LOG", "warn")
        .output()
        .expect("run rankscope")
}

/// Runs a command that must fail; returns its stderr.
fn fails(args: &[&str]) -> String {
    let out = run(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "rankscope {args:?} succeeded");
    assert!(
        !stderr.contains("panicked"),
        "rankscope {args:?} panicked:\n{stderr}"
    );
    stderr
}

#[test]
fn finds_the_planted_jump_in_table_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("fc1.csv");
    write_series(&file);
    let file = file.to_str().unwrap();

    let text = rankscope(&["jumps", file]);
    println!("{text}");
    let rows: Vec<&str> = text
        .lines()
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() == 6 && f[0].parse::<u64>().is_ok() && ["up", "down"].contains(&f[1])
        })
        .collect();
    assert_eq!(rows.len(), 1, "one jump expected:\n{text}");
    let fields: Vec<&str> = rows[0].split_whitespace().collect();
    assert_eq!(&fields[..2], ["3000", "down"], "{text}");
    let size: f64 = fields[2].parse().unwrap();
    assert!(
        (6.0..10.0).contains(&size),
        "size {size} noise units, planted 8"
    );
    assert!(text.contains("1 jump in 500 points"), "{text}");

    let json = rankscope(&["jumps", file, "--json"]);
    let json = json.trim();
    assert!(json.starts_with('[') && json.ends_with(']'), "{json}");
    assert_eq!(json.matches("\"step\":").count(), 1, "{json}");
    assert!(json.contains("\"step\": 3000,"), "{json}");
    assert!(json.contains("\"direction\": \"down\""), "{json}");
    assert!(json.contains("\"confidence\":"), "{json}");
}

#[test]
fn a_series_without_jumps_prints_none() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("flat.csv");
    let mut state = 7;
    let mut text = String::from("step,value\n");
    for step in 0..300 {
        text += &format!("{step},{}\n", 0.01 * step as f64 + noise(&mut state));
    }
    std::fs::write(&file, text).unwrap();
    let file = file.to_str().unwrap();
    assert!(rankscope(&["jumps", file]).contains("no jumps in 300 points"));
    assert_eq!(rankscope(&["jumps", file, "--json"]).trim(), "[]");
}

#[test]
fn bad_input_is_an_error_that_names_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_string()
    };
    let missing = dir.path().join("missing.csv");
    let e = fails(&["jumps", missing.to_str().unwrap()]);
    assert!(
        e.contains("missing.csv") && e.contains("No such file"),
        "{e}"
    );

    let e = fails(&["jumps", &write("header.csv", "step,loss\n1,2\n")]);
    assert!(e.contains("header `step,value`"), "{e}");

    let e = fails(&["jumps", &write("value.csv", "step,value\n1,0.5\n2,oops\n")]);
    assert!(
        e.contains("line 3") && e.contains("\"oops\" is not a number"),
        "{e}"
    );

    let e = fails(&[
        "jumps",
        &write("unsorted.csv", "step,value\n1,0.5\n3,0.1\n2,0.7\n"),
    ]);
    assert!(
        e.contains("line 4") && e.contains("step 2 comes after step 3"),
        "{e}"
    );

    let e = fails(&[
        "jumps",
        &write("duplicate.csv", "step,value\n1,0.5\n1,0.6\n"),
    ]);
    assert!(e.contains("step 1 appears twice (lines 2 and 3)"), "{e}");

    let e = fails(&["jumps", &write("empty.csv", "step,value\n")]);
    assert!(e.contains("empty.csv has no rows under its header"), "{e}");

    let e = fails(&[
        "jumps",
        &write("ok.csv", "step,value\n1,0.5\n"),
        "--window",
        "2",
    ]);
    assert!(e.contains("--window 2"), "{e}");
}

#[test]
fn help_has_examples() {
    let out = run(&["jumps", "--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("Examples:") && help.contains("rankscope jumps"),
        "{help}"
    );
    assert!(help.contains("step,value"), "{help}");
}
