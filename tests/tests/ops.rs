//! The collector's ops endpoints end to end: the real binary with `--http` on
//! 127.0.0.1:0, scraped with a real HTTP client (hyper's), real traffic from the
//! load generator in its own process, and the standard gRPC health client.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rankscope_proto::SCHEMA_MAJOR;
use rankscope_tests::{CollectorProc, batch, count, hello, open, rankscope, signal};
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

fn http_client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// `GET http://ADDR/PATH`: (status, body), or the error when nothing answers.
async fn get(client: &HttpClient, addr: &str, path: &str) -> Result<(u16, String), String> {
    let uri = format!("http://{addr}{path}").parse().expect("a valid uri");
    let response = client.get(uri).await.map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((
        status,
        String::from_utf8(body.to_vec()).expect("utf-8 body"),
    ))
}

async fn scrape(client: &HttpClient, addr: &str) -> String {
    let (status, text) = get(client, addr, "/metrics")
        .await
        .expect("/metrics answers");
    assert_eq!(status, 200, "{text}");
    text
}

/// The value of one series (`name` or `name{labels}`) in a scrape.
fn figure(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let value = line.strip_prefix(series)?.strip_prefix(' ')?;
        value.split_whitespace().next()?.parse().ok()
    })
}

fn must(text: &str, series: &str) -> f64 {
    figure(text, series).unwrap_or_else(|| panic!("{series} missing from the scrape:\n{text}"))
}

async fn health_client(addr: &str) -> HealthClient<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("a valid uri")
        .connect()
        .await
        .expect("connect to the collector");
    HealthClient::new(channel)
}

/// The status `grpc.health.v1.Health/Check` gives `service`.
async fn grpc_health(addr: &str, service: &str) -> Result<i32, tonic::Code> {
    let request = HealthCheckRequest {
        service: service.into(),
    };
    match health_client(addr).await.check(request).await {
        Ok(answer) => Ok(answer.into_inner().status),
        Err(status) => Err(status.code()),
    }
}

const P: &str = "rankscope_collector_";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_scraped_and_follow_real_traffic() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &["--http", "127.0.0.1:0"]);
    let http = collector.http.clone().expect("an ops address");
    let client = http_client();

    assert_eq!(
        get(&client, &http, "/healthz").await,
        Ok((200, "ok\n".into()))
    );
    assert_eq!(
        get(&client, &http, "/readyz").await,
        Ok((200, "ready\n".into()))
    );
    assert_eq!(get(&client, &http, "/nope").await.unwrap().0, 404);
    let before = scrape(&client, &http).await;
    assert_eq!(must(&before, &format!("{P}batches_received_total")), 0.0);
    assert_eq!(
        must(
            &before,
            &format!("{P}rows_received_total{{table=\"layers\"}}")
        ),
        0.0
    );
    assert_eq!(must(&before, &format!("{P}open_streams")), 0.0);
    assert_eq!(must(&before, &format!("{P}buffer_bytes")), 0.0);
    // The memory bound's shares: 112 MiB reserved, an eighth for decoding, the
    // rest for the rows while no stream is open.
    let bound = must(&before, &format!("{P}memory_limit_bytes"));
    assert_eq!(bound, (512u64 << 20) as f64, "the default bound");
    assert_eq!(must(&before, &format!("{P}stream_memory_bytes")), 0.0);
    assert_eq!(
        must(&before, &format!("{P}buffer_limit_bytes")),
        bound - (112u64 << 20) as f64 - bound / 8.0
    );
    assert_eq!(must(&before, &format!("{P}ready")), 1.0);
    assert!(must(&before, &format!("{P}disk_free_bytes")) > 0.0);
    assert_eq!(
        must(&before, &format!("{P}commit_duration_seconds_count")),
        0.0
    );
    assert!(
        before.ends_with("# EOF\n"),
        "a complete OpenMetrics exposition"
    );

    // Real traffic: the load generator in its own process, through the real agent transport.
    let (ranks, steps, layers) = (4u64, 30u64, 5u64);
    let addr = collector.addr.clone();
    tokio::task::spawn_blocking(move || {
        rankscope(&[
            "loadgen",
            "--ranks",
            &ranks.to_string(),
            "--steps",
            &steps.to_string(),
            "--layers",
            &layers.to_string(),
            "--collector",
            &addr,
            "--run-id",
            "ops-1",
        ])
    })
    .await
    .unwrap();
    // loadgen exits 0 only once every row is acknowledged, so committed too.
    let after = scrape(&client, &http).await;
    let rows = |table: &str| {
        must(
            &after,
            &format!("{P}rows_received_total{{table=\"{table}\"}}"),
        )
    };
    assert_eq!(rows("layers"), (ranks * steps * layers) as f64);
    assert_eq!(rows("steps"), (ranks * steps) as f64);
    assert_eq!(rows("model"), (ranks * layers) as f64);
    assert_eq!(rows("ranks"), ranks as f64);
    assert_eq!(rows("runs"), 1.0);
    let total = ranks * (steps * layers + steps + layers + 1) + 1;
    assert_eq!(
        must(
            &after,
            &format!("{P}run_rows_received_total{{run_id=\"ops-1\"}}")
        ),
        total as f64
    );
    assert_eq!(
        must(&after, &format!("{P}rows_committed_total")),
        total as f64
    );
    assert!(must(&after, &format!("{P}batches_received_total")) >= ranks as f64);
    assert!(must(&after, &format!("{P}streams_accepted_total")) >= ranks as f64);
    assert_eq!(must(&after, &format!("{P}batches_duplicate_total")), 0.0);
    assert!(must(&after, &format!("{P}commits_total")) >= 1.0);
    assert!(must(&after, &format!("{P}files_committed_total")) >= 5.0);
    let commits = must(&after, &format!("{P}commit_duration_seconds_count"));
    assert!(commits >= 1.0, "{after}");
    assert!(must(&after, &format!("{P}commit_duration_seconds_sum")) > 0.0);
    assert_eq!(must(&after, &format!("{P}open_streams")), 0.0);
    assert_eq!(must(&after, &format!("{P}buffer_bytes")), 0.0);
    assert_eq!(must(&after, &format!("{P}stream_memory_bytes")), 0.0);

    // Refusals, by reason: a bad run id, an unknown schema major.
    let status = open(&collector.addr, hello("../x", 0))
        .await
        .err()
        .expect("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    let mut wrong_schema = hello("ops-1", 0);
    wrong_schema.schema_major = SCHEMA_MAJOR + 1;
    assert!(open(&collector.addr, wrong_schema).await.is_err());
    let refused = scrape(&client, &http).await;
    let reason = |r: &str| must(&refused, &format!("{P}refused_total{{reason=\"{r}\"}}"));
    assert_eq!(reason("invalid"), 1.0);
    assert_eq!(reason("schema"), 1.0);
    assert_eq!(reason("low_disk"), 0.0);

    // The gRPC health service beside the Collector service.
    let serving = ServingStatus::Serving as i32;
    assert_eq!(grpc_health(&collector.addr, "").await, Ok(serving));
    assert_eq!(
        grpc_health(&collector.addr, "rankscope.v1.Collector").await,
        Ok(serving)
    );
    assert!(collector.stop(), "collector exits 0 after SIGTERM");
    assert_eq!(
        count(dir.path(), "layers", "run_id = 'ops-1'"),
        ranks * steps * layers
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_goes_not_ready_while_the_collector_drains() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing is committed before the stop, so the drain has a real commit to make.
    let collector = CollectorProc::start(
        dir.path(),
        &["--http", "127.0.0.1:0", "--max-file-age", "3600s"],
    );
    let http = collector.http.clone().expect("an ops address");
    let addr = collector.addr.clone();
    let client = http_client();

    let (batches, rows) = (40u64, 2500u64);
    let (stream, _) = open(&addr, hello("drain-1", 0)).await.unwrap();
    for seq in 1..=batches {
        stream.send(batch(seq, rows, false)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = scrape(&client, &http).await;
        if figure(&text, &format!("{P}batches_received_total")) == Some(batches as f64) {
            assert!(must(&text, &format!("{P}buffer_bytes")) > 0.0);
            assert_eq!(must(&text, &format!("{P}open_streams")), 1.0);
            // The open stream's share of the memory bound is taken from the rows'.
            let streams = must(&text, &format!("{P}stream_memory_bytes"));
            assert!(streams > 64.0 * 1024.0, "{streams}");
            let bound = must(&text, &format!("{P}memory_limit_bytes"));
            assert_eq!(
                must(&text, &format!("{P}buffer_limit_bytes")),
                bound - (112u64 << 20) as f64 - bound / 8.0 - streams
            );
            break;
        }
        assert!(Instant::now() < deadline, "batches not received:\n{text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(get(&client, &http, "/readyz").await.unwrap().0, 200);
    let serving = ServingStatus::Serving as i32;
    assert_eq!(grpc_health(&addr, "").await, Ok(serving));

    // Ask both endpoints, over connections opened before the stop, until they go away.
    let http_answers = tokio::spawn({
        let (client, http) = (client.clone(), http.clone());
        async move {
            let mut seen = Vec::new();
            while let Ok(answer) = get(&client, &http, "/readyz").await {
                seen.push(answer);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            seen
        }
    });
    let mut health = health_client(&addr).await;
    let grpc_answers = tokio::spawn(async move {
        let mut seen = Vec::new();
        loop {
            let request = HealthCheckRequest {
                service: "rankscope.v1.Collector".into(),
            };
            match health.check(request).await {
                Ok(answer) => seen.push(answer.into_inner().status),
                Err(_) => return seen,
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    signal(collector.pid(), "TERM");
    let http_seen = http_answers.await.unwrap();
    let grpc_seen = grpc_answers.await.unwrap();
    assert!(collector.stop(), "collector exits 0 after draining");

    let first_503 = http_seen
        .iter()
        .position(|(status, _)| *status == 503)
        .unwrap_or_else(|| panic!("/readyz never said 503 while draining: {http_seen:?}"));
    assert!(http_seen[..first_503].iter().all(|(s, _)| *s == 200));
    assert!(
        http_seen[first_503..].iter().all(|(s, _)| *s == 503),
        "never ready again once draining: {http_seen:?}"
    );
    assert!(
        http_seen[first_503].1.contains("draining"),
        "{:?}",
        http_seen[first_503]
    );
    let not_serving = ServingStatus::NotServing as i32;
    assert!(
        grpc_seen.contains(&not_serving),
        "gRPC health never said NOT_SERVING while draining: {grpc_seen:?}"
    );
    assert_eq!(grpc_seen.first(), Some(&serving));
    // The drain committed everything the stream had sent.
    assert_eq!(
        count(dir.path(), "steps", "run_id = 'drain-1'"),
        batches * rows
    );
}
