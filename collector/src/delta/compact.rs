//! Compaction ([`compact_run`]): the small files a run's commits left in each
//! table become one file per table, in one Delta transaction per table (an
//! `OPTIMIZE`: `remove` actions for the old files and `add` actions for the new,
//! neither marked as a data change, so streaming readers skip it).
//!
//! Meant for finished runs: collectors appending to the run meanwhile do not
//! conflict (their files are not among those removed), but their new files stay
//! small. The removed files stay on storage, unreferenced, until `VACUUM`
//! deletes them after the retention (docs/past-one-machine.md).

use deltalake::kernel::Action;
use deltalake::kernel::transaction::{CommitBuilder, CommitProperties};
use deltalake::protocol::DeltaOperation;
use deltalake::writer::{DeltaWriter, RecordBatchWriter};

use super::{DeltaError, delta_schema, read};
use crate::output::DeltaRoot;
use crate::store::writer;
use crate::table::Table;

/// What compaction did to one table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Compacted {
    pub files_before: usize,
    pub files_after: usize,
    pub rows: usize,
}

/// Rewrites the files of run `run_id` in `table` under `root` as one file (see
/// the module header); a table with at most one file of the run is left as is.
pub async fn compact_run(
    root: &DeltaRoot,
    table: Table,
    run_id: &str,
    row_group_rows: usize,
) -> Result<Compacted, DeltaError> {
    let Some(delta) = read::open_table(root, table).await? else {
        return Ok(Compacted::default());
    };
    let err = read::table_error(table);
    let files: Vec<_> = delta
        .snapshot()
        .map_err(err)?
        .log_data()
        .iter()
        .filter(|f| {
            f.partition_values_map().get("run_id").cloned().flatten() == Some(run_id.to_string())
        })
        .map(|f| (f.object_store_path(), f.remove_action(false)))
        .collect();
    if files.len() <= 1 {
        return Ok(Compacted {
            files_before: files.len(),
            files_after: files.len(),
            rows: 0,
        });
    }
    let schema = delta_schema(table);
    let store = delta.object_store();
    let mut out = RecordBatchWriter::for_table(&delta)
        .map_err(err)?
        .with_writer_properties(writer::writer_properties(&schema, row_group_rows.max(1)));
    let mut rows = 0;
    for (path, _) in &files {
        for batch in read::read_file(store.as_ref(), path, run_id, table, &schema).await? {
            rows += batch.num_rows();
            out.write(batch).await.map_err(err)?;
        }
    }
    let mut adds = out.flush().await.map_err(err)?;
    let files_after = adds.len();
    for add in &mut adds {
        add.data_change = false;
    }
    let actions: Vec<Action> = adds
        .into_iter()
        .map(Action::Add)
        .chain(
            files
                .iter()
                .map(|(_, remove)| Action::Remove(remove.clone())),
        )
        .collect();
    let operation = DeltaOperation::Optimize {
        predicate: Some(format!("run_id = '{}'", run_id.replace('\'', "''"))),
        target_size: 0,
    };
    CommitBuilder::from(CommitProperties::default())
        .with_actions(actions)
        .build(
            Some(delta.snapshot().map_err(err)?),
            delta.log_store(),
            operation,
        )
        .await
        .map_err(err)?;
    Ok(Compacted {
        files_before: files.len(),
        files_after,
        rows,
    })
}
