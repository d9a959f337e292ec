//! The live view end to end: the real collector binary with `--http` on
//! 127.0.0.1:0, ranks on the real protocol, `/live` read over real HTTP, and
//! `rankscope top --once` against it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use rankscope_tests::{CollectorProc, FAST_COMMITS, batch, bin, free_port, hello, open};

/// `GET path` over plain HTTP/1.1 with an optional `Authorization` header:
/// (status, body).
fn get(addr: &str, path: &str, auth: Option<&str>) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).expect("connect to --http");
    let auth = auth
        .map(|a| format!("Authorization: {a}\r\n"))
        .unwrap_or_default();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{auth}\r\n"
    )
    .expect("send the request");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .expect("read the response");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {response:?}"));
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

fn json(addr: &str, path: &str) -> serde_json::Value {
    let (status, body) = get(addr, path, None);
    assert_eq!(status, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"))
}

/// The step numbers each rank shows, by rank.
fn steps_of(run: &serde_json::Value) -> Vec<(u64, Vec<u64>)> {
    run["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|r| {
            let steps = r["steps"]
                .as_array()
                .expect("steps")
                .iter()
                .map(|s| s["step"].as_u64().expect("step"))
                .collect();
            (r["rank"].as_u64().expect("rank"), steps)
        })
        .collect()
}

fn top(args: &[&str]) -> (bool, String) {
    let output = Command::new(bin("rankscope"))
        .arg("top")
        .args(args)
        .env_remove("RANKSCOPE_TOKEN")
        .env_remove("RANKSCOPE_LIVE")
        .output()
        .expect("run rankscope top");
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    (output.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_view_follows_accepted_rows_and_top_shows_them() {
    let dir = tempfile::tempdir().unwrap();
    let args = [&["--http", "127.0.0.1:0"][..], &FAST_COMMITS[..]].concat();
    let collector = CollectorProc::start(dir.path(), &args);
    let http = collector.http.clone().expect("an ops address");
    assert_eq!(json(&http, "/live/runs")["runs"], serde_json::json!([]));

    let (mut r0, _) = open(&collector.addr, hello("live-1", 0)).await.unwrap();
    let (mut r1, _) = open(&collector.addr, hello("live-1", 1)).await.unwrap();
    r0.send(batch(1, 5, false)).await;
    r1.send(batch(1, 5, false)).await;
    // Acknowledged means accepted (and more): the view holds them by now.
    r0.acked(1).await;
    r1.acked(1).await;
    let runs = json(&http, "/live/runs");
    assert_eq!(runs["runs"][0]["run_id"], "live-1");
    assert_eq!(runs["runs"][0]["world_size"], 4);
    assert_eq!(runs["runs"][0]["ranks_seen"], 2);
    let run = json(&http, "/live/runs/live-1?steps=3");
    assert_eq!(
        steps_of(&run),
        [(0, vec![1002, 1003, 1004]), (1, vec![1002, 1003, 1004])]
    );
    assert_eq!(run["counters"]["step_rows"], 10);
    assert_eq!(run["ranks"][0]["steps"][0]["step_ms"], 1.0);

    // The next batch moves the steps on.
    r0.send(batch(2, 5, false)).await;
    r0.acked(2).await;
    let run = json(&http, "/live/runs/live-1?steps=2");
    assert_eq!(steps_of(&run)[0], (0, vec![2003, 2004]));
    assert_eq!(run["last_step"], 2004);

    // Bad requests are named.
    let (status, body) = get(&http, "/live/runs/nope", None);
    assert_eq!(status, 404);
    assert!(body.contains("live-1"), "names the runs it holds: {body}");
    let (status, body) = get(&http, "/live/runs/live-1?steps=lots", None);
    assert_eq!(status, 400);
    assert!(body.contains("steps=lots"), "{body}");

    // Server-sent events: the first event is the run as it is now.
    let mut events = TcpStream::connect(&http).unwrap();
    events
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        events,
        "GET /live/runs/live-1/events HTTP/1.1\r\nHost: {http}\r\n\r\n"
    )
    .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\n\n") {
        let n = events.read(&mut buf).expect("an event within 30 s");
        assert!(n > 0, "the stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&seen);
    assert!(text.contains("text/event-stream"), "{text}");
    assert!(text.contains("event: snapshot\ndata: {"), "{text}");
    assert!(text.contains("\"run_id\":\"live-1\""), "{text}");
    drop(events);

    // `top --once` merges a dead collector and a live one, and names the dead.
    let dead = format!("127.0.0.1:{}", free_port());
    let http_for_top = http.clone();
    let (ok, screen) = tokio::task::spawn_blocking(move || {
        top(&[
            "--once",
            "--collector",
            &format!("{dead},{http_for_top}"),
            "--width",
            "140",
            "--height",
            "30",
        ])
    })
    .await
    .unwrap();
    assert!(ok, "{screen}");
    assert!(screen.contains("run live-1"), "{screen}");
    assert!(screen.contains("collectors 1/2 answering"), "{screen}");
    assert!(screen.contains("cannot reach 127.0.0.1:"), "{screen}");
    let rank_rows = screen
        .lines()
        .filter(|l| l.starts_with('│') && (l.contains(" 2004 ") || l.contains(" 1004 ")))
        .count();
    assert_eq!(rank_rows, 2, "one row per rank:\n{screen}");

    // An unknown run: a clear message, no panic, a failing exit.
    let http_for_top = http.clone();
    let (ok, text) = tokio::task::spawn_blocking(move || {
        top(&["--once", "--collector", &http_for_top, "--run", "nope"])
    })
    .await
    .unwrap();
    assert!(!ok, "{text}");
    assert!(text.contains("no run \"nope\""), "{text}");
    assert!(text.contains("live-1"), "{text}");
    assert!(!text.contains("panicked"), "{text}");
    assert!(collector.stop());
}

#[test]
fn the_live_view_asks_for_the_collectors_token() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    let out = dir.path().join("out");
    let collector = CollectorProc::start(
        &out,
        &[
            "--http",
            "127.0.0.1:0",
            "--token-file",
            token.to_str().unwrap(),
        ],
    );
    let http = collector.http.clone().expect("an ops address");
    let (status, body) = get(&http, "/live/runs", None);
    assert_eq!(status, 401);
    assert!(body.contains("--token-file"), "{body}");
    assert_eq!(get(&http, "/live/runs", Some("Bearer wrong")).0, 401);
    assert_eq!(get(&http, "/live/runs", Some("Bearer s3cret")).0, 200);
    assert_eq!(get(&http, "/live/runs?token=s3cret", None).0, 200);
    // The ops figures hold no rows: they stay open to a scraper.
    assert_eq!(get(&http, "/metrics", None).0, 200);
    let (ok, text) = top(&["--once", "--collector", &http]);
    assert!(!ok, "{text}");
    assert!(text.contains("asks for its token"), "{text}");
    let (ok, text) = top(&[
        "--once",
        "--collector",
        &http,
        "--token-file",
        token.to_str().unwrap(),
    ]);
    assert!(!ok, "no run yet: {text}");
    assert!(text.contains("no run yet"), "{text}");
    assert!(collector.stop());
}
