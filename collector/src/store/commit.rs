//! A commit: how buffered rows become durable files, and the commit log that
//! says which files and watermarks each commit made durable.
//!
//! A commit writes every (table, run) group it holds as one Parquet file
//! ([`writer`]), in four steps:
//!
//! 1. write each file under its hidden temporary name, fsync it;
//! 2. write the commit record (the files' names and the per-(run, rank) `seq`
//!    watermarks it makes durable) to a temporary name, fsync, rename it into
//!    `_rankscope/commits/` and fsync the folder: **this rename is the commit point**;
//! 3. rename every temporary file to its final name, fsync the folders;
//! 4. only then are the watermarks acknowledged to agents.
//!
//! A failure before the commit point (a full disk, say) removes every temporary
//! file the commit wrote and returns the error: nothing of it is visible, the
//! rows stay buffered and the commit is retried. A failure after it (a rename in
//! step 3) does not undo the commit: its watermarks are durable, so it is
//! reported as committed and the renames are retried before the next commit (or
//! by [`Store::recover`] at the next start).
//!
//! The names a commit gives its files and records, and `epoch_of` that reads
//! them back, are here.
//!
//! Imports the store ([`Store`], [`StoreError`]) and [`writer`]; `recovery`
//! imports it (the records, `epoch_of`, the renames of step 3).

use std::collections::HashSet;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::Path;
use std::sync::atomic::Ordering;

use arrow::array::RecordBatch;
use parquet::errors::ParquetError;
use serde::{Deserialize, Serialize};

use super::writer;
use super::{Store, StoreError};
use crate::buffer::Pending;
use crate::table::Table;

/// One commit record, as stored in `_rankscope/commits/<commit>.json`.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct CommitRecord {
    /// Paths relative to the output directory: (temporary, final).
    pub(super) files: Vec<(String, String)>,
    pub(super) watermarks: Vec<Watermark>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Watermark {
    pub(super) run_id: String,
    pub(super) rank: u32,
    pub(super) seq: u64,
}

/// What one commit wrote.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CommitSummary {
    pub files: usize,
    pub rows: usize,
}

/// The epoch in a commit record's or temporary file's name
/// (`<epoch>-<n>.json`, `.<epoch>-<n>.json.tmp`, `.part-<epoch>-<n>-<k>.parquet.tmp`).
pub(super) fn epoch_of(name: &str) -> &str {
    let name = name.strip_prefix('.').unwrap_or(name);
    let name = name.strip_prefix("part-").unwrap_or(name);
    name.split(['-', '.']).next().unwrap_or("")
}

/// The I/O error a Parquet error wraps, or the Parquet error itself.
fn parquet_io(e: ParquetError) -> Result<io::Error, ParquetError> {
    match e {
        ParquetError::External(inner) => inner
            .downcast::<io::Error>()
            .map(|io| *io)
            .map_err(ParquetError::External),
        other => Err(other),
    }
}

impl Store {
    /// Writes `pending` as one atomic commit (see the module header).
    ///
    /// An error means nothing of `pending` was committed: every file it wrote is
    /// removed and the caller keeps the rows. Success means its watermarks are
    /// durable, even when some final renames must still be retried.
    pub fn commit(&self, pending: &Pending) -> Result<CommitSummary, StoreError> {
        self.retry_unpublished();
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
                if group.rows() == 0 {
                    continue;
                }
                let folder = format!("{}/run_id={run_id}", table.name());
                let folder_path = self.dir.join(&folder);
                fs::create_dir_all(&folder_path).map_err(self.io_err(&folder_path))?;
                let tmp = format!("{folder}/.part-{commit}-{n}.parquet.tmp");
                let fin = format!("{folder}/part-{commit}-{n}.parquet");
                written.push(self.dir.join(&tmp));
                self.write_parquet(&self.dir.join(&tmp), table, run_id, group.batches())?;
                rows += group.rows();
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
            self.write_synced(&record_tmp, &json)?;
            let record_path = self.commits_dir().join(format!("{commit}.json"));
            fs::rename(&record_tmp, &record_path).map_err(self.io_err(&record_path))?;
            if let Err(e) = self.sync_dir(&self.commits_dir()) {
                // The record is in place but maybe not durable: take it back so
                // the rows are retried, unless it cannot be taken back, in which
                // case the commit stands (recovery will honour the record).
                if fs::remove_file(&record_path).is_ok() {
                    return Err(e);
                }
                tracing::warn!(error = %e, record = %record_path.display(), "commit folder not synced; keeping the commit");
            }
            Ok(())
        })();
        if let Err(e) = result {
            // Not committed: remove what was written so a retry starts clean.
            for path in written {
                let _ = fs::remove_file(path);
            }
            return Err(e);
        }
        // Past the commit point: a failed rename is retried, never undone.
        if let Err(error) = self.publish(&files) {
            tracing::error!(%error, "committed files not yet renamed into place; retrying before the next commit");
            self.unpublished
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(files.iter().cloned());
        }
        Ok(CommitSummary {
            files: files.len(),
            rows,
        })
    }

    /// Retries the renames of earlier commits that failed after their commit point.
    fn retry_unpublished(&self) {
        let mut unpublished = self.unpublished.lock().unwrap_or_else(|e| e.into_inner());
        if unpublished.is_empty() {
            return;
        }
        match self.publish(&unpublished) {
            Ok(()) => {
                tracing::info!(
                    files = unpublished.len(),
                    "committed files renamed into place"
                );
                unpublished.clear();
            }
            Err(error) => tracing::warn!(%error, "committed files still not renamed into place"),
        }
    }

    /// Renames committed temporary files to their final names.
    pub(super) fn publish(&self, files: &[(String, String)]) -> Result<(), StoreError> {
        let mut folders = HashSet::new();
        for (tmp, fin) in files {
            let (tmp, fin) = (self.dir.join(tmp), self.dir.join(fin));
            if tmp.exists() {
                fs::rename(&tmp, &fin).map_err(self.io_err(&fin))?;
            }
            if let Some(parent) = fin.parent() {
                folders.insert(parent.to_path_buf());
            }
        }
        for folder in folders {
            self.sync_dir(&folder)?;
        }
        Ok(())
    }

    fn write_parquet(
        &self,
        path: &Path,
        table: Table,
        run_id: &str,
        batches: &[RecordBatch],
    ) -> Result<(), StoreError> {
        let file = File::create(path).map_err(self.io_err(path))?;
        let file =
            writer::encode_parquet(file, table, batches, self.row_group_rows).map_err(|error| {
                match parquet_io(error) {
                    Ok(io) => self.io_err(path)(io),
                    Err(source) => StoreError::Encode {
                        table: table.name(),
                        run_id: run_id.to_string(),
                        source,
                    },
                }
            })?;
        file.sync_all().map_err(self.io_err(path))
    }

    fn write_synced(&self, path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
        let mut f = File::create(path).map_err(self.io_err(path))?;
        f.write_all(bytes).map_err(self.io_err(path))?;
        f.sync_all().map_err(self.io_err(path))
    }

    fn sync_dir(&self, dir: &Path) -> Result<(), StoreError> {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(self.io_err(dir))
    }
}
