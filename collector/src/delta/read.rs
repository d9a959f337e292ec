//! A Delta table as the query layer of `rankscope report`, `summary` and
//! `compare` reads it ([`table_provider`]), and the pieces `compact` shares.
//!
//! The query layer reads through delta-rs's DataFusion table provider: the
//! files of the table's current version (never an uncommitted one), streamed
//! file by file, with `run_id` from each file's partition value and filters on
//! it skipping the other runs' files. A projection on top gives every column
//! the type of [`crate::table::schema`] (Delta stores the unsigned columns as
//! `long`) in the collector's order, so the query layer sees the columns a
//! folder output gives it.

use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch, StringArray, new_null_array};
use arrow::compute::cast;
use arrow::datatypes::SchemaRef;
use deltalake::datafusion::catalog::TableProvider;
use deltalake::datafusion::catalog::view::ViewTable;
use deltalake::datafusion::common::ScalarValue;
use deltalake::datafusion::datasource::{MemTable, provider_as_source};
use deltalake::datafusion::logical_expr::{Expr, LogicalPlanBuilder, cast as cast_expr};
use deltalake::datafusion::prelude::{ident, lit};
use deltalake::logstore::object_store::path::Path;
use deltalake::logstore::object_store::{ObjectStore, ObjectStoreExt as _};
use deltalake::{DeltaTable, DeltaTableBuilder, DeltaTableError};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use super::DeltaError;
use crate::output::DeltaRoot;
use crate::table::{self, Table};

/// `table` under `root` at its current version, as a DataFusion table of
/// [`crate::table::schema`] that reads the files when a query runs; an empty
/// one of that schema when the table was never created. A column the table
/// lacks (written by an older release) reads as null.
pub async fn table_provider(
    root: &DeltaRoot,
    table: Table,
) -> Result<Arc<dyn TableProvider>, DeltaError> {
    let schema = table::schema(table);
    let err = table_error(table);
    let query = |source: deltalake::datafusion::error::DataFusionError| err(source.into());
    let Some(delta) = open_table(root, table).await? else {
        return Ok(Arc::new(
            MemTable::try_new(schema, vec![vec![]]).map_err(query)?,
        ));
    };
    let scan = delta.table_provider().await.map_err(query)?;
    let stored = scan.schema();
    let columns = schema
        .fields()
        .iter()
        .map(|field| {
            let name = field.name();
            let want = field.data_type();
            let value = match stored.field_with_name(name) {
                Ok(have) if have.data_type() == want => ident(name),
                Ok(_) => cast_expr(ident(name), want.clone()),
                Err(_) => lit(ScalarValue::try_from(want)?),
            };
            Ok(value.alias(name))
        })
        .collect::<Result<Vec<Expr>, _>>()
        .map_err(query)?;
    let plan = LogicalPlanBuilder::scan(table.name(), provider_as_source(scan), None)
        .and_then(|plan| plan.project(columns))
        .and_then(|plan| plan.build())
        .map_err(query)?;
    Ok(Arc::new(ViewTable::new(plan, None)))
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
    super::register_handlers();
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
