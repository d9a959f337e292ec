//! The output directory: Parquet files, committed atomically, and the commit log.
//!
//! # Layout
//!
//! ```text
//! OUT/<table>/run_id=<run>/part-<commit>-<n>.parquet      committed data, readable
//! OUT/<table>/run_id=<run>/.part-<commit>-<n>.parquet.tmp  being written, never globbed
//! OUT/_rankscope/commits/<commit>.json                     one record per commit
//! OUT/_rankscope/collectors/<epoch>.lock                   held (flock) while its collector runs
//! ```
//!
//! `<commit>` is `<epoch>-<n>`: `<epoch>` is random per collector start, `<n>`
//! counts that collector's commits. So several collectors can share one output
//! directory (each over its own ranks, see `rankscope_agent::config::CollectorList`):
//! no two ever write the same name.
//!
//! # Invariants
//!
//! - A `*.parquet` file is complete: readers globbing `*.parquet` never see a
//!   partial file, because files appear only by rename.
//! - Every watermark ever acknowledged is in a commit record whose files exist.
//!
//! [`commit`] says how a commit keeps them, and [`recovery`] how a restart
//! restores them after a crash.
//!
//! # Modules
//!
//! - this module: [`Store`] (opening the directory, this collector's lock file)
//!   and [`StoreError`], with the mapping of I/O errors to it;
//! - [`writer`]: how one Parquet file is encoded ([`writer::encode_parquet`]);
//! - [`commit`]: the four steps of [`Store::commit`] and the commit log's
//!   records;
//! - [`recovery`]: [`Store::recover`], after a crash.
//!
//! Imports go one way, down this list: `writer` imports nothing of the store,
//! `commit` imports this module and `writer`, `recovery` imports this module and
//! `commit`; this module imports none of them.

pub mod commit;
pub mod recovery;
pub mod writer;

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use parquet::errors::ParquetError;

/// Why a commit or recovery failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "the filesystem holding {dir} is full ({source}, writing {path}): free space there or restart the collector with --out on a larger disk; accepted rows stay buffered, unacknowledged, and the commit is retried"
    )]
    DiskFull {
        dir: PathBuf,
        path: PathBuf,
        source: io::Error,
    },
    #[error("cannot write {path}: {source} (is the disk full or read-only?)")]
    Io { path: PathBuf, source: io::Error },
    #[error("cannot encode {table} rows of run {run_id}: {source}")]
    Encode {
        table: &'static str,
        run_id: String,
        source: ParquetError,
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

/// Whether `e` says the filesystem (or the user's quota on it) is full.
fn is_disk_full(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded
    )
}

/// The output directory.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    row_group_rows: usize,
    /// Unique per process start, so two collector lifetimes never reuse a name.
    epoch: String,
    next: AtomicU64,
    /// Files of commits whose renames (step 3) failed: retried before each commit.
    unpublished: Mutex<Vec<(String, String)>>,
    /// `_rankscope/collectors/<epoch>.lock`, locked for the life of this store.
    lock: Option<(PathBuf, File)>,
}

impl Drop for Store {
    fn drop(&mut self) {
        if let Some((path, _file)) = &self.lock {
            let _ = fs::remove_file(path);
        }
    }
}

impl Store {
    /// Opens (creating) the output directory.
    pub fn open(dir: &Path, row_group_rows: usize) -> Result<Store, StoreError> {
        fs::create_dir_all(dir.join("_rankscope/commits")).map_err(io_err(dir))?;
        let locks = dir.join("_rankscope/collectors");
        fs::create_dir_all(&locks).map_err(io_err(&locks))?;
        let epoch = uuid::Uuid::new_v4().simple().to_string()[..12].to_string();
        let lock_path = locks.join(format!("{epoch}.lock"));
        let lock = File::create(&lock_path).map_err(io_err(&lock_path))?;
        lock.try_lock().map_err(|e| StoreError::Io {
            path: lock_path.clone(),
            source: io::Error::other(e.to_string()),
        })?;
        Ok(Store {
            dir: dir.to_path_buf(),
            row_group_rows: row_group_rows.max(1),
            epoch,
            next: AtomicU64::new(0),
            unpublished: Mutex::new(Vec::new()),
            lock: Some((lock_path, lock)),
        })
    }

    /// Maps an I/O error on `path`, telling a full disk apart.
    fn io_err<'a>(&'a self, path: &'a Path) -> impl FnOnce(io::Error) -> StoreError + 'a {
        move |source| {
            if is_disk_full(&source) {
                StoreError::DiskFull {
                    dir: self.dir.clone(),
                    path: path.to_path_buf(),
                    source,
                }
            } else {
                StoreError::Io {
                    path: path.to_path_buf(),
                    source,
                }
            }
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn commits_dir(&self) -> PathBuf {
        self.dir.join("_rankscope/commits")
    }
}

#[cfg(test)]
mod tests;
