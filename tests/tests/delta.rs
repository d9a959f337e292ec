//! Delta Lake output: collectors commit to Delta tables on a real S3 server
//! (moto, started on a free loopback port) and on a local disk, with real
//! `rankscope loadgen` ranks, and the real DuckDB reads every table through its
//! delta extension (`delta_scan`): the counts equal what the ranks sent, with
//! collectors SIGKILLed at random points and restarted, and with the S3 server
//! answering nothing for 10 s; the Python `deltalake` package and `rankscope
//! summary` read the same rows. Refused credentials, a bucket that does not
//! exist or an endpoint that does not answer stops the collector at start with
//! an error that names what to fix; so do GCS and Azure URLs without
//! credentials (compiled in, with no test server for them here).
//!
//! Needs the project venv (`make test` installs moto and, beside the main
//! DuckDB, the DuckDB of the delta extension wheels) and a binary built with the
//! `delta` feature (the default).

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rankscope_tests::{CollectorProc, bin, free_port, random_ms, rankscope, spill_dir, workspace};

const STEPS: u64 = 300;
const LAYERS: u64 = 2;
const ARGS: [&str; 2] = ["--max-file-age", "150ms"];
/// The DuckDB whose delta and httpfs extensions PyPI has (Makefile
/// `DUCKDB_DELTA_VERSION`).
const DUCKDB_DELTA_VERSION: &str = "1.5.5";

/// A moto S3 server on a free loopback port, with one bucket; stopped on drop.
struct S3Server {
    port: u16,
    child: Child,
}

impl S3Server {
    fn start(bucket: &str) -> S3Server {
        S3Server::start_with(bucket, &[])
    }

    /// A server with variables of moto's (`INITIAL_NO_AUTH_ACTION_COUNT`).
    fn start_with(bucket: &str, env: &[(&str, &str)]) -> S3Server {
        let port = free_port();
        let moto = workspace().join(".venv/bin/moto_server");
        assert!(
            moto.exists(),
            "{} is missing: `make test` installs moto[server] into the venv",
            moto.display()
        );
        let child = Command::new(moto)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start moto_server");
        let server = S3Server { port, child };
        let start = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "moto_server did not listen on {port} within 60 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let script = format!(
            "import boto3; boto3.client('s3', endpoint_url='http://127.0.0.1:{port}', \
             aws_access_key_id='test', aws_secret_access_key='test', region_name='us-east-1')\
             .create_bucket(Bucket='{bucket}')"
        );
        let status = Command::new(workspace().join(".venv/bin/python"))
            .args(["-c", &script])
            .status()
            .expect("run python");
        assert!(status.success(), "could not create bucket {bucket}");
        server
    }

    /// The variables a collector reads to reach this server.
    fn env(&self) -> Vec<(String, String)> {
        env_for(&format!("http://127.0.0.1:{}", self.port))
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn env_for(endpoint: &str) -> Vec<(String, String)> {
    [
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_REGION", "us-east-1"),
        ("AWS_ENDPOINT_URL", endpoint),
        ("AWS_ALLOW_HTTP", "true"),
    ]
    .into_iter()
    .chain(QUIET)
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

/// The collector's log without delta-rs's line per commit race (routine with
/// several writers).
const QUIET: [(&str, &str); 1] = [("RANKSCOPE_LOG", "warn,deltalake_core=error")];

/// The DuckDB of the delta extension and the file of extension `name`.
fn delta_duckdb() -> (PathBuf, impl Fn(&str) -> PathBuf) {
    let readers = workspace().join(".venv/delta-readers");
    let cli = readers.join("duckdb_cli/duckdb");
    assert!(
        cli.exists(),
        "{} is missing: `make test` (make delta-readers) installs DuckDB {DUCKDB_DELTA_VERSION} \
         with the delta and httpfs extension wheels",
        cli.display()
    );
    let extension = move |name: &str| {
        readers.join(format!(
            "duckdb_extension_{name}/extensions/v{DUCKDB_DELTA_VERSION}/{name}.duckdb_extension"
        ))
    };
    (cli, extension)
}

/// Runs `sql` in DuckDB with the delta extension (and an S3 secret for `s3`);
/// returns the CSV rows without header.
fn duckdb_delta(sql: &str, s3: Option<&S3Server>) -> String {
    let (cli, extension) = delta_duckdb();
    let mut script = format!(
        "SET autoinstall_known_extensions = false; SET autoload_known_extensions = false; \
         LOAD '{}'; LOAD '{}';",
        extension("httpfs").display(),
        extension("delta").display()
    );
    if let Some(server) = s3 {
        script.push_str(&format!(
            "CREATE SECRET (TYPE s3, KEY_ID 'test', SECRET 'test', REGION 'us-east-1', \
             ENDPOINT '127.0.0.1:{}', URL_STYLE 'path', USE_SSL false);",
            server.port
        ));
    }
    script.push_str(sql);
    let output = Command::new(cli)
        .args(["-csv", "-noheader", "-c", &script])
        .output()
        .expect("run DuckDB");
    assert!(
        output.status.success(),
        "duckdb failed on {sql}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let out = String::from_utf8(output.stdout).expect("utf-8");
    match s3 {
        // CREATE SECRET answers one row ("true") before the query's.
        Some(_) => out
            .split_once('\n')
            .map_or(String::new(), |(_, rest)| rest.to_string()),
        None => out,
    }
}

/// `rank,count` rows of a Delta table.
fn count_by_rank(table: &str, s3: Option<&S3Server>) -> Vec<(u32, u64)> {
    duckdb_delta(
        &format!("select rank, count(*) from delta_scan('{table}') group by rank order by rank"),
        s3,
    )
    .lines()
    .map(|l| {
        let (r, c) = l.split_once(',').expect("rank,count");
        (r.parse().expect("rank"), c.parse().expect("count"))
    })
    .collect()
}

/// Every table holds exactly what `ranks` loadgen ranks sent: one row per step
/// (and layer), no duplicate, each rank finished once.
fn assert_exact(root: &str, ranks: u32, s3: Option<&S3Server>) {
    let per_rank = |n: u64| (0..ranks).map(|r| (r, n)).collect::<Vec<_>>();
    let table = |name: &str| format!("{root}/{name}");
    assert_eq!(count_by_rank(&table("steps"), s3), per_rank(STEPS), "steps");
    assert_eq!(
        count_by_rank(&table("layers"), s3),
        per_rank(STEPS * LAYERS),
        "layers"
    );
    assert_eq!(
        count_by_rank(&table("model"), s3),
        per_rank(LAYERS),
        "model"
    );
    assert_eq!(count_by_rank(&table("ranks"), s3), per_rank(1), "ranks");
    let duplicates = duckdb_delta(
        &format!(
            "select count(*) - count(distinct (rank, step)) from delta_scan('{}')",
            table("steps")
        ),
        s3,
    );
    assert_eq!(duplicates.trim(), "0", "duplicate step rows");
    let run = duckdb_delta(
        &format!(
            "select distinct run_id from delta_scan('{}')",
            table("steps")
        ),
        s3,
    );
    assert_eq!(run.trim(), "delta-run", "the run_id partition column");
}

/// Starts `rankscope loadgen` with `ranks` ranks against `collectors`.
fn loadgen(collectors: &[String], ranks: u32, step_interval: &str) -> Child {
    Command::new(bin("rankscope"))
        .args([
            "loadgen",
            "--run-id",
            "delta-run",
            "--step-interval",
            step_interval,
        ])
        .args([
            "--finish-timeout",
            "120s",
            "--collector",
            &collectors.join(","),
        ])
        .args(["--ranks", &ranks.to_string(), "--steps", &STEPS.to_string()])
        .args(["--layers", &LAYERS.to_string()])
        .env("RANKSCOPE_LOG", "error")
        .env("RANKSCOPE_SPILL_DIR", spill_dir())
        .stdout(Stdio::null())
        .spawn()
        .expect("start loadgen")
}

/// Runs loadgen against `n` collectors writing `out`, SIGKILLs one of them at a
/// random moment `kills` times (restarting it on the same port), and waits for
/// every rank's rows to be acknowledged.
fn run_with_kills(out: &Path, env: &[(String, String)], n: usize, ranks: u32, kills: usize) {
    let listen: Vec<String> = (0..n)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let mut collectors: Vec<Option<CollectorProc>> = listen
        .iter()
        .map(|addr| Some(CollectorProc::start_with_env(addr, out, &ARGS, env)))
        .collect();
    let mut ranks_proc = loadgen(&listen, ranks, "20ms");
    for kill in 0..kills {
        let pause_ms = random_ms(200, 1200);
        let which = random_ms(0, n as u64) as usize;
        std::thread::sleep(Duration::from_millis(pause_ms));
        eprintln!("kill {kill}: collector {which} after {pause_ms} ms");
        if let Some(collector) = collectors[which].take() {
            collector.kill();
        }
        std::thread::sleep(Duration::from_millis(random_ms(20, 300)));
        collectors[which] = Some(CollectorProc::start_with_env(
            &listen[which],
            out,
            &ARGS,
            env,
        ));
    }
    let status = ranks_proc.wait().expect("wait for loadgen");
    assert!(status.success(), "every row was acknowledged: {status}");
    for collector in collectors.into_iter().flatten() {
        assert!(collector.stop(), "the collector stopped cleanly");
    }
}

#[test]
fn four_collectors_commit_to_one_bucket_and_duckdb_reads_every_row_once_after_kills() {
    let s3 = S3Server::start("rankscope");
    let root = "s3://rankscope/runs";
    run_with_kills(Path::new(root), &s3.env(), 4, 64, 5);
    assert_exact(root, 64, Some(&s3));
    // `rankscope summary` reads the tables from the bucket too.
    let output = Command::new(bin("rankscope"))
        .args(["summary", "--out", root])
        .envs(s3.env())
        .output()
        .expect("run rankscope summary");
    let summary = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{summary}");
    assert!(summary.contains("delta-run"), "{summary}");
    assert!(summary.contains(&STEPS.to_string()), "{summary}");
}

#[test]
fn collectors_commit_to_a_local_delta_table_exactly_once_after_kills() {
    let dir = tempfile::tempdir().unwrap();
    let out = format!("delta:{}", dir.path().display());
    let quiet: Vec<_> = QUIET
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    run_with_kills(Path::new(&out), &quiet, 2, 8, 3);
    assert_exact(&dir.path().display().to_string(), 8, None);
    // Each table is a Delta table partitioned by run_id.
    assert!(dir.path().join("steps/_delta_log").is_dir());
    assert!(dir.path().join("steps/run_id=delta-run").is_dir());
    // The Python `deltalake` package (delta-rs's reader, which checks the
    // protocol's reader and writer versions and features) reads the same rows.
    let script = format!(
        "from deltalake import DeltaTable, QueryBuilder\n\
         t = DeltaTable('{}/layers')\n\
         p = t.protocol()\n\
         assert p.min_reader_version == 1 and not p.reader_features, p\n\
         r = QueryBuilder().register('layers', t).execute(\n\
             'select rank, count(*) as n from layers group by rank order by rank').read_all()\n\
         print(r.column('n').to_pylist())",
        dir.path().display()
    );
    let output = Command::new(workspace().join(".venv/bin/python"))
        .args(["-c", &script])
        .output()
        .expect("run python");
    assert!(
        output.status.success(),
        "the Python deltalake package (make test installs it) could not read the table: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let per_rank = vec![(STEPS * LAYERS).to_string(); 8].join(", ");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        format!("[{per_rank}]")
    );
    // `rankscope summary` and `report` read the Delta tables as they read a folder.
    let summary = rankscope(&["summary", "--out", &out]);
    assert!(summary.contains("delta-run"), "{summary}");
    assert!(summary.contains(&STEPS.to_string()), "{summary}");
    rankscope(&["report", &out, "--run", "delta-run"]);
    assert!(dir.path().join("report-delta-run.html").is_file());
    // `rankscope compact` merges the run's files: one file per table, the same rows.
    let compacted = rankscope(&["compact", "--out", &out, "--run-id", "delta-run"]);
    eprintln!("{compacted}");
    assert!(compacted.contains("steps: "), "{compacted}");
    assert!(compacted.contains("layers: "), "{compacted}");
    for line in compacted.lines() {
        let (table, _) = line.split_once(':').expect("table: N files -> M");
        assert!(line.contains("-> 1 ") || line.contains("-> 0 "), "{line}");
        assert!(!table.is_empty());
    }
    assert_exact(&dir.path().display().to_string(), 8, None);
}

#[test]
fn an_s3_server_that_stops_answering_for_10_s_loses_nothing() {
    let s3 = S3Server::start("paused");
    let root = "s3://paused/runs";
    let listen = format!("127.0.0.1:{}", free_port());
    let collector = CollectorProc::start_with_env(&listen, Path::new(root), &ARGS, &s3.env());
    let mut ranks = loadgen(std::slice::from_ref(&listen), 4, "20ms");
    std::thread::sleep(Duration::from_millis(random_ms(500, 1500)));
    // SIGSTOP: the server keeps its connections and its data but answers nothing.
    rankscope_tests::signal(s3.child.id(), "STOP");
    std::thread::sleep(Duration::from_secs(10));
    rankscope_tests::signal(s3.child.id(), "CONT");
    let status = ranks.wait().expect("wait for loadgen");
    assert!(status.success(), "every row was acknowledged: {status}");
    assert!(collector.stop(), "the collector stopped cleanly");
    assert_exact(root, 4, Some(&s3));
}

/// Runs a collector that must fail at start; returns what it said. The
/// object stores' variables of the test's own environment are not passed on.
fn failed_start(out: &str, env: &[(String, String)]) -> String {
    let mut command = Command::new(bin("rankscope"));
    for (key, _) in std::env::vars() {
        if ["AWS_", "GOOGLE_", "GCE_", "AZURE_"]
            .iter()
            .any(|p| key.starts_with(p))
        {
            command.env_remove(key);
        }
    }
    let output = command
        .args(["collector", "--listen", "127.0.0.1:0", "--out", out])
        .env("RANKSCOPE_LOG", "error")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .output()
        .expect("run the collector");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!output.status.success(), "the collector started: {said}");
    assert!(!said.contains("panicked"), "{said}");
    said
}

#[test]
fn refused_credentials_stop_the_collector_naming_the_variables() {
    // moto checks credentials once its first request (creating the bucket) is
    // done: "test" is then no key it knows.
    let s3 = S3Server::start_with("guarded", &[("INITIAL_NO_AUTH_ACTION_COUNT", "1")]);
    let said = failed_start("s3://guarded/runs", &s3.env());
    assert!(
        said.contains("refused the credentials")
            && said.contains("AWS_ACCESS_KEY_ID")
            && said.contains("AWS_SECRET_ACCESS_KEY"),
        "{said}"
    );
}

#[test]
fn a_missing_bucket_or_an_endpoint_that_does_not_answer_stops_the_collector_naming_the_fix() {
    let s3 = S3Server::start("present");
    let said = failed_start("s3://absent/runs", &s3.env());
    assert!(
        said.contains("bucket absent") && said.contains("does not exist"),
        "{said}"
    );
    // Nothing listens on this port.
    let closed = format!("http://127.0.0.1:{}", free_port());
    let said = failed_start("s3://present/runs", &env_for(&closed));
    assert!(said.contains("AWS_ENDPOINT_URL"), "{said}");
}

/// GCS and Azure are compiled in but have no test server here: without
/// credentials, with every endpoint on a loopback port nothing listens on (so
/// nothing leaves the machine), the collector stops within the start timeout
/// (20 s) naming the variables to set.
#[test]
fn gcs_and_azure_without_credentials_stop_the_collector_naming_the_variables() {
    let closed = format!("127.0.0.1:{}", free_port());
    // No gcloud application default credentials in an empty home.
    let home = tempfile::tempdir().unwrap();
    let env = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .chain([("HOME".into(), home.path().display().to_string())])
            .collect()
    };
    let endpoint = format!("http://{closed}");
    let started = Instant::now();
    let said = failed_start(
        "gs://no-such-bucket/x",
        &env(&[
            ("GOOGLE_BASE_URL", &endpoint),
            ("GOOGLE_ALLOW_HTTP", "true"),
            ("GCE_METADATA_HOST", &closed),
            ("GCE_METADATA_IP", &closed),
        ]),
    );
    assert!(
        said.contains("GOOGLE_APPLICATION_CREDENTIALS") && said.contains("GOOGLE_SERVICE_ACCOUNT"),
        "{said}"
    );
    let said = failed_start(
        "az://no-such-container/x",
        &env(&[
            ("AZURE_STORAGE_ENDPOINT", &endpoint),
            ("AZURE_ALLOW_HTTP", "true"),
            ("AZURE_MSI_ENDPOINT", &endpoint),
        ]),
    );
    assert!(
        said.contains("AZURE_STORAGE_ACCOUNT_NAME") && said.contains("AZURE_STORAGE_ACCOUNT_KEY"),
        "{said}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
}
