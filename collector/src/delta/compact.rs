//! Compaction ([`compact_run`]): the small files a run's commits left in each
//! table become one file per table, in one Delta transaction per table (an
//! `OPTIMIZE`: `remove` actions for the old files and `add` actions for the new,
//! neither marked as a data change, so streaming readers skip it).
//!
//! Meant for finished runs: collectors appending to the run meanwhile do not
//! conflict (their files are not among those removed), but their new files stay
//! small. The removed files stay on storage, unreferenced, until `VACUUM`
//! deletes them after the retention (docs/past-one-machine.md).

use arrow::array::RecordBatch;
use arrow::compute::cast;
use deltalake::DeltaTableBuilder;
use deltalake::kernel::Action;
use deltalake::kernel::transaction::{CommitBuilder, CommitProperties};
use deltalake::logstore::object_store::ObjectStoreExt as _;
use deltalake::protocol::DeltaOperation;
use deltalake::writer::{DeltaWriter, RecordBatchWriter};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use super::{DeltaError, delta_schema};
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
    let name = table.name();
    let err = |source| DeltaError::Table {
        table: name.to_string(),
        source: Box::new(source),
    };
    if let DeltaRoot::Local(dir) = root
        && !dir.join(name).is_dir()
    {
        return Ok(Compacted::default());
    }
    let url = root.table_url(name)?;
    let mut delta = DeltaTableBuilder::from_url(url)
        .map_err(err)?
        .build()
        .map_err(err)?;
    if !delta
        .log_store()
        .is_delta_table_location()
        .await
        .map_err(err)?
    {
        return Ok(Compacted::default());
    }
    delta.load().await.map_err(err)?;
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
    let convert = |source| DeltaError::Convert {
        table: name,
        source,
    };
    let store = delta.object_store();
    let props = writer::writer_properties(&schema, row_group_rows.max(1));
    let mut out = RecordBatchWriter::for_table(&delta)
        .map_err(err)?
        .with_writer_properties(props);
    let mut rows = 0;
    for (path, _) in &files {
        let bytes = store
            .get(path)
            .await
            .map_err(|e| err(e.into()))?
            .bytes()
            .await
            .map_err(|e| err(e.into()))?;
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)
            .and_then(|b| b.build())
            .map_err(|e| err(e.into()))?;
        for batch in reader {
            let batch = batch.map_err(convert)?;
            let n = batch.num_rows();
            let columns = schema
                .fields()
                .iter()
                .map(|field| match batch.column_by_name(field.name()) {
                    _ if field.name() == "run_id" => {
                        let run: arrow::array::ArrayRef =
                            std::sync::Arc::new(arrow::array::StringArray::from(vec![run_id; n]));
                        cast(&run, field.data_type())
                    }
                    Some(column) => cast(column, field.data_type()),
                    None => Ok(arrow::array::new_null_array(field.data_type(), n)),
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(convert)?;
            rows += n;
            out.write(RecordBatch::try_new(schema.clone(), columns).map_err(convert)?)
                .await
                .map_err(err)?;
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
