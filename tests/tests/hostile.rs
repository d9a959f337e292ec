//! Hostile input against the real collector binary on 127.0.0.1:0: bytes that
//! are not protobuf, batches that break the limits, odd sequence numbers, odd
//! floats and labels, path-like run ids. (Too many streams, messages begun and
//! never finished, and streams dropped without a word are in `hostile_streams.rs`;
//! a hostile disk is in `disk.rs`; the memory figures of RELIABILITY.md come from
//! `slow_senders.rs`.)
//!
//! Each refusal must carry a clear status and message, end only its own stream,
//! and leave the collector serving: a well-formed "bystander" stream open across
//! the test still lands every row, checked with the real DuckDB CLI.

use prost::Message;
use rankscope_proto::v1::{Batch, EventRow, LayerRow, StepRow};
use rankscope_tests::hostile::{
    Bystander, batch_message, bystander_landed, frame, hello_message, peak_rss_bytes, raw_call,
};
use rankscope_tests::{
    CollectorProc, FAST_COMMITS as FAST, batch, count, duckdb, hello, open, open_with, table,
};
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_bytes_are_refused_with_invalid_argument() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &FAST);
    let addr = collector.addr.clone();
    let mut bystander = Bystander::open(&addr).await;
    bystander.lands_a_batch().await;

    let hello_frame = frame(0, &hello_message("raw", 0).encode_to_vec());
    let garbage = b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff this is not protobuf".to_vec();
    let after_hello = |bytes: Vec<u8>| [hello_frame.clone(), bytes].concat();
    let good_batch = batch_message(batch(1, 3, false)).encode_to_vec();
    let cases: Vec<(&str, Vec<u8>, Code, &str)> = vec![
        (
            "garbage instead of a Hello",
            frame(0, &garbage),
            Code::InvalidArgument,
            "malformed message from the agent",
        ),
        (
            "garbage after a valid Hello",
            after_hello(frame(0, &garbage)),
            Code::InvalidArgument,
            "malformed message from the agent",
        ),
        (
            "a protobuf of another message (a Welcome) after a valid Hello",
            after_hello(frame(0, &[0x08, 0x05, 0x12, 0x01, b'x'])),
            Code::InvalidArgument,
            "malformed message from the agent",
        ),
        (
            "a batch cut short mid-frame",
            after_hello(frame(0, &good_batch)[..good_batch.len() / 2].to_vec()),
            Code::InvalidArgument,
            "malformed message from the agent",
        ),
        (
            "a compressed flag without a grpc-encoding",
            after_hello(frame(1, &good_batch)),
            Code::InvalidArgument,
            "compressed-flag",
        ),
        (
            "an unknown compression flag",
            after_hello(frame(7, &good_batch)),
            Code::InvalidArgument,
            "invalid compression flag",
        ),
        (
            "a length prefix of 4 GiB",
            after_hello(vec![0, 0xff, 0xff, 0xff, 0xff, 1, 2, 3]),
            Code::OutOfRange,
            "message length too large",
        ),
        (
            "an empty AgentMessage first",
            frame(0, &[]),
            Code::InvalidArgument,
            "first message of a stream must be a Hello",
        ),
        (
            "no message at all",
            Vec::new(),
            Code::InvalidArgument,
            "first message of a stream must be a Hello",
        ),
    ];
    for (what, body, code, says) in cases {
        let status = raw_call(&addr, body).await;
        assert_eq!(status.code(), code, "{what}: {status:?}");
        assert!(status.message().contains(says), "{what}: {status:?}");
        bystander.lands_a_batch().await;
    }

    // The raw client itself is sound: a valid Hello and batch over it land.
    let status = raw_call(
        &addr,
        after_hello(frame(0, &batch_message(batch(1, 3, true)).encode_to_vec())),
    )
    .await;
    assert_eq!(status.code(), Code::Ok, "{status:?}");

    // Many hostile calls at once, beside the bystander.
    let storm: Vec<_> = (0..32u8)
        .map(|i| {
            let addr = addr.clone();
            let body = after_hello(frame(0, &[i, 0xff, i.wrapping_mul(37), 0x80]));
            tokio::spawn(async move { raw_call(&addr, body).await })
        })
        .collect();
    bystander.lands_a_batch().await;
    for call in storm {
        let status = call.await.unwrap();
        assert_ne!(status.code(), Code::Ok, "{status:?}");
    }
    bystander.lands_a_batch().await;

    let rows = bystander.rows();
    drop(bystander);
    assert!(collector.stop(), "the collector exits 0 after all that");
    bystander_landed(dir.path(), rows);
    assert_eq!(count(dir.path(), "steps", "run_id = 'raw'"), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_breaking_the_protocol_or_limits_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &FAST);
    let addr = collector.addr.clone();
    let mut bystander = Bystander::open(&addr).await;
    bystander.lands_a_batch().await;

    let long_layer = |len: usize| {
        let mut b = batch(1, 0, false);
        b.layers.push(LayerRow {
            layer: "x".repeat(len),
            ..Default::default()
        });
        b
    };
    let mut long_event = batch(1, 0, false);
    long_event.events.push(EventRow {
        kind: "note".into(),
        message: "m".repeat(4097),
        ..Default::default()
    });
    // Over the rows limit, far under the 16 MiB message limit (about 1.4 MiB).
    let too_many_rows = batch(1, 100_001, false);
    assert!(too_many_rows.encoded_len() < 2 * 1024 * 1024);
    let cases: Vec<(&str, Vec<Batch>, &str)> = vec![
        (
            "100,001 rows in one batch",
            vec![too_many_rows],
            "batch of 100001 rows is too large (at most 100000)",
        ),
        ("seq 0", vec![batch(0, 1, false)], "seq must start at 1"),
        (
            "a seq jump past the limit",
            vec![batch(1, 1, false), batch(1_000_000_002, 1, false)],
            "jumps more than 1000000000 past the last accepted seq 1",
        ),
        (
            "a 257-byte layer name",
            vec![long_layer(257)],
            "layer of 257 bytes is too long (at most 256)",
        ),
        (
            "a 4097-byte event message",
            vec![long_event],
            "message of 4097 bytes is too long (at most 4096)",
        ),
    ];
    for (n, (what, batches, says)) in cases.into_iter().enumerate() {
        let (mut stream, _) = open(&addr, hello(&format!("limits-{n}"), 0)).await.unwrap();
        for b in batches {
            stream.send(b).await;
        }
        let status = stream.error().await;
        assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
        assert!(status.message().contains(says), "{what}: {status:?}");
        bystander.lands_a_batch().await;
    }

    // A stream that opens with a Batch, or sends a second Hello.
    let status = open_with(&addr, batch_message(batch(1, 1, false)))
        .await
        .err()
        .expect("a Batch first is refused");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status
            .message()
            .contains("first message of a stream must be a Hello"),
        "{status:?}"
    );
    let (mut twice, _) = open(&addr, hello("twice", 0)).await.unwrap();
    twice.send(batch(1, 4, false)).await;
    twice.send_message(hello_message("twice", 0)).await;
    let status = twice.error().await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status
            .message()
            .contains("a stream carries one Hello, first"),
        "{status:?}"
    );
    bystander.lands_a_batch().await;

    // At the limits exactly, everything is accepted.
    let (mut edge, _) = open(&addr, hello("edge", 0)).await.unwrap();
    edge.send(batch(1, 100_000, false)).await;
    let mut b = long_layer(256);
    b.seq = 1_000_000_001;
    // The largest jump, declared as batches the agent dropped (acks.rs).
    b.dropped_from = 2;
    b.r#final = true;
    edge.send(b).await;
    assert_eq!(edge.acked(1_000_000_001).await, 1_000_000_001);

    let rows = bystander.rows();
    drop((bystander, edge));
    assert!(collector.stop());
    let out = dir.path();
    bystander_landed(out, rows);
    assert_eq!(count(out, "steps", "run_id = 'edge'"), 100_000);
    assert_eq!(count(out, "layers", "run_id = 'edge'"), 1);
    // A refused batch stores nothing; the batch before it on that stream stays.
    assert_eq!(count(out, "steps", "run_id like 'limits-%'"), 1);
    assert_eq!(count(out, "steps", "run_id = 'twice'"), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn millions_of_empty_rows_are_refused_before_they_are_allocated() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &FAST);
    let mut bystander = Bystander::open(&collector.addr).await;
    bystander.lands_a_batch().await;
    let before = peak_rss_bytes(collector.pid());

    // 8 million empty step rows: 2 bytes each on the wire (16 MB, under the
    // 16 MiB message limit), about 240 bytes each once decoded (1.8 GB).
    let rows = 8_000_000usize;
    let mut inner = vec![0x08, 0x01]; // seq = 1
    inner.extend(std::iter::repeat_n([0x1a, 0x00], rows).flatten());
    let mut message = vec![0x12]; // AgentMessage.batch
    let mut len = inner.len();
    while len >= 0x80 {
        message.push(len as u8 | 0x80);
        len >>= 7;
    }
    message.push(len as u8);
    message.extend_from_slice(&inner);
    let hello_frame = frame(0, &hello_message("sparse", 0).encode_to_vec());
    let status = raw_call(&collector.addr, [hello_frame, frame(0, &message)].concat()).await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status
            .message()
            .contains("batch of 8000000 rows is too large (at most 100000)"),
        "{status:?}"
    );
    let grown = peak_rss_bytes(collector.pid()).saturating_sub(before);
    assert!(
        grown < 256 * 1024 * 1024,
        "refusing 16 MB of empty rows raised the collector's peak memory by {grown} bytes"
    );
    bystander.lands_a_batch().await;
    let rows = bystander.rows();
    drop(bystander);
    assert!(collector.stop());
    bystander_landed(dir.path(), rows);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_seqs_are_acknowledged_on_a_new_stream_and_refused_on_the_same_one() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &FAST);
    let (mut stream, _) = open(&collector.addr, hello("reuse", 2)).await.unwrap();
    for seq in [1, 2, 3] {
        stream.send(batch(seq, 10, false)).await;
    }
    assert_eq!(stream.acked(3).await, 3);
    // A seq that does not increase on its stream ends that stream (acks.rs has
    // the rules); nothing of it is stored.
    stream.send(batch(2, 10, false)).await;
    let status = stream.error().await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    // Resent on a new stream after a reconnect: acknowledged, stored once.
    let (mut again, durable) = open(&collector.addr, hello("reuse", 2)).await.unwrap();
    assert_eq!(durable, 3);
    for seq in 1..=4 {
        again.send(batch(seq, 10, seq == 4)).await;
    }
    assert_eq!(again.acked(4).await, 4);
    drop(again);
    assert!(collector.stop());
    let out = dir.path();
    assert_eq!(count(out, "steps", ""), 40);
    let dups = duckdb(&format!(
        "select count(*) from (select step from {} group by step having count(*) > 1)",
        table(out, "steps")
    ));
    assert_eq!(dups.trim(), "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_floats_and_long_unicode_labels_are_stored_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let collector = CollectorProc::start(dir.path(), &FAST);
    let floats = [
        f64::NAN,
        -f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        -0.0,
        0.0,
        5e-324, // the smallest subnormal
        f64::MAX,
    ];
    let names = [
        // Exactly 256 bytes: 85 three-byte characters and one ASCII.
        format!("{}a", "层".repeat(85)),
        // Combining marks, a ZWJ emoji sequence, right-to-left text.
        format!("e\u{301}.👩\u{200d}🔬.{}", "مرحبا".repeat(20)),
        "model.blocks.0.attn'; drop table layers; --,\"quoted\"".to_string(),
        "🦀".repeat(64), // 256 bytes of 4-byte characters
    ];
    for name in &names {
        assert!(name.len() <= 256, "{} bytes", name.len());
    }
    let mut b = batch(1, 0, true);
    b.steps = floats
        .iter()
        .enumerate()
        .map(|(i, &x)| StepRow {
            step: i as u64,
            step_ms: x,
            loss: Some(x),
            ..Default::default()
        })
        .collect();
    b.layers = names
        .iter()
        .enumerate()
        .map(|(i, name)| LayerRow {
            step: i as u64,
            layer: name.clone(),
            stable_rank: Some(floats[i]),
            ..Default::default()
        })
        .collect();
    let (mut stream, _) = open(&collector.addr, hello("odd", 0)).await.unwrap();
    stream.send(b).await;
    assert_eq!(stream.acked(1).await, 1);
    drop(stream);
    assert!(collector.stop());

    let out = dir.path();
    // The sign of -0.0 is checked on `loss`, an `optional` field: prost's encoder
    // (the sender's side) drops -0.0 from implicit-presence doubles such as
    // `step_ms`, as if it were the default +0.0 (tokio-rs/prost#1177).
    let counts = duckdb(&format!(
        "select count(*) filter (where isnan(loss)), \
                count(*) filter (where isinf(loss) and loss > 0), \
                count(*) filter (where isinf(loss) and loss < 0), \
                count(*) filter (where loss = 0 and signbit(loss)), \
                count(*) filter (where loss = 0 and not signbit(loss)), \
                count(*) filter (where loss = 5e-324), \
                count(*) filter (where loss = 1.7976931348623157e308), \
                count(*) filter (where isnan(step_ms)), \
                count(*) filter (where isinf(step_ms)) \
         from {}",
        table(out, "steps")
    ));
    assert_eq!(counts.trim(), "2,1,1,1,1,1,1,2,2");
    // Each name, byte for byte, in step order.
    let stored = duckdb(&format!(
        "select hex(layer) from {} order by step",
        table(out, "layers")
    ));
    let expected: Vec<String> = names
        .iter()
        .map(|n| n.bytes().map(|b| format!("{b:02X}")).collect())
        .collect();
    assert_eq!(stored.lines().collect::<Vec<_>>(), expected);
    let ranks = duckdb(&format!(
        "select count(*) filter (where isnan(stable_rank)), count(*) filter (where isinf(stable_rank)) from {}",
        table(out, "layers")
    ));
    assert_eq!(ranks.trim(), "2,2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_like_run_ids_are_refused_and_touch_no_folder() {
    let root = tempfile::tempdir().unwrap();
    let out = root.path().join("out");
    let collector = CollectorProc::start(&out, &FAST);
    let mut bystander = Bystander::open(&collector.addr).await;
    for bad in [
        "..%2f",
        "..%2fetc",
        "%2e%2e",
        "a\\b",
        "..\\..\\x",
        "a\0b",
        "run\0",
        "C:",
        "C:\\Windows",
        "c:/x",
        "run/",
        "./run",
        ".",
        "~root",
        "$HOME",
        "run\n",
        "ｒｕｎ", // full-width letters
        "\u{202e}run",
        "run=1/x",
        "/",
    ] {
        let status = open(&collector.addr, hello(bad, 0))
            .await
            .err()
            .unwrap_or_else(|| panic!("{bad:?} was accepted"));
        assert_eq!(status.code(), Code::InvalidArgument, "{bad:?}");
        assert!(
            status.message().contains("run id") && status.message().contains("is not allowed"),
            "{bad:?}: {status:?}"
        );
    }
    bystander.lands_a_batch().await;
    let rows = bystander.rows();
    drop(bystander);
    assert!(collector.stop());
    // Nothing was created beside the output directory, and inside it only the
    // bystander's run.
    let beside: Vec<_> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(beside, ["out"]);
    let runs: Vec<_> = std::fs::read_dir(out.join("steps"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(runs, ["run_id=bystander"]);
    bystander_landed(&out, rows);
}
