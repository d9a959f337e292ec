//! Real PyTorch DDP ranks: the `rankscope` Python package (the same Rust agent)
//! inside `rankscope.examples.ddp_train` (python/rankscope/examples/ddp_train.py), launched by the real `torchrun`,
//! into the real collector binary, checked with the real DuckDB CLI.
//!
//! `make test` installs the package into `.venv` before the tests run.

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::Duration;

use rankscope_tests::training::{ddp_example as torchrun, one_ddp_job, run_ok as run};
use rankscope_tests::{CollectorProc, count, count_by_rank, duckdb, free_port, random_ms, table};

/// Layers `watch` finds in the example's default model (2 blocks): tok, pos, then
/// per block ln1, attn.qkv, attn.proj, ln2, mlp.0, mlp.2, then ln_f and head.
const GPT_LAYERS: u64 = 2 + 2 * 6 + 2;

/// A plain HTTP/1.1 GET of the collector's ops endpoint; the response body.
fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to --http");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("send the request");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .expect("read the response");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response
}

fn result(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).expect("the script wrote its result");
    serde_json::from_str(&text).expect("result JSON")
}

#[test]
fn four_ddp_ranks_land_a_complete_grid_and_stay_in_sync() {
    let _one = one_ddp_job();
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &[]);
    let res = dir.path().join("result.json");
    let steps = 30;
    run(torchrun(
        &["--standalone", "--nproc-per-node", "4"],
        &[
            "--steps",
            &steps.to_string(),
            "--result",
            res.to_str().unwrap(),
        ],
        &[
            ("RANKSCOPE_COLLECTOR", &collector.addr),
            ("RANKSCOPE_RUN_ID", "ddp-4"),
        ],
    ));
    assert!(collector.stop());
    let out = dir.path();
    let r = result(&res);
    assert_eq!(r["params_in_sync"], true, "all-reduce did not run: {r}");
    assert!(r["last_loss"].as_f64() < r["first_loss"].as_f64(), "{r}");
    for report in r["reports"].as_array().unwrap() {
        assert_eq!(report["rows_unsent"], 0, "{r}");
        assert_eq!(report["rows_dropped"], 0, "{r}");
    }
    let per_rank = |n: u64| (0..4).map(|r| (r, n)).collect::<Vec<_>>();
    let sampled = 3; // steps 0, 10, 20 of 30
    assert_eq!(count_by_rank(out, "steps"), per_rank(steps));
    assert_eq!(count_by_rank(out, "layers"), per_rank(sampled * GPT_LAYERS));
    assert_eq!(count_by_rank(out, "ranks"), per_rank(1));
    assert_eq!(count_by_rank(out, "model"), per_rank(GPT_LAYERS));
    // The same (step, layer) grid on every rank, without a duplicate.
    assert_eq!(
        duckdb(&format!(
            "select count(*) from (select step, layer, count(*) n, count(distinct rank) r from {} group by all) where n <> 4 or r <> 4",
            table(out, "layers")
        ))
        .trim(),
        "0"
    );
    assert_eq!(
        duckdb(&format!(
            "select count(distinct step), min(step), max(step) from {}",
            table(out, "layers")
        ))
        .trim(),
        "3,0,20"
    );
    // Names are module paths without DDP's `module.` prefix.
    assert_eq!(count(out, "layers", "layer like 'module.%'"), 0);
    assert_eq!(
        count(out, "layers", "layer = 'blocks.0.attn.qkv'"),
        4 * sampled
    );
    // Every step row has its phases, loss and communication time.
    assert_eq!(
        count(
            out,
            "steps",
            "data_ms is null or forward_ms is null or backward_ms is null or optimizer_ms is null or loss is null or comm_ms is null or samples <> 16"
        ),
        0
    );
    // The profile counted the linear layers' FLOPs (2·rows·in·out) and AdamW state.
    assert_eq!(
        duckdb(&format!(
            "select kind, forward_flops, optimizer_bytes = 2 * grad_bytes from {} where rank = 0 and layer = 'blocks.0.attn.qkv'",
            table(out, "model")
        ))
        .trim(),
        format!("linear,{},true", 2 * 16 * 32 * 64 * 192)
    );
    assert_eq!(
        count(
            out,
            "runs",
            "world_size = 4 and workload = 'ddp_gpt' and sample_every = 10 and overhead_budget = 1"
        ),
        1
    );
}

#[test]
fn two_nodes_on_loopback_record_node_and_local_ranks() {
    let _one = one_ddp_job();
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &[]);
    let port = free_port().to_string();
    let node = |rank: &str| {
        let mut cmd = torchrun(
            &[
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--node-rank",
                rank,
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port,
            ],
            &["--steps", "12"],
            &[
                ("RANKSCOPE_COLLECTOR", &collector.addr),
                ("RANKSCOPE_RUN_ID", "ddp-2x2"),
            ],
        );
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        cmd.spawn().expect("start torchrun")
    };
    let nodes: Vec<Child> = vec![node("0"), node("1")];
    for child in nodes {
        let output = child.wait_with_output().expect("torchrun exits");
        assert!(
            output.status.success(),
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    assert!(collector.stop());
    assert_eq!(
        duckdb(&format!(
            "select rank, node_rank, local_rank, world_size from {} order by rank",
            table(dir.path(), "ranks")
        ))
        .trim(),
        "0,0,0,4\n1,0,1,4\n2,1,0,4\n3,1,1,4"
    );
    assert_eq!(
        count_by_rank(dir.path(), "steps"),
        (0..4).map(|r| (r, 12)).collect::<Vec<_>>()
    );
}

#[test]
fn rank0_mode_records_only_rank_zero() {
    let _one = one_ddp_job();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("collector.log");
    let out = dir.path().join("out");
    let collector = CollectorProc::start_logged(&out, &["--http", "127.0.0.1:0"], &log);
    run(torchrun(
        &["--standalone", "--nproc-per-node", "2"],
        &["--steps", "12"],
        &[
            ("RANKSCOPE_COLLECTOR", &collector.addr),
            ("RANKSCOPE_RUN_ID", "ddp-rank0"),
            ("RANKSCOPE_MODE", "rank0"),
        ],
    ));
    // Rank 1 opened no connection: the collector's own count of streams says so.
    let metrics = http_get(
        collector.http.as_deref().expect("--http address"),
        "/metrics",
    );
    assert!(
        metrics
            .lines()
            .any(|l| l == "rankscope_collector_streams_accepted_total 1"),
        "{metrics}"
    );
    assert!(collector.stop());
    assert_eq!(count_by_rank(&out, "steps"), vec![(0, 12)]);
    assert_eq!(count_by_rank(&out, "ranks"), vec![(0, 1)]);
    assert_eq!(count_by_rank(&out, "layers"), vec![(0, 2 * GPT_LAYERS)]);
}

#[test]
fn the_rank_others_wait_for_has_the_least_comm_time() {
    let _one = one_ddp_job();
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &[]);
    run(torchrun(
        &["--standalone", "--nproc-per-node", "2"],
        &["--steps", "20", "--slow-rank", "1", "--slow-ms", "40"],
        &[
            ("RANKSCOPE_COLLECTOR", &collector.addr),
            ("RANKSCOPE_RUN_ID", "ddp-straggler"),
            ("RANKSCOPE_MODE", "steps"),
        ],
    ));
    assert!(collector.stop());
    // Median over steps after the first (which includes start-up skew).
    let medians = duckdb(&format!(
        "select rank, median(comm_ms), median(forward_ms) from {} where step > 0 group by rank order by rank",
        table(dir.path(), "steps")
    ));
    println!("rank, median comm_ms, median forward_ms:\n{medians}");
    let rows: Vec<Vec<f64>> = medians
        .lines()
        .map(|l| l.split(',').map(|v| v.parse().unwrap()).collect())
        .collect();
    let (fast, slow) = (rows[0][1], rows[1][1]);
    // The 40 ms sleep is inside rank 1's forward, so its median is at least that;
    // rank 0's own forward varies with what else runs on the cores.
    assert!(
        rows[1][2] >= 40.0 && rows[1][2] > rows[0][2],
        "rank 1 was not slowed: {rows:?}"
    );
    // The fast rank waits for the slow one in every all-reduce, about the 40 ms; the
    // slow rank's own all-reduce is only the transfer (which other work on the same
    // cores can stretch, so the margin is half the sleep, not a ratio).
    assert!(
        fast - slow > 20.0 && slow < fast / 2.0,
        "slow rank comm_ms {slow} is not clearly below the fast rank's {fast}"
    );
    // And step by step: the slow rank waits less in most steps (a step whose
    // transfer other work on the cores stretched can go either way).
    let share: f64 = duckdb(&format!(
        "select avg(case when s.comm_ms < f.comm_ms then 1 else 0 end) from {t} s join {t} f using (step) where s.rank = 1 and f.rank = 0 and step > 0",
        t = table(dir.path(), "steps")
    ))
    .trim()
    .parse()
    .unwrap();
    println!("share of steps where the slow rank waited less: {share}");
    assert!(
        share >= 2.0 / 3.0,
        "the slow rank waited less in only {share} of the steps"
    );
}

#[test]
fn collector_killed_mid_run_and_restarted_loses_and_duplicates_nothing() {
    let _one = one_ddp_job();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let collector = CollectorProc::start_on(&listen, out, &[]);
    let res = out.join("result.json");
    let mut ranks = torchrun(
        &["--standalone", "--nproc-per-node", "2"],
        &["--steps", "150", "--result", res.to_str().unwrap()],
        &[
            ("RANKSCOPE_COLLECTOR", &listen),
            ("RANKSCOPE_RUN_ID", "ddp-kill"),
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("start torchrun");
    let moment = random_ms(2_000, 6_000);
    println!("SIGKILL the collector {moment} ms into the run");
    std::thread::sleep(Duration::from_millis(moment));
    collector.kill();
    std::thread::sleep(Duration::from_millis(random_ms(300, 1_500)));
    let collector = CollectorProc::start_on(&listen, out, &[]);
    let status = ranks.wait().expect("torchrun exits");
    assert!(status.success());
    assert!(collector.stop());
    let r = result(&res);
    for report in r["reports"].as_array().unwrap() {
        assert_eq!(report["rows_unsent"], 0, "{r}");
    }
    assert_eq!(
        count_by_rank(out, "steps"),
        vec![(0, 150), (1, 150)],
        "exact counts after the restart"
    );
    assert_eq!(
        duckdb(&format!(
            "select count(*) - count(distinct (rank, step)) from {}",
            table(out, "steps")
        ))
        .trim(),
        "0"
    );
    assert_eq!(
        count_by_rank(out, "layers"),
        vec![(0, 15 * GPT_LAYERS), (1, 15 * GPT_LAYERS)]
    );
}

#[test]
fn a_wrong_variable_raises_config_error_and_disable_lets_training_finish() {
    let _one = one_ddp_job();
    let dir = tempfile::tempdir().unwrap();
    let failed = torchrun(
        &["--standalone", "--nproc-per-node", "1"],
        &["--steps", "3"],
        &[("RANKSCOPE_SAMPLE_EVERY", "ten")],
    )
    .output()
    .expect("run torchrun");
    let text = String::from_utf8_lossy(&failed.stderr);
    assert!(!failed.status.success());
    assert!(
        text.contains("rankscope.ConfigError") && text.contains("RANKSCOPE_SAMPLE_EVERY"),
        "{text}"
    );
    let res = dir.path().join("result.json");
    let text = run(torchrun(
        &["--standalone", "--nproc-per-node", "2"],
        &["--steps", "3", "--result", res.to_str().unwrap()],
        &[
            ("RANKSCOPE_SAMPLE_EVERY", "ten"),
            ("RANKSCOPE_ON_CONFIG_ERROR", "disable"),
        ],
    ));
    assert!(text.contains("rankscope disabled"), "{text}");
    assert_eq!(result(&res)["params_in_sync"], true);
}
