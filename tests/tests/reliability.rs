//! Faults end to end: the collector killed with SIGKILL and restarted mid-run,
//! and bearer-token auth. Checked with the real DuckDB CLI.

use std::process::{Command, Stdio};
use std::time::Duration;

use rankscope_tests::{
    CollectorProc, FAST_COMMITS, batch, bin, count, count_by_rank, duckdb, free_port, hello, open,
    random_ms, rankscope, table, walk,
};

#[test]
fn collector_killed_and_restarted_mid_run_loses_and_duplicates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let args = ["--max-file-age", "150ms"];
    let mut collector = CollectorProc::start_on(&listen, dir.path(), &args);
    let (ranks, steps, layers) = (4u64, 400u64, 3u64);
    let mut loadgen = Command::new(bin("rankscope"))
        .args([
            "loadgen",
            "--run-id",
            "chaos",
            "--step-interval",
            "5ms",
            "--finish-timeout",
            "60s",
        ])
        .args(["--ranks", &ranks.to_string(), "--steps", &steps.to_string()])
        .args(["--layers", &layers.to_string(), "--collector", &listen])
        .env("RANKSCOPE_LOG", "error")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // Two crashes at random moments of the run, each followed by a restart.
    for _ in 0..2 {
        let pause_ms = random_ms(200, 900);
        eprintln!("killing the collector after {pause_ms} ms");
        std::thread::sleep(Duration::from_millis(pause_ms));
        collector.kill();
        std::thread::sleep(Duration::from_millis(200));
        collector = CollectorProc::start_on(&listen, dir.path(), &args);
    }
    let status = loadgen.wait().unwrap();
    assert!(
        status.success(),
        "every row was acknowledged after the restarts"
    );
    assert!(collector.stop());
    let out = dir.path();
    let per_rank = |n: u64| (0..ranks as u32).map(|r| (r, n)).collect::<Vec<_>>();
    assert_eq!(count_by_rank(out, "steps"), per_rank(steps));
    assert_eq!(count_by_rank(out, "layers"), per_rank(steps * layers));
    assert_eq!(count_by_rank(out, "model"), per_rank(layers));
    let dups = duckdb(&format!(
        "select count(*) from (select rank, step, layer from {} group by all having count(*) > 1)",
        table(out, "layers")
    ));
    assert_eq!(dups.trim(), "0");
    // No temporary file was left visible or half-read.
    let leftovers = walk(out)
        .into_iter()
        .filter(|p| p.to_string_lossy().ends_with(".tmp"))
        .count();
    assert_eq!(leftovers, 0);
}

#[test]
fn bearer_token_is_required_when_configured() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret-token\n").unwrap();
    let out = dir.path().join("out");
    let collector = CollectorProc::start(&out, &["--token-file", token.to_str().unwrap()]);
    let common = ["loadgen", "--ranks", "2", "--steps", "5", "--layers", "2"];

    let refused = Command::new(bin("rankscope"))
        .args(common)
        .args(["--collector", &collector.addr, "--finish-timeout", "2s"])
        .env_remove("RANKSCOPE_TOKEN")
        .output()
        .unwrap();
    assert!(!refused.status.success(), "no token, no write");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("bearer token"), "{stderr}");

    let wrong = Command::new(bin("rankscope"))
        .args(common)
        .args(["--collector", &collector.addr, "--finish-timeout", "2s"])
        .env("RANKSCOPE_TOKEN", "guess")
        .output()
        .unwrap();
    assert!(!wrong.status.success(), "a wrong token is refused");

    rankscope(&[
        "loadgen",
        "--ranks",
        "2",
        "--steps",
        "5",
        "--layers",
        "2",
        "--collector",
        &collector.addr,
        "--token",
        "s3cret-token",
    ]);
    assert!(collector.stop());
    assert_eq!(count(&out, "steps", ""), 10);
    assert_eq!(count(&out, "layers", ""), 20);
}

/// PEM files of a throw-away CA, a collector certificate for 127.0.0.1 and an
/// agent (client) certificate, all signed by that CA.
struct Pki {
    ca: std::path::PathBuf,
    server_cert: std::path::PathBuf,
    server_key: std::path::PathBuf,
    client_cert: std::path::PathBuf,
    client_key: std::path::PathBuf,
}

fn pki(dir: &std::path::Path) -> Pki {
    use rcgen::{
        BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    };
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate().unwrap();
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |names: Vec<String>, usage: ExtendedKeyUsagePurpose| {
        let mut params = CertificateParams::new(names).unwrap();
        params.extended_key_usages.push(usage);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_pem, server_key) = leaf(
        vec!["127.0.0.1".into(), "localhost".into()],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (client_pem, client_key) = leaf(vec!["rank".into()], ExtendedKeyUsagePurpose::ClientAuth);
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    Pki {
        ca: write("ca.pem", &ca_cert.pem()),
        server_cert: write("server.pem", &server_pem),
        server_key: write("server.key", &server_key),
        client_cert: write("client.pem", &client_pem),
        client_key: write("client.key", &client_key),
    }
}

#[test]
fn mutual_tls_admits_only_agents_with_a_certificate_of_the_client_ca() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let out = dir.path().join("out");
    let path = |p: &std::path::PathBuf| p.to_str().unwrap().to_string();
    let collector = CollectorProc::start(
        &out,
        &[
            "--tls-cert",
            &path(&pki.server_cert),
            "--tls-key",
            &path(&pki.server_key),
            "--tls-client-ca",
            &path(&pki.ca),
        ],
    );
    let https = format!("https://{}", collector.addr);
    let loadgen = |collector: &str, env: &[(&str, &std::path::PathBuf)]| {
        let mut cmd = Command::new(bin("rankscope"));
        cmd.args(["loadgen", "--ranks", "2", "--steps", "5", "--layers", "2"])
            .args(["--collector", collector, "--finish-timeout", "2s"])
            .env("RANKSCOPE_LOG", "warn");
        for var in [
            "RANKSCOPE_TLS_CA",
            "RANKSCOPE_TLS_CERT",
            "RANKSCOPE_TLS_KEY",
        ] {
            cmd.env_remove(var);
        }
        for (var, value) in env {
            cmd.env(var, value);
        }
        cmd.output().unwrap()
    };

    let full = [
        ("RANKSCOPE_TLS_CA", &pki.ca),
        ("RANKSCOPE_TLS_CERT", &pki.client_cert),
        ("RANKSCOPE_TLS_KEY", &pki.client_key),
    ];
    let ok = loadgen(&https, &full);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    // No client certificate, plaintext, or a server the agent cannot verify: refused.
    assert!(
        !loadgen(&https, &full[..1]).status.success(),
        "no client certificate"
    );
    assert!(!loadgen(&collector.addr, &[]).status.success(), "plaintext");
    let wrong_ca = [("RANKSCOPE_TLS_CA", &pki.server_cert), full[1], full[2]];
    assert!(
        !loadgen(&https, &wrong_ca).status.success(),
        "unverifiable server"
    );
    assert!(collector.stop());
    assert_eq!(
        count(&out, "steps", ""),
        10,
        "only the admitted agent's rows"
    );
    assert_eq!(count(&out, "layers", ""), 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_or_silent_stream_never_holds_up_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().to_path_buf();
    let collector = CollectorProc::start(&out, &FAST_COMMITS);
    // A stream that sends 300 batches and never reads an acknowledgement: its
    // replies back up. And one that sends its Hello and then nothing at all.
    let (stalled, _) = open(&collector.addr, hello("stalled", 0)).await.unwrap();
    let (silent, _) = open(&collector.addr, hello("silent", 1)).await.unwrap();
    for seq in 1..=300 {
        stalled.send(batch(seq, 10, false)).await;
    }
    // Meanwhile four healthy ranks land everything.
    let addr = collector.addr.clone();
    let healthy = tokio::task::spawn_blocking(move || {
        rankscope(&[
            "loadgen",
            "--ranks",
            "4",
            "--steps",
            "50",
            "--layers",
            "2",
            "--run-id",
            "healthy",
            "--collector",
            &addr,
            "--finish-timeout",
            "30s",
        ])
    });
    let text = tokio::time::timeout(Duration::from_secs(60), healthy)
        .await
        .expect("the healthy ranks finish while the others stall")
        .unwrap();
    assert!(text.contains(" 0 unacknowledged"), "{text}");
    drop(silent);
    drop(stalled);
    assert!(collector.stop());
    let per_rank = |n: u64| (0..4u32).map(|r| (r, n)).collect::<Vec<_>>();
    assert_eq!(count(&out, "steps", "run_id = 'healthy'"), 200);
    let healthy_layers: Vec<(u32, u64)> = duckdb(&format!(
        "select rank, count(*) from {} where run_id = 'healthy' group by rank order by rank",
        table(&out, "layers")
    ))
    .lines()
    .map(|l| {
        let (r, c) = l.split_once(',').unwrap();
        (r.parse().unwrap(), c.parse().unwrap())
    })
    .collect();
    assert_eq!(healthy_layers, per_rank(100));
    // What the stalled stream sent was accepted and kept, though never acknowledged to it.
    assert_eq!(count(&out, "steps", "run_id = 'stalled'"), 3000);
}
