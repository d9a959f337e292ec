//! The Delta output's tests on a local disk (`delta:PATH`): commits, the
//! watermarks read back from the log, and a crash between two tables' commits.
//! The S3 path is tested end to end against a real S3 server (tests/tests/delta.rs).

use std::fs::File;

use arrow::array::{AsArray as _, RecordBatch};
use parquet::file::reader::{FileReader, SerializedFileReader};
use rankscope_proto::v1::{Batch, EventRow, StepRow};

use super::*;
use crate::buffer::{BatchRecords, Pending};

/// Batch `seq` of `rank` of run "run", with `steps` step rows and one event.
fn batch(rank: u32, seq: u64, steps: u64) -> BatchRecords {
    let batch = Batch {
        seq,
        steps: (0..steps)
            .map(|step| StepRow {
                step,
                step_ms: 1.0,
                ..Default::default()
            })
            .collect(),
        events: vec![EventRow {
            kind: "note".into(),
            ..Default::default()
        }],
        ..Default::default()
    };
    let bytes = prost::Message::encode_to_vec(&batch);
    crate::wire::decode_batch(&bytes, &[0; Table::ALL.len()])
        .expect("prost's encoding decodes")
        .finish("run", rank)
}

/// Rows of `table` that the table's current version holds, read from its files.
async fn rows(root: &std::path::Path, table: &str) -> usize {
    let url = Url::from_directory_path(root.join(table).canonicalize().unwrap()).unwrap();
    let table = DeltaTableBuilder::from_url(url)
        .unwrap()
        .load()
        .await
        .unwrap();
    table
        .get_file_uris()
        .unwrap()
        .map(|uri| {
            let path = Url::parse(&uri)
                .ok()
                .and_then(|url| url.to_file_path().ok())
                .unwrap_or_else(|| uri.into());
            let reader = SerializedFileReader::new(File::open(path).unwrap()).unwrap();
            reader.metadata().file_metadata().num_rows() as usize
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_is_read_back_and_its_watermarks_come_from_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let root = DeltaRoot::Local(dir.path().to_path_buf());
    let store = DeltaStore::open(&root, 1000).await.unwrap();
    let mut p = Pending::default();
    p.push_batch("run", 0, batch(0, 1, 10));
    p.push_batch("run", 0, batch(0, 2, 10));
    p.push_batch("run", 1, batch(1, 7, 5));
    let summary = store.commit(&p).await.unwrap();
    assert_eq!(summary.rows, 25 + 3);
    assert_eq!(rows(dir.path(), "steps").await, 25);
    assert_eq!(rows(dir.path(), "events").await, 3);
    // The partition folder readers expect.
    assert!(dir.path().join("steps/run_id=run").is_dir());
    drop(store);
    // A new collector on the same tables finds the watermarks in the log.
    let store = DeltaStore::open(&root, 1000).await.unwrap();
    assert_eq!(store.durable(&("run".into(), 0)).await.unwrap(), 2);
    assert_eq!(store.durable(&("run".into(), 1)).await.unwrap(), 7);
    assert_eq!(store.durable(&("run".into(), 2)).await.unwrap(), 0);
    assert_eq!(store.durable(&("other".into(), 0)).await.unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_two_tables_commits_duplicates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let root = DeltaRoot::Local(dir.path().to_path_buf());
    let store = DeltaStore::open(&root, 1000).await.unwrap();
    let mut first = Pending::default();
    first.push_batch("run", 0, batch(0, 1, 10));
    first.push_batch("run", 0, batch(0, 2, 10));
    // The crash: `steps` committed batches 1 and 2, no other table did, and no
    // watermark was recorded.
    {
        let mut targets = store.targets.lock().await;
        let steps = Table::ALL.iter().position(|t| *t == Table::Steps).unwrap();
        let target = &mut targets[steps];
        let mut only_steps = Pending::default();
        for seq in [1, 2] {
            let mut b = batch(0, seq, 10);
            b.tables.retain(|(t, _)| *t == Table::Steps);
            only_steps.push_batch("run", 0, b);
        }
        let (_, _, group) = only_steps.groups().next().unwrap();
        let cast: Vec<RecordBatch> = group
            .batches()
            .iter()
            .map(|b| {
                let schema = delta_schema(Table::Steps);
                let columns = b
                    .columns()
                    .iter()
                    .zip(schema.fields())
                    .map(|(c, f)| arrow::compute::cast(c, f.data_type()).unwrap())
                    .collect();
                RecordBatch::try_new(schema, columns).unwrap()
            })
            .collect();
        let mut writer = deltalake::writer::RecordBatchWriter::for_table(&target.table).unwrap();
        for b in cast {
            deltalake::writer::DeltaWriter::write(&mut writer, b)
                .await
                .unwrap();
        }
        let adds = deltalake::writer::DeltaWriter::flush(&mut writer)
            .await
            .unwrap();
        commit::commit_table(target, adds, vec![(("run".into(), 0), 2)])
            .await
            .unwrap();
    }
    drop(store);
    // The restarted collector says nothing is durable, so the agent resends
    // both batches and a third.
    let store = DeltaStore::open(&root, 1000).await.unwrap();
    assert_eq!(store.durable(&("run".into(), 0)).await.unwrap(), 0);
    let mut resent = first;
    resent.push_batch("run", 0, batch(0, 3, 10));
    store.commit(&resent).await.unwrap();
    assert_eq!(rows(dir.path(), "steps").await, 30, "each step row once");
    assert_eq!(rows(dir.path(), "events").await, 3, "each event once");
    assert_eq!(store.durable(&("run".into(), 0)).await.unwrap(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_collectors_commit_to_the_same_tables_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let root = DeltaRoot::Local(dir.path().to_path_buf());
    let a = Arc::new(DeltaStore::open(&root, 1000).await.unwrap());
    let b = Arc::new(DeltaStore::open(&root, 1000).await.unwrap());
    let mut tasks = Vec::new();
    for (store, rank) in [(a.clone(), 0), (b.clone(), 1)] {
        tasks.push(tokio::spawn(async move {
            for seq in 1..=6 {
                let mut p = Pending::default();
                p.push_batch("run", rank, batch(rank, seq, 4));
                store.commit(&p).await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(rows(dir.path(), "steps").await, 2 * 6 * 4);
    assert_eq!(a.durable(&("run".into(), 1)).await.unwrap(), 6);
    assert_eq!(b.durable(&("run".into(), 0)).await.unwrap(), 6);
}

#[tokio::test]
async fn an_unwritable_root_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let root = DeltaRoot::Local(file.clone());
    let error = DeltaStore::open(&root, 1000).await.unwrap_err().to_string();
    assert!(error.contains("a-file"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_query_layer_reads_a_table_with_the_collectors_schema() {
    let dir = tempfile::tempdir().unwrap();
    let root = DeltaRoot::Local(dir.path().to_path_buf());
    let store = DeltaStore::open(&root, 1000).await.unwrap();
    let mut p = Pending::default();
    p.push_batch("run", 0, batch(0, 1, 10));
    p.push_batch("run", 3, batch(3, 1, 5));
    store.commit(&p).await.unwrap();
    let mut counts = std::collections::BTreeMap::new();
    for batch in read::read_table(&root, Table::Steps).await.unwrap() {
        // Every column as the collector builds it (Delta stores `rank` as a
        // long), `run_id` put back from the partition.
        assert_eq!(batch.schema(), table::schema(Table::Steps));
        let runs = batch.column(0).as_string::<i32>();
        let ranks = batch
            .column(1)
            .as_primitive::<arrow::datatypes::UInt32Type>();
        for (run, rank) in runs.iter().zip(ranks.iter()) {
            assert_eq!(run, Some("run"));
            *counts.entry(rank.unwrap()).or_insert(0) += 1;
        }
    }
    assert_eq!(counts.into_iter().collect::<Vec<_>>(), [(0, 10), (3, 5)]);
    // A table never created reads as no rows.
    let empty = tempfile::tempdir().unwrap();
    let none = read::read_table(&DeltaRoot::Local(empty.path().into()), Table::Layers).await;
    assert!(none.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_txn_index_agrees_with_delta_rs_past_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let root = DeltaRoot::Local(dir.path().to_path_buf());
    let store = DeltaStore::open(&root, 1000).await.unwrap();
    // Past CHECKPOINT_INTERVAL versions of each table, ranks appearing and
    // moving on: some app ids only in the checkpoint, some only after it, some
    // in both.
    let commits = CHECKPOINT_INTERVAL + 6;
    for seq in 1..=commits {
        let mut p = Pending::default();
        for rank in [seq % 5, 5 + seq / 10] {
            p.push_batch("run", rank as u32, batch(rank as u32, seq, 2));
        }
        store.commit(&p).await.unwrap();
    }
    let steps = dir.path().join("steps/_delta_log");
    assert!(
        steps.join("_last_checkpoint").exists(),
        "the test needs a checkpoint"
    );
    let mut targets = store.targets.lock().await;
    for target in targets.iter_mut() {
        refresh(target).await.unwrap();
        let log_store = target.table.log_store();
        let index = txns::TxnIndex::load(log_store.as_ref())
            .await
            .unwrap()
            .expect("a single-file checkpoint reads");
        let state = target.table.snapshot().unwrap();
        for rank in 0..10u32 {
            let id = app_id(&("run".into(), rank));
            let expected = state
                .transaction_version(log_store.as_ref(), id.clone())
                .await
                .unwrap()
                .map_or(0, |v| v as u64);
            assert_eq!(index.get(&id), expected, "{} {id}", target.name);
        }
        assert_eq!(index.get("rankscope/other/0"), 0);
    }
}
