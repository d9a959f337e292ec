//! The output directory: Parquet files, committed atomically, and the commit log.
//!
//! # Layout
//!
//! ```text
//! OUT/<table>/run_id=<run>/part-<commit>-<n>.parquet      committed data, readable
//! OUT/<table>/run_id=<run>/.part-<commit>-<n>.parquet.tmp  being written, never globbed
//! OUT/_rankscope/commits/<commit>.json                     one record per commit
//! ```
//!
//! A commit writes every (table, run) group it holds as one Parquet file (ZSTD,
//! dictionary-encoded strings, one row group of up to `row_group_rows` rows),
//! in four steps:
//!
//! 1. write each file under its hidden temporary name, fsync it;
//! 2. write the commit record (the files' names and the per-(run, rank) `seq`
//!    watermarks it makes durable) to a temporary name, fsync, rename it into
//!    `_rankscope/commits/` and fsync the folder: **this rename is the commit point**;
//! 3. rename every temporary file to its final name, fsync the folders;
//! 4. only then are the watermarks acknowledged to agents.
//!
//! # Invariants
//!
//! - A `*.parquet` file is complete: readers globbing `*.parquet` never see a
//!   partial file, because files appear only by rename.
//! - Every watermark ever acknowledged is in a commit record whose files exist.
//!
//! # After a crash
//!
//! [`Store::recover`] reads every commit record: it finishes the renames of
//! committed files (step 3 interrupted), deletes every temporary file that no
//! record names (step 1 or 2 interrupted: those rows were never acknowledged,
//! so their agents still hold and resend them), and returns the highest
//! watermark per (run, rank), from which deduplication resumes.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use serde::{Deserialize, Serialize};

use crate::buffer::{Pending, RankKey};
use crate::table::Table;

/// Why a commit or recovery failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot write {path}: {source} (is the disk full or read-only?)")]
    Io { path: PathBuf, source: io::Error },
    #[error("cannot encode {table} rows of run {run_id}: {source}")]
    Encode {
        table: &'static str,
        run_id: String,
        source: parquet::errors::ParquetError,
    },
    #[error("commit record {path} is unreadable: {source}")]
    Record {
        path: PathBuf,
        source: serde_json::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// One commit record, as stored in `_rankscope/commits/<commit>.json`.
#[derive(Debug, Serialize, Deserialize)]
struct CommitRecord {
    /// Paths relative to the output directory: (temporary, final).
    files: Vec<(String, String)>,
    watermarks: Vec<Watermark>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Watermark {
    run_id: String,
    rank: u32,
    seq: u64,
}

/// What one commit wrote.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CommitSummary {
    pub files: usize,
    pub rows: usize,
}

/// The output directory.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    row_group_rows: usize,
    /// Unique per process start, so two collector lifetimes never reuse a name.
    epoch: String,
    next: AtomicU64,
}

impl Store {
    /// Opens (creating) the output directory.
    pub fn open(dir: &Path, row_group_rows: usize) -> Result<Store, StoreError> {
        fs::create_dir_all(dir.join("_rankscope/commits")).map_err(io_err(dir))?;
        let epoch = uuid::Uuid::new_v4().simple().to_string()[..12].to_string();
        Ok(Store {
            dir: dir.to_path_buf(),
            row_group_rows: row_group_rows.max(1),
            epoch,
            next: AtomicU64::new(0),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn commits_dir(&self) -> PathBuf {
        self.dir.join("_rankscope/commits")
    }

    /// Writes `pending` as one atomic commit (see the module header).
    pub fn commit(&self, pending: &Pending) -> Result<CommitSummary, StoreError> {
        let watermarks = pending.watermarks();
        let commit = format!(
            "{}-{:06}",
            self.epoch,
            self.next.fetch_add(1, Ordering::Relaxed)
        );
        let mut files = Vec::new();
        let mut rows = 0;
        let mut written = Vec::new();
        let result = (|| {
            for (n, (table, run_id, group)) in pending.groups().enumerate() {
                if group.is_empty() {
                    continue;
                }
                let folder = format!("{}/run_id={run_id}", table.name());
                fs::create_dir_all(self.dir.join(&folder)).map_err(io_err(&self.dir))?;
                let tmp = format!("{folder}/.part-{commit}-{n}.parquet.tmp");
                let fin = format!("{folder}/part-{commit}-{n}.parquet");
                written.push(self.dir.join(&tmp));
                self.write_parquet(&self.dir.join(&tmp), table, run_id, group)?;
                rows += group.len();
                files.push((tmp, fin));
            }
            let record = CommitRecord {
                files: files.clone(),
                watermarks: watermarks
                    .iter()
                    .map(|((run_id, rank), seq)| Watermark {
                        run_id: run_id.clone(),
                        rank: *rank,
                        seq: *seq,
                    })
                    .collect(),
            };
            let record_tmp = self.commits_dir().join(format!(".{commit}.json.tmp"));
            written.push(record_tmp.clone());
            let json = serde_json::to_vec(&record).expect("commit record serializes");
            write_synced(&record_tmp, &json)?;
            let record_path = self.commits_dir().join(format!("{commit}.json"));
            fs::rename(&record_tmp, &record_path).map_err(io_err(&record_path))?;
            sync_dir(&self.commits_dir())?;
            Ok(())
        })();
        if let Err(e) = result {
            // Not committed: remove what was written so a retry starts clean.
            for path in written {
                let _ = fs::remove_file(path);
            }
            return Err(e);
        }
        self.publish(&files)?;
        Ok(CommitSummary {
            files: files.len(),
            rows,
        })
    }

    /// Renames committed temporary files to their final names.
    fn publish(&self, files: &[(String, String)]) -> Result<(), StoreError> {
        let mut folders = HashSet::new();
        for (tmp, fin) in files {
            let (tmp, fin) = (self.dir.join(tmp), self.dir.join(fin));
            if tmp.exists() {
                fs::rename(&tmp, &fin).map_err(io_err(&fin))?;
            }
            if let Some(parent) = fin.parent() {
                folders.insert(parent.to_path_buf());
            }
        }
        for folder in folders {
            sync_dir(&folder)?;
        }
        Ok(())
    }

    fn write_parquet(
        &self,
        path: &Path,
        table: Table,
        run_id: &str,
        rows: &crate::table::Rows,
    ) -> Result<(), StoreError> {
        let encode = |source| StoreError::Encode {
            table: table.name(),
            run_id: run_id.to_string(),
            source,
        };
        let batch = rows.to_record_batch(run_id).map_err(|e| encode(e.into()))?;
        let props = WriterProperties::builder()
            .set_compression(Compression::ZSTD(
                ZstdLevel::try_new(3).expect("valid level"),
            ))
            .set_dictionary_enabled(true)
            .set_max_row_group_row_count(Some(self.row_group_rows))
            .set_created_by(format!("rankscope {}", env!("CARGO_PKG_VERSION")))
            .build();
        let file = File::create(path).map_err(io_err(path))?;
        let mut writer = ArrowWriter::try_new(file, batch.schema(), Some(props)).map_err(encode)?;
        writer.write(&batch).map_err(encode)?;
        let file = writer.into_inner().map_err(encode)?;
        file.sync_all().map_err(io_err(path))
    }

    /// Restores a consistent directory after a crash and returns the durable
    /// watermarks (see the module header).
    pub fn recover(&self) -> Result<HashMap<RankKey, u64>, StoreError> {
        let mut watermarks: HashMap<RankKey, u64> = HashMap::new();
        let mut committed = HashSet::new();
        let commits = self.commits_dir();
        for entry in fs::read_dir(&commits).map_err(io_err(&commits))? {
            let path = entry.map_err(io_err(&commits))?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name.ends_with(".tmp") {
                fs::remove_file(&path).map_err(io_err(&path))?;
                continue;
            }
            if !name.ends_with(".json") {
                continue;
            }
            let bytes = fs::read(&path).map_err(io_err(&path))?;
            let record: CommitRecord =
                serde_json::from_slice(&bytes).map_err(|source| StoreError::Record {
                    path: path.clone(),
                    source,
                })?;
            self.publish(&record.files)?;
            committed.extend(record.files.into_iter().map(|(tmp, _)| tmp));
            for w in record.watermarks {
                let wm = watermarks.entry((w.run_id, w.rank)).or_default();
                *wm = (*wm).max(w.seq);
            }
        }
        for table in Table::ALL {
            let folder = self.dir.join(table.name());
            let Ok(runs) = fs::read_dir(&folder) else {
                continue;
            };
            for run in runs.flatten() {
                let Ok(files) = fs::read_dir(run.path()) else {
                    continue;
                };
                for file in files.flatten() {
                    let path = file.path();
                    let is_tmp = path.extension().is_some_and(|e| e == "tmp");
                    let rel = path
                        .strip_prefix(&self.dir)
                        .map(|p| p.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    if is_tmp && !committed.contains(&rel) {
                        tracing::warn!(path = %path.display(), "discarding uncommitted temporary file");
                        fs::remove_file(&path).map_err(io_err(&path))?;
                    }
                }
            }
        }
        Ok(watermarks)
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let mut f = File::create(path).map_err(io_err(path))?;
    f.write_all(bytes).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rankscope_proto::v1::{Batch, StepRow};

    fn batch(seq: u64, steps: u64) -> Batch {
        Batch {
            seq,
            steps: (0..steps)
                .map(|step| StepRow {
                    step,
                    step_ms: 1.0,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
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
        p.push_batch("run", 0, batch(1, 10));
        p.push_batch("run", 1, batch(4, 5));
        let summary = store.commit(&p).unwrap();
        assert_eq!(summary.rows, 15);
        assert_eq!(p.watermarks()[&("run".into(), 1)], 4);
        let files = parquet_files(dir.path());
        assert_eq!(files.len(), 1);
        assert!(files[0].to_str().unwrap().ends_with(".parquet"));
        let reader =
            parquet::file::reader::SerializedFileReader::new(File::open(&files[0]).unwrap())
                .unwrap();
        use parquet::file::reader::FileReader;
        assert_eq!(reader.metadata().file_metadata().num_rows(), 15);
    }

    #[test]
    fn recover_finishes_committed_renames_and_drops_orphans() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 1000).unwrap();
        let mut p = Pending::default();
        p.push_batch("run", 2, batch(9, 3));
        store.commit(&p).unwrap();
        // Simulate a crash between the commit point and the rename.
        let fin = parquet_files(dir.path()).pop().unwrap();
        let name = fin.file_name().unwrap().to_str().unwrap();
        let tmp = fin.with_file_name(format!(".{name}.tmp"));
        fs::rename(&fin, &tmp).unwrap();
        // And an orphan that no record names.
        let orphan = fin.with_file_name(".part-orphan-0.parquet.tmp");
        fs::write(&orphan, b"half a file").unwrap();

        let store = Store::open(dir.path(), 1000).unwrap();
        let watermarks = store.recover().unwrap();
        assert_eq!(watermarks[&("run".into(), 2)], 9);
        assert!(fin.exists());
        assert!(!tmp.exists());
        assert!(!orphan.exists());
    }

    #[test]
    fn row_groups_follow_the_configured_size() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 4).unwrap();
        let mut p = Pending::default();
        p.push_batch("run", 0, batch(1, 10));
        store.commit(&p).unwrap();
        let f = parquet_files(dir.path()).pop().unwrap();
        use parquet::file::reader::FileReader;
        let reader =
            parquet::file::reader::SerializedFileReader::new(File::open(f).unwrap()).unwrap();
        assert_eq!(reader.metadata().num_row_groups(), 3);
    }
}
