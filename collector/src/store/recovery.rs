//! Recovery: [`Store::recover`] restores a consistent directory after a crash.
//!
//! It reads every commit record: it finishes the renames of committed files
//! (step 3 of a [commit](super::commit) interrupted), deletes every temporary
//! file that no record names (step 1 or 2 interrupted: those rows were never
//! acknowledged, so their agents still hold and resend them), and returns the
//! highest watermark per (run, rank), from which deduplication resumes.
//!
//! It only touches the temporary files and records of collectors that are gone:
//! those whose `<epoch>.lock` it can lock (the kernel releases a killed process's
//! lock) or that have no lock file (a collector from before the lock files).
//! The temporaries of a collector still running on the same directory are its
//! commit in progress, and are left to it. The lock files of the collectors it
//! cleaned up after are removed; a collector that stops removes its own.
//!
//! Imports the store ([`Store`], [`StoreError`], `io_err`) and [`commit`](super::commit)
//! (the records it reads and the renames it finishes); nothing imports it.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use super::commit::{CommitRecord, epoch_of};
use super::{Store, StoreError, io_err};
use crate::buffer::RankKey;
use crate::table::Table;

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
