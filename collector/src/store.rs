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
//! A commit writes every (table, run) group it holds as one Parquet file (ZSTD,
//! encodings chosen per column type by `writer_properties`, one row group of up to
//! `row_group_rows` rows),
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
//! A failure before the commit point (a full disk, say) removes every temporary
//! file the commit wrote and returns the error: nothing of it is visible, the
//! rows stay buffered and the commit is retried. A failure after it (a rename in
//! step 3) does not undo the commit: its watermarks are durable, so it is
//! reported as committed and the renames are retried before the next commit (or
//! by [`Store::recover`] at the next start).
//!
//! # After a crash
//!
//! [`Store::recover`] reads every commit record: it finishes the renames of
//! committed files (step 3 interrupted), deletes every temporary file that no
//! record names (step 1 or 2 interrupted: those rows were never acknowledged,
//! so their agents still hold and resend them), and returns the highest
//! watermark per (run, rank), from which deduplication resumes.
//!
//! It only touches the temporary files and records of collectors that are gone:
//! those whose `<epoch>.lock` it can lock (the kernel releases a killed process's
//! lock) or that have no lock file (a collector from before the lock files).
//! The temporaries of a collector still running on the same directory are its
//! commit in progress, and are left to it. The lock files of the collectors it
//! cleaned up after are removed; a collector that stops removes its own.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Schema};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::errors::ParquetError;
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;
use serde::{Deserialize, Serialize};

use crate::buffer::{Pending, RankKey};
use crate::table::{self, Table};

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

/// Properties of a Parquet file of `schema`: zstd, and per column the encoding
/// that suits its values. Values are stored as `table::columns` types them:
/// `layers`' measured values as float32 (`Kind::F32` says why), every other
/// float as float64.
/// - Float columns (measured values) use BYTE_STREAM_SPLIT, which groups the
///   bytes of each position so zstd finds the shared exponents and leading
///   mantissa bytes.
/// - Integer and timestamp columns (`rank`, `seq`, `step`, `time`, shapes,
///   counts) use DELTA_BINARY_PACKED: they are constant within a batch or grow
///   by small steps, which packs to a few bits a value without the dictionary's
///   hashing of every value.
/// - Strings (`run_id`, `layer`, labels) are dictionary encoded.
/// - zstd level 1: level 3 made files at most 3 % smaller on these encodings
///   and cost more CPU per row.
/// - Min/max statistics are kept for integer and timestamp columns, the ones
///   queries filter on (`step`, `time`, `rank`); none for floats and strings,
///   whose per-value comparisons cost about 5 % of the collector's CPU.
///
/// BENCHMARKS.md has the measurements behind each choice.
fn writer_properties(schema: &Schema, row_group_rows: usize) -> WriterProperties {
    let mut props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(
            ZstdLevel::try_new(1).expect("valid level"),
        ))
        .set_dictionary_enabled(true)
        .set_statistics_enabled(EnabledStatistics::None)
        .set_max_row_group_row_count(Some(row_group_rows.max(1)))
        .set_created_by(format!("rankscope {}", env!("CARGO_PKG_VERSION")));
    for field in schema.fields() {
        let column = ColumnPath::from(field.name().as_str());
        let encoding = match field.data_type() {
            DataType::Float64 | DataType::Float32 => Encoding::BYTE_STREAM_SPLIT,
            DataType::Timestamp(..) | DataType::UInt32 | DataType::UInt64 | DataType::Int64 => {
                props =
                    props.set_column_statistics_enabled(column.clone(), EnabledStatistics::Page);
                Encoding::DELTA_BINARY_PACKED
            }
            _ => continue,
        };
        props = props
            .set_column_dictionary_enabled(column.clone(), false)
            .set_column_encoding(column, encoding);
    }
    props.build()
}

/// Encodes record batches of `table` (of one run) as one Parquet file into
/// `sink`, exactly as a commit does; returns the sink. Runs in memory for a
/// `Vec<u8>` sink (the `fuzzing` module does).
pub fn encode_parquet<W: Write + Send>(
    sink: W,
    table: Table,
    batches: &[RecordBatch],
    row_group_rows: usize,
) -> Result<W, ParquetError> {
    let schema = table::schema(table);
    let props = writer_properties(&schema, row_group_rows);
    let mut writer = ArrowWriter::try_new(sink, schema, Some(props))?;
    for batch in batches {
        writer.write(batch)?;
    }
    writer.into_inner()
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
    /// Files of commits whose renames (step 3) failed: retried before each commit.
    unpublished: Mutex<Vec<(String, String)>>,
    /// `_rankscope/collectors/<epoch>.lock`, locked for the life of this store.
    lock: Option<(PathBuf, File)>,
}

/// The epoch in a commit record's or temporary file's name
/// (`<epoch>-<n>.json`, `.<epoch>-<n>.json.tmp`, `.part-<epoch>-<n>-<k>.parquet.tmp`).
fn epoch_of(name: &str) -> &str {
    let name = name.strip_prefix('.').unwrap_or(name);
    let name = name.strip_prefix("part-").unwrap_or(name);
    name.split(['-', '.']).next().unwrap_or("")
}

/// Which collectors (by epoch) are gone, found by taking their locks; the locks
/// taken are held until the recovery ends.
struct Owners {
    dir: PathBuf,
    mine: String,
    known: HashMap<String, bool>,
    taken: Vec<(PathBuf, File)>,
}

impl Owners {
    /// Whether the collector that wrote files of `epoch` is gone.
    fn gone(&mut self, epoch: &str) -> bool {
        if epoch == self.mine {
            return false;
        }
        if let Some(gone) = self.known.get(epoch) {
            return *gone;
        }
        let path = self.dir.join(format!("{epoch}.lock"));
        let gone = match File::options().read(true).write(true).open(&path) {
            Err(_) => true,
            Ok(file) => match file.try_lock() {
                Ok(()) => {
                    self.taken.push((path, file));
                    true
                }
                Err(_) => false,
            },
        };
        self.known.insert(epoch.to_string(), gone);
        gone
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if let Some((path, _file)) = &self.lock {
            let _ = fs::remove_file(path);
        }
    }
}

/// Removes a file that another recovery may have removed first.
fn remove_if_there(path: &Path) -> Result<(), StoreError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(StoreError::Io {
            path: path.to_path_buf(),
            source: e,
        }),
        _ => Ok(()),
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
    fn publish(&self, files: &[(String, String)]) -> Result<(), StoreError> {
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
        let file = encode_parquet(file, table, batches, self.row_group_rows).map_err(|error| {
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

    /// Restores a consistent directory after a crash and returns the durable
    /// watermarks (see the module header).
    pub fn recover(&self) -> Result<HashMap<RankKey, u64>, StoreError> {
        let mut watermarks: HashMap<RankKey, u64> = HashMap::new();
        let mut committed = HashSet::new();
        let mut owners = Owners {
            dir: self.dir.join("_rankscope/collectors"),
            mine: self.epoch.clone(),
            known: HashMap::new(),
            taken: Vec::new(),
        };
        let commits = self.commits_dir();
        for entry in fs::read_dir(&commits).map_err(io_err(&commits))? {
            let path = entry.map_err(io_err(&commits))?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name.ends_with(".tmp") {
                if owners.gone(epoch_of(name)) {
                    remove_if_there(&path)?;
                }
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
            // A running collector renames its own files.
            if owners.gone(epoch_of(name)) {
                self.publish(&record.files)?;
            }
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
                    let name = file.file_name();
                    let name = name.to_str().unwrap_or("");
                    if is_tmp && !committed.contains(&rel) && owners.gone(epoch_of(name)) {
                        tracing::warn!(path = %path.display(), "discarding uncommitted temporary file");
                        remove_if_there(&path)?;
                    }
                }
            }
        }
        // Cleaned up after: their lock files go, still locked by us.
        for (path, _file) in owners.taken {
            let _ = fs::remove_file(path);
        }
        Ok(watermarks)
    }
}

#[cfg(test)]
mod tests;
