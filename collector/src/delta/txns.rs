//! Every app id's `txn` version in one table's log ([`TxnIndex`]), read once and
//! then kept up to date one new commit at a time.
//!
//! delta-rs looks one app id up per call, and each call replays the log (the
//! last checkpoint and every commit since, on object storage a request each): a
//! collector's first commit for R ranks made 8 × R replays, the cost that
//! dominated the Delta output per rank (BENCHMARKS.md, "Delta Lake output").
//! delta-rs has no call for all app ids at once (its kernel's is private), so
//! this module reads them as the protocol lays them out:
//!
//! - the last checkpoint (`_delta_log/_last_checkpoint` names it): its `txn`
//!   column holds the latest version of every app id up to it;
//! - each commit after it (`_delta_log/NNN.json`, one action per line): a
//!   `txn` line replaces the app id's version.
//!
//! A log of another shape (a multi-part or V2 checkpoint, or commits missing
//! before the checkpoint the hint names) makes [`TxnIndex::load`] answer none,
//! and the caller looks app ids up through delta-rs as before.

use std::collections::HashMap;

use arrow::array::{Array, AsArray, StructArray};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Int64Type};
use bytes::Bytes;
use deltalake::DeltaTableError;
use deltalake::logstore::LogStore;
use deltalake::logstore::object_store::{self, ObjectStoreExt as _};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

/// The latest `txn` version of every app id of a table, as of log version
/// [`TxnIndex::through`].
#[derive(Debug, Default)]
pub(crate) struct TxnIndex {
    /// The last log version read (none before commit 0 is read).
    through: Option<u64>,
    versions: HashMap<String, i64>,
}

/// What `_delta_log/_last_checkpoint` says.
#[derive(serde::Deserialize)]
struct LastCheckpoint {
    version: u64,
    /// Set for a multi-part checkpoint.
    parts: Option<u64>,
    /// Set for a V2 checkpoint.
    #[serde(rename = "v2Checkpoint")]
    v2_checkpoint: Option<serde_json::Value>,
}

/// A line of a commit that matters here: `{"txn": {"appId": …, "version": …}}`.
#[derive(serde::Deserialize)]
struct Line {
    txn: Option<Txn>,
}

#[derive(serde::Deserialize)]
struct Txn {
    #[serde(rename = "appId")]
    app_id: String,
    version: i64,
}

fn generic(message: String) -> DeltaTableError {
    DeltaTableError::Generic(message)
}

impl TxnIndex {
    /// Reads the index from the table's log up to its newest commit; none when
    /// the log has a shape this reader does not know (see the module header).
    pub(crate) async fn load(
        log_store: &dyn LogStore,
    ) -> Result<Option<TxnIndex>, DeltaTableError> {
        let store = log_store.object_store(None);
        let hint_path = log_store.log_path().clone().join("_last_checkpoint");
        let hint = match store.get(&hint_path).await {
            Ok(found) => Some(found.bytes().await?),
            Err(object_store::Error::NotFound { .. }) => None,
            Err(e) => return Err(e.into()),
        };
        let mut index = TxnIndex::default();
        if let Some(hint) = hint {
            let Ok(hint) = serde_json::from_slice::<LastCheckpoint>(&hint) else {
                return Ok(None);
            };
            if hint.parts.is_some_and(|p| p > 1) || hint.v2_checkpoint.is_some() {
                return Ok(None);
            }
            let path = log_store
                .log_path()
                .clone()
                .join(format!("{:020}.checkpoint.parquet", hint.version));
            let bytes = match store.get(&path).await {
                Ok(found) => found.bytes().await?,
                Err(object_store::Error::NotFound { .. }) => return Ok(None),
                Err(e) => return Err(e.into()),
            };
            index.read_checkpoint(bytes)?;
            index.through = Some(hint.version);
        } else if log_store.read_commit_entry(0).await?.is_none() {
            // No hint and no commit 0: the early commits were cleaned up.
            return Ok(None);
        }
        index.catch_up(log_store).await?;
        Ok(Some(index))
    }

    /// Reads the commits after [`TxnIndex::through`], up to the newest.
    pub(crate) async fn catch_up(
        &mut self,
        log_store: &dyn LogStore,
    ) -> Result<(), DeltaTableError> {
        loop {
            let next = self.through.map_or(0, |v| v + 1);
            let Some(commit) = log_store.read_commit_entry(next).await? else {
                return Ok(());
            };
            self.read_commit(&commit, next)?;
            self.through = Some(next);
        }
    }

    /// The `txn` version of `app_id` (0: none).
    pub(crate) fn get(&self, app_id: &str) -> u64 {
        self.versions.get(app_id).map_or(0, |v| (*v).max(0) as u64)
    }

    fn read_commit(&mut self, commit: &[u8], version: u64) -> Result<(), DeltaTableError> {
        for line in commit.split(|b| *b == b'\n') {
            // Most lines are other actions (`add`, `commitInfo`): skip them unparsed.
            if !line.windows(6).any(|w| w == b"\"txn\":") {
                continue;
            }
            let parsed: Line = serde_json::from_slice(line)
                .map_err(|e| generic(format!("commit {version} of the log: {e}")))?;
            if let Some(txn) = parsed.txn {
                self.versions.insert(txn.app_id, txn.version);
            }
        }
        Ok(())
    }

    fn read_checkpoint(&mut self, bytes: Bytes) -> Result<(), DeltaTableError> {
        let builder = ParquetRecordBatchReaderBuilder::try_new(bytes)?;
        let roots = builder.parquet_schema().root_schema().get_fields();
        let Some(txn) = roots.iter().position(|f| f.name() == "txn") else {
            return Ok(());
        };
        let mask = ProjectionMask::roots(builder.parquet_schema(), [txn]);
        for batch in builder.with_projection(mask).build()? {
            let batch = batch?;
            let txns: &StructArray = batch.column(0).as_struct();
            let (Some(ids), Some(versions)) =
                (txns.column_by_name("appId"), txns.column_by_name("version"))
            else {
                return Err(generic(
                    "the checkpoint's txn column lacks appId or version".into(),
                ));
            };
            let ids = cast(ids, &DataType::Utf8)?;
            let versions = cast(versions, &DataType::Int64)?;
            let (ids, versions) = (ids.as_string::<i32>(), versions.as_primitive::<Int64Type>());
            for i in 0..txns.len() {
                if txns.is_valid(i) && ids.is_valid(i) && versions.is_valid(i) {
                    self.versions
                        .insert(ids.value(i).to_string(), versions.value(i));
                }
            }
        }
        Ok(())
    }
}
