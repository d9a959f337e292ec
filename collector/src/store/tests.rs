//! The output directory's tests: commits, recovery and the files' row groups,
//! through [`Store`].

use std::fs::{self, File};
use std::path::{Path, PathBuf};

use super::commit::epoch_of;
use super::*;
use crate::buffer::{BatchRecords, Pending};
use crate::table::Table;
use rankscope_proto::v1::{Batch, StepRow};

/// Batch `seq` of `rank` of run "run", with `steps` step rows.
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
        ..Default::default()
    };
    let bytes = prost::Message::encode_to_vec(&batch);
    crate::wire::decode_batch(&bytes, &[0; Table::ALL.len()])
        .expect("prost's encoding decodes")
        .finish("run", rank)
}

fn parquet_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for run in fs::read_dir(dir.join("steps")).unwrap().flatten() {
        for f in fs::read_dir(run.path()).unwrap().flatten() {
            out.push(f.path());
        }
    }
    out
}

#[test]
fn commit_writes_final_files_only_and_returns_watermarks() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1000).unwrap();
    let mut p = Pending::default();
    p.push_batch("run", 0, batch(0, 1, 10));
    p.push_batch("run", 1, batch(1, 4, 5));
    let summary = store.commit(&p).unwrap();
    assert_eq!(summary.rows, 15);
    assert_eq!(p.watermarks()[&("run".into(), 1)], 4);
    let files = parquet_files(dir.path());
    assert_eq!(files.len(), 1);
    assert!(files[0].to_str().unwrap().ends_with(".parquet"));
    let reader =
        parquet::file::reader::SerializedFileReader::new(File::open(&files[0]).unwrap()).unwrap();
    use parquet::file::reader::FileReader;
    assert_eq!(reader.metadata().file_metadata().num_rows(), 15);
}

#[test]
fn recover_finishes_committed_renames_and_drops_orphans() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1000).unwrap();
    let mut p = Pending::default();
    p.push_batch("run", 2, batch(2, 9, 3));
    store.commit(&p).unwrap();
    // Simulate a crash between the commit point and the rename.
    let fin = parquet_files(dir.path()).pop().unwrap();
    let name = fin.file_name().unwrap().to_str().unwrap();
    let tmp = fin.with_file_name(format!(".{name}.tmp"));
    fs::rename(&fin, &tmp).unwrap();
    // And an orphan that no record names.
    let orphan = fin.with_file_name(".part-orphan-0.parquet.tmp");
    fs::write(&orphan, b"half a file").unwrap();
    // The crashed collector's lock is released.
    drop(store);

    let store = Store::open(dir.path(), 1000).unwrap();
    let watermarks = store.recover().unwrap();
    assert_eq!(watermarks[&("run".into(), 2)], 9);
    assert!(fin.exists());
    assert!(!tmp.exists());
    assert!(!orphan.exists());
}

#[test]
fn a_rename_failing_after_the_commit_point_keeps_the_commit() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 1000).unwrap();
    // A folder squatting on the final name makes step 3's rename fail.
    let folder = dir.path().join("steps/run_id=run");
    let squatter = folder.join(format!("part-{}-000000-0.parquet", store.epoch));
    fs::create_dir_all(squatter.join("inside")).unwrap();
    let mut p = Pending::default();
    p.push_batch("run", 0, batch(0, 1, 10));
    // Committed: the watermark is durable, so the rows must not be retried
    // (a retry would store them twice once the rename succeeds).
    assert_eq!(store.commit(&p).unwrap().rows, 10);
    let tmp = folder.join(format!(".part-{}-000000-0.parquet.tmp", store.epoch));
    assert!(tmp.exists(), "committed, waiting for its rename");

    fs::remove_dir_all(&squatter).unwrap();
    let mut next = Pending::default();
    next.push_batch("run", 0, batch(0, 2, 5));
    store.commit(&next).unwrap();
    assert!(!tmp.exists(), "the earlier rename was retried");
    let mut rows = 0;
    for f in parquet_files(dir.path()) {
        use parquet::file::reader::FileReader;
        let reader =
            parquet::file::reader::SerializedFileReader::new(File::open(f).unwrap()).unwrap();
        rows += reader.metadata().file_metadata().num_rows();
    }
    assert_eq!(rows, 15, "each row once");
    let watermarks = Store::open(dir.path(), 1000).unwrap().recover().unwrap();
    assert_eq!(watermarks[&("run".into(), 0)], 2);
}

#[test]
fn recovery_leaves_a_running_collector_alone() {
    let dir = tempfile::tempdir().unwrap();
    let running = Store::open(dir.path(), 1000).unwrap();
    let folder = dir.path().join("steps/run_id=run");
    fs::create_dir_all(&folder).unwrap();
    // The running collector's commit in progress: steps 1 and 2 begun.
    let live_tmp = folder.join(format!(".part-{}-000003-0.parquet.tmp", running.epoch));
    let live_record = dir.path().join(format!(
        "_rankscope/commits/.{}-000003.json.tmp",
        running.epoch
    ));
    fs::write(&live_tmp, b"being written").unwrap();
    fs::write(&live_record, b"{}").unwrap();
    // A killed collector's leftovers: its lock file, no longer locked.
    let dead = "deadbeef0000";
    let dead_lock = dir
        .path()
        .join(format!("_rankscope/collectors/{dead}.lock"));
    fs::write(&dead_lock, b"").unwrap();
    let dead_tmp = folder.join(format!(".part-{dead}-000000-0.parquet.tmp"));
    fs::write(&dead_tmp, b"half a file").unwrap();

    let restarted = Store::open(dir.path(), 1000).unwrap();
    restarted.recover().unwrap();
    assert!(
        live_tmp.exists() && live_record.exists(),
        "not ours to touch"
    );
    assert!(
        !dead_tmp.exists() && !dead_lock.exists(),
        "cleaned up after"
    );
    assert_ne!(restarted.epoch, running.epoch);

    drop(running);
    Store::open(dir.path(), 1000).unwrap().recover().unwrap();
    assert!(
        !live_tmp.exists() && !live_record.exists(),
        "gone once it stopped"
    );
    assert_eq!(
        epoch_of(".part-0123abcd4567-000001-2.parquet.tmp"),
        "0123abcd4567"
    );
    assert_eq!(epoch_of("0123abcd4567-000001.json"), "0123abcd4567");
    assert_eq!(epoch_of(".0123abcd4567-000001.json.tmp"), "0123abcd4567");
}

#[test]
fn row_groups_follow_the_configured_size() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), 4).unwrap();
    let mut p = Pending::default();
    p.push_batch("run", 0, batch(0, 1, 10));
    store.commit(&p).unwrap();
    let f = parquet_files(dir.path()).pop().unwrap();
    use parquet::file::reader::FileReader;
    let reader = parquet::file::reader::SerializedFileReader::new(File::open(f).unwrap()).unwrap();
    assert_eq!(reader.metadata().num_row_groups(), 3);
}
