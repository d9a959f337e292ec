//! One collector commit to the Delta output ([`DeltaStore::commit`]).
//!
//! For each table with rows, in [`Table::ALL`] order:
//!
//! 1. look up the table's `txn` version of every (run, rank) of the commit (the
//!    cache, else the log);
//! 2. drop the rows of batches the table already holds (`0 < seq <= version`:
//!    resent after a crash between two tables' commits), cast the rest to the
//!    Delta schema;
//! 3. write them as Parquet files under `run_id=<run>/` (delta-rs's
//!    `RecordBatchWriter`, with the encodings of [`crate::store::writer`]):
//!    invisible until step 4;
//! 4. commit their `add` actions with a `txn` per (run, rank) whose watermark
//!    passes the table's version: **this table's commit point**.
//!
//! Then commit the `txn` of every (run, rank) to the watermark table: **the
//! collector commit's point**, after which the watermarks are acknowledged.
//!
//! A commit that loses the race for the next log version to another writer is
//! retried, rebased on the new version, with backoff and jitter from
//! [`RETRY_FIRST`] up to [`RETRY_MAX`], for as long as it takes: a conflict
//! means another collector's commit landed, so the table moves and ours lands
//! eventually. Any other failure (the store unreachable, say) ends the commit
//! with an error: the rows stay buffered, unacknowledged, and the committer
//! retries; tables that committed already skip those rows then (step 2). When a
//! failure leaves it unknown whether the log entry was written (a timeout after
//! the PUT), the table's `txn` version tells.

use std::collections::HashMap;
use std::time::Duration;

use arrow::array::{Array, BooleanArray, RecordBatch, UInt32Array, UInt64Array};
use arrow::compute::{cast, filter_record_batch};
use deltalake::DeltaTableError;
use deltalake::kernel::transaction::{CommitBuilder, CommitProperties};
use deltalake::kernel::{Action, Add, Transaction};
use deltalake::protocol::{DeltaOperation, SaveMode};
use deltalake::writer::{DeltaWriter, RecordBatchWriter};
use rand::Rng;

use super::{DeltaError, DeltaStore, Target, app_id, delta_schema, lookup, refresh};
use crate::buffer::{Pending, RankKey};
use crate::store::commit::CommitSummary;
use crate::store::writer;
use crate::table::Table;

/// delta-rs's own attempts at one commit (each rebased on the newest version)
/// before it reports a conflict to the loop here.
const DELTA_ATTEMPTS: usize = 15;
/// The first pause after a conflict reported by delta-rs.
pub const RETRY_FIRST: Duration = Duration::from_millis(100);
/// The longest pause between two attempts (before jitter).
pub const RETRY_MAX: Duration = Duration::from_secs(5);

impl DeltaStore {
    /// Commits `pending` (see the module header). An error means its watermarks
    /// are not durable: the caller keeps the rows, and a later commit of them
    /// writes only what the tables do not hold yet.
    pub async fn commit(&self, pending: &Pending) -> Result<CommitSummary, DeltaError> {
        let watermarks = pending.watermarks();
        let mut targets = self.targets.lock().await;
        let mut summary = CommitSummary::default();
        let (data, watermark_table) = targets.split_at_mut(Table::ALL.len());
        for (target, table) in data.iter_mut().zip(Table::ALL) {
            let groups: Vec<_> = pending
                .groups()
                .filter(|(t, _, group)| *t == table && group.rows() > 0)
                .collect();
            if groups.is_empty() {
                continue;
            }
            // A rank new to this collector may have moved here from another
            // collector, which may have committed its rows to this table: read
            // the log up to its newest commit before looking it up.
            if watermarks
                .keys()
                .any(|key| !target.versions.contains_key(key))
            {
                refresh(target).await?;
            }
            let mut held = HashMap::new();
            let mut txns = Vec::new();
            for (key, seq) in watermarks {
                let version = lookup(target, key).await?;
                held.insert(key.clone(), version);
                if *seq > version {
                    txns.push((key.clone(), *seq));
                }
            }
            let schema = delta_schema(table);
            let mut batches = Vec::new();
            for (_, run_id, group) in groups {
                for batch in group.batches() {
                    let Some(batch) = not_held(batch, run_id, &held) else {
                        continue;
                    };
                    let columns = batch
                        .columns()
                        .iter()
                        .zip(schema.fields())
                        .map(|(column, field)| cast(column, field.data_type()))
                        .collect::<Result<Vec<_>, _>>()
                        .and_then(|columns| RecordBatch::try_new(schema.clone(), columns))
                        .map_err(|source| DeltaError::Convert {
                            table: table.name(),
                            source,
                        })?;
                    batches.push(columns);
                }
            }
            if batches.is_empty() {
                continue;
            }
            let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
            let adds = self.write_files(target, table, batches).await?;
            summary.files += adds.len();
            summary.rows += rows;
            commit_table(target, adds, txns).await?;
        }
        let target = watermark_table
            .last_mut()
            .expect("the watermark table is opened");
        let mut txns = Vec::new();
        for (key, seq) in watermarks {
            if *seq > lookup(target, key).await? {
                txns.push((key.clone(), *seq));
            }
        }
        if !txns.is_empty() {
            commit_table(target, Vec::new(), txns).await?;
        }
        Ok(summary)
    }

    /// Writes `batches` as Parquet files of `target` (one per run, or more past
    /// the writer's file size); returns their `add` actions, not yet committed.
    async fn write_files(
        &self,
        target: &Target,
        table: Table,
        batches: Vec<RecordBatch>,
    ) -> Result<Vec<Add>, DeltaError> {
        let err = |source| DeltaError::Table {
            table: target.name.clone(),
            source: Box::new(source),
        };
        let props = writer::writer_properties(&delta_schema(table), self.row_group_rows);
        let mut files = RecordBatchWriter::for_table(&target.table)
            .map_err(err)?
            .with_writer_properties(props);
        for batch in batches {
            files.write(batch).await.map_err(err)?;
        }
        files.flush().await.map_err(err)
    }
}

/// The rows of `batch` (rows of run `run_id`) that the table does not hold yet:
/// `None` when it holds them all. `held` is the table's `txn` version per
/// (run, rank); rows with seq 0 (the collector's own) are always new.
fn not_held(
    batch: &RecordBatch,
    run_id: &str,
    held: &HashMap<RankKey, u64>,
) -> Option<RecordBatch> {
    let any_held = held.iter().any(|((run, _), v)| run == run_id && *v > 0);
    if !any_held {
        return Some(batch.clone());
    }
    let ranks = batch.column(1).as_any().downcast_ref::<UInt32Array>()?;
    let seqs = batch.column(2).as_any().downcast_ref::<UInt64Array>()?;
    let mut key = (run_id.to_string(), 0);
    let keep: BooleanArray = (0..batch.num_rows())
        .map(|i| {
            key.1 = ranks.value(i);
            let seq = seqs.value(i);
            Some(seq == 0 || seq > held.get(&key).copied().unwrap_or(0))
        })
        .collect();
    match keep.true_count() {
        0 => None,
        n if n == batch.num_rows() => Some(batch.clone()),
        _ => filter_record_batch(batch, &keep).ok(),
    }
}

/// Whether a failed commit lost the race for the next log version (retry) or
/// failed otherwise.
fn is_conflict(error: &DeltaTableError) -> bool {
    let text = format!("{error:?}");
    [
        "MaxCommitAttempts",
        "VersionAlreadyExists",
        "CommitConflict",
        "Conflict",
    ]
    .iter()
    .any(|needle| text.contains(needle))
}

/// Commits `adds` with the `txn` actions of `txns` ((run, rank), seq) to
/// `target`, retrying conflicts (see the module header); records the new
/// versions in `target`'s cache once it landed.
pub(super) async fn commit_table(
    target: &mut Target,
    adds: Vec<Add>,
    txns: Vec<(RankKey, u64)>,
) -> Result<(), DeltaError> {
    let transactions: Vec<Transaction> = txns
        .iter()
        .map(|(key, seq)| Transaction::new(app_id(key), i64::try_from(*seq).unwrap_or(i64::MAX)))
        .collect();
    let partition_by = (!adds.is_empty()).then(|| vec!["run_id".to_string()]);
    let mut pause = RETRY_FIRST;
    let name = target.name.clone();
    let err = |source| DeltaError::Table {
        table: name.clone(),
        source: Box::new(source),
    };
    loop {
        let snapshot = target.table.snapshot().map_err(err)?;
        let properties = CommitProperties::default()
            .with_application_transactions(transactions.clone())
            .with_max_retries(DELTA_ATTEMPTS);
        let operation = DeltaOperation::Write {
            mode: SaveMode::Append,
            partition_by: partition_by.clone(),
            predicate: None,
        };
        let result = CommitBuilder::from(properties)
            .with_actions(adds.iter().cloned().map(Action::Add).collect())
            .build(Some(snapshot), target.table.log_store(), operation)
            .await;
        let error = result.err();
        refresh(target).await?;
        if let Some(error) = error {
            // Did it land anyway (an answer lost after the log entry was written)?
            let landed = match txns.first() {
                Some((key, seq)) => {
                    target.versions.remove(key);
                    lookup(target, key).await? >= *seq
                }
                None => false,
            };
            if !landed {
                if !is_conflict(&error) {
                    return Err(err(error));
                }
                let jitter = rand::rng().random_range(0.5..1.5);
                tracing::debug!(table = %target.name, pause_ms = pause.as_millis() as u64, "commit conflict; retrying");
                tokio::time::sleep(pause.mul_f64(jitter)).await;
                pause = (pause * 2).min(RETRY_MAX);
                continue;
            }
        }
        for (key, seq) in txns {
            target.versions.insert(key, seq);
        }
        return Ok(());
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn batch(ranks: &[u32], seqs: &[u64]) -> RecordBatch {
        let schema = Arc::new(arrow::datatypes::Schema::new(vec![
            arrow::datatypes::Field::new("run_id", arrow::datatypes::DataType::Utf8, false),
            arrow::datatypes::Field::new("rank", arrow::datatypes::DataType::UInt32, false),
            arrow::datatypes::Field::new("seq", arrow::datatypes::DataType::UInt64, false),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(arrow::array::StringArray::from(vec!["r"; ranks.len()])),
                Arc::new(UInt32Array::from(ranks.to_vec())),
                Arc::new(UInt64Array::from(seqs.to_vec())),
            ],
        )
        .unwrap()
    }

    #[test]
    fn rows_a_table_holds_are_not_written_again() {
        let rows = batch(&[0, 0, 1, 1, 2], &[3, 4, 3, 4, 0]);
        // Nothing held: every row is new.
        assert_eq!(not_held(&rows, "r", &HashMap::new()).unwrap().num_rows(), 5);
        // Rank 0 up to seq 3 held, rank 1 up to 4; seq 0 (the collector's own
        // rows) is always new.
        let held = HashMap::from([(("r".to_string(), 0), 3), (("r".to_string(), 1), 4)]);
        let kept = not_held(&rows, "r", &held).unwrap();
        let seqs = kept
            .column(2)
            .as_any()
            .downcast_ref::<UInt64Array>()
            .unwrap();
        assert_eq!(seqs.values().to_vec(), vec![4, 0]);
        // Another run's watermarks do not apply.
        let other = HashMap::from([(("other".to_string(), 0), 9)]);
        assert_eq!(not_held(&rows, "r", &other).unwrap().num_rows(), 5);
        // All held: nothing to write.
        let all = HashMap::from([(("r".to_string(), 0), 9), (("r".to_string(), 1), 9)]);
        assert!(not_held(&batch(&[0, 1], &[5, 6]), "r", &all).is_none());
    }
}
