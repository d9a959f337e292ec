//! Reading a Delta table back as the collector's rows ([`read_table`]), for the
//! query layer of `rankscope report`, `summary` and `compare`.
//!
//! It reads the files the table's current version names (never an uncommitted
//! one), puts back the `run_id` column from each file's partition value (Delta
//! keeps partition values in the log, not in the files) and casts every column
//! to the type of [`crate::table::schema`], so the query layer sees the rows as
//! a folder output gives them.

use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch, StringArray, new_null_array};
use arrow::compute::cast;
use arrow::datatypes::SchemaRef;
use deltalake::logstore::object_store::path::Path;
use deltalake::logstore::object_store::{ObjectStore, ObjectStoreExt as _};
use deltalake::{DeltaTable, DeltaTableBuilder, DeltaTableError};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use super::DeltaError;
use crate::output::DeltaRoot;
use crate::table::{self, Table};

/// Every row of `table` under `root`, typed as [`crate::table::schema`]; none
/// when the table was never created.
pub async fn read_table(root: &DeltaRoot, table: Table) -> Result<Vec<RecordBatch>, DeltaError> {
    let Some(delta) = open_table(root, table).await? else {
        return Ok(Vec::new());
    };
    let store = delta.object_store();
    let files: Vec<_> = delta
        .snapshot()
        .map_err(table_error(table))?
        .log_data()
        .iter()
        .map(|file| {
            let run_id = file
                .partition_values_map()
                .get("run_id")
                .cloned()
                .flatten()
                .unwrap_or_default();
            (file.object_store_path(), run_id)
        })
        .collect();
    let schema = table::schema(table);
    let mut batches = Vec::new();
    for (path, run_id) in files {
        batches.extend(read_file(store.as_ref(), &path, &run_id, table, &schema).await?);
    }
    Ok(batches)
}

/// The error of `table`'s Delta operations.
pub(super) fn table_error(table: Table) -> impl Fn(DeltaTableError) -> DeltaError + Copy {
    move |source| DeltaError::Table {
        table: table.name().to_string(),
        source: Box::new(source),
    }
}

/// `table` under `root` at its current version; `None` when it was never
/// created.
pub(super) async fn open_table(
    root: &DeltaRoot,
    table: Table,
) -> Result<Option<DeltaTable>, DeltaError> {
    let name = table.name();
    if let DeltaRoot::Local(dir) = root
        && !dir.join(name).is_dir()
    {
        return Ok(None);
    }
    let err = table_error(table);
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
        return Ok(None);
    }
    delta.load().await.map_err(err)?;
    Ok(Some(delta))
}

/// The rows of one data file of `table` (run `run_id`), typed as `schema`: the
/// `run_id` column put back from the partition value, the other columns cast,
/// columns the file lacks null.
pub(super) async fn read_file(
    store: &dyn ObjectStore,
    path: &Path,
    run_id: &str,
    table: Table,
    schema: &SchemaRef,
) -> Result<Vec<RecordBatch>, DeltaError> {
    let err = table_error(table);
    let convert = |source| DeltaError::Convert {
        table: table.name(),
        source,
    };
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
    let mut batches = Vec::new();
    for batch in reader {
        let batch = batch.map_err(convert)?;
        let rows = batch.num_rows();
        let columns = schema
            .fields()
            .iter()
            .map(|field| match batch.column_by_name(field.name()) {
                _ if field.name() == "run_id" => {
                    let run: ArrayRef = Arc::new(StringArray::from(vec![run_id; rows]));
                    cast(&run, field.data_type())
                }
                Some(column) => cast(column, field.data_type()),
                None => Ok(new_null_array(field.data_type(), rows)),
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(convert)?;
        batches.push(RecordBatch::try_new(schema.clone(), columns).map_err(convert)?);
    }
    Ok(batches)
}
