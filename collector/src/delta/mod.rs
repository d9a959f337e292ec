//! The Delta Lake output: every table a Delta table (delta-rs), on a local or
//! shared disk (`--out delta:PATH`) or object storage (`--out s3://BUCKET/PREFIX`,
//! and GCS's `gs://` and Azure's `az://`, compiled in but tested on S3 only).
//!
//! # Layout
//!
//! ```text
//! ROOT/<table>/_delta_log/NNN.json          each table's log: one commit per version
//! ROOT/<table>/run_id=<run>/part-*.parquet  data files, visible once a log entry adds them
//! ROOT/_rankscope/watermarks/_delta_log/…   the watermark table: no rows, only `txn` actions
//! ```
//!
//! Each table is partitioned by `run_id`. Unsigned columns are stored as Delta
//! `long` (Delta has no unsigned types; `rank` and `seq` read as BIGINT).
//!
//! # Exactly once through the log
//!
//! A Delta commit is one table's, so a collector commit (rows of several tables)
//! is several Delta commits: one per table that has rows, then one to the
//! watermark table. Each carries Delta's application transaction action, `txn`,
//! with app id `rankscope/<run_id>/<rank>` and version = the highest `seq` of
//! that (run, rank) whose rows the table now holds, for every (run, rank) of the
//! collector commit:
//!
//! - in a data table, the `txn` version says which of the rank's batches that
//!   table holds: a resent batch's rows are written to a table only when its
//!   `seq` is above the table's version (this is what makes a crash between two
//!   tables' commits duplicate nothing);
//! - in the watermark table, committed last, it is the durable watermark answered
//!   in `Welcome` and `Ack`: every table holds every batch up to it.
//!
//! One app id per (run, rank), not per collector: the (run, rank) is what agents
//! number batches by, and a rank moves to another collector when its own fails,
//! so any collector must find its watermark by that key alone. Delta keeps the
//! latest version of each app id (and checkpoints keep them). The collector
//! reads every app id's version of a table once, at its first lookup (the last
//! checkpoint and the commits since: `txns`), then each new commit once; it
//! looks a (run, rank) up when its first stream arrives ([`DeltaStore::durable`]),
//! and reads each table's new commits before the first commit of a rank new to
//! it, which may have moved from another collector. The table
//! property `delta.setTransactionRetentionDuration` is left unset: watermarks
//! never expire.
//!
//! # After a crash
//!
//! A data file is visible only once a log entry adds it. A crash (or a failed
//! commit) after writing data files but before their table's commit leaves them
//! unreferenced: no reader sees them, and `VACUUM` (Delta's, from Spark, Python
//! `deltalake` or `rankscope compact`) deletes them once older than its retention
//! (7 days by default). A crash between two tables' commits is repaired by the
//! resend: the agents resend everything above the watermark table's version,
//! and each table skips what its own `txn` says it holds. A crash after the
//! watermark commit but before the ack: the next `Welcome` carries the
//! watermark, and the agent drops what it holds up to it.
//!
//! # Many collectors
//!
//! Collectors commit to the same tables at once. A commit is put-if-absent on the
//! next `_delta_log/NNN.json` (S3 supports `If-None-Match`, so no lock service);
//! a writer that loses the race rebases and retries (delta-rs, up to its
//! attempts), and past those this module retries with backoff and jitter until
//! the commit lands or fails for another reason. Appends never conflict with each
//! other, and the `txn` of two collectors never share an app id. Every
//! [`CHECKPOINT_INTERVAL`] versions delta-rs writes a checkpoint.
//!
//! # Modules
//!
//! - this module: [`DeltaStore`] (opening and creating the tables, the start-up
//!   check that names the variable to fix, the watermark lookups) and
//!   [`DeltaError`];
//! - [`commit`]: one collector commit ([`DeltaStore::commit`]);
//! - [`read`]: a table read back as the collector's rows, for the reports;
//! - [`stores`]: the object stores of `s3://`, `gs://` and `az://` roots;
//! - `txns`: every app id's `txn` version of a table, read from its log;
//! - [`compact`]: a finished run's files merged (`rankscope compact`).

pub mod commit;
pub mod compact;
pub mod read;
pub mod stores;
mod txns;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use deltalake::kernel::StructField;
use deltalake::kernel::engine::arrow_conversion::TryIntoKernel as _;
use deltalake::protocol::SaveMode;
use deltalake::{DeltaTable, DeltaTableBuilder, DeltaTableError, TableProperty};
use tokio::sync::Mutex;
use url::Url;

use arrow::datatypes::{DataType, Field, Schema, SchemaRef};

use crate::buffer::RankKey;
use crate::output::{CloudStore, DeltaRoot};
use crate::table::{self, Table};
use txns::TxnIndex;

/// Versions between two checkpoints of a table's log: readers replay at most
/// this many JSON commits after the last checkpoint.
pub const CHECKPOINT_INTERVAL: u64 = 20;
/// How long the start-up check waits for the object store to answer.
pub const START_TIMEOUT: Duration = Duration::from_secs(20);
/// The folder of the watermark table under the root.
pub const WATERMARK_TABLE: &str = "_rankscope/watermarks";

/// Why the Delta output failed.
#[derive(Debug, thiserror::Error)]
pub enum DeltaError {
    /// A setting or the store refused us at start; the text names what to fix.
    #[error("{0}")]
    Start(String),
    #[error("delta table {table}: {source}")]
    Table {
        table: String,
        /// Boxed: delta-rs's error is large, and this one travels in every result.
        source: Box<DeltaTableError>,
    },
    #[error("cannot convert {table} rows for Delta: {source}")]
    Convert {
        table: &'static str,
        source: arrow::error::ArrowError,
    },
}

/// One Delta table of the output and what the collector knows of its `txn`
/// versions.
#[derive(Debug)]
pub(crate) struct Target {
    pub(crate) name: String,
    pub(crate) table: DeltaTable,
    /// The `txn` version per (run, rank), as last looked up or committed.
    pub(crate) versions: HashMap<RankKey, u64>,
    /// Every app id's `txn` version, read from the log at the first lookup.
    txns: Txns,
}

/// A table's [`TxnIndex`], once read.
#[derive(Debug)]
enum Txns {
    NotRead,
    Read(TxnIndex),
    /// The log has a shape the index does not read: look app ids up one by one
    /// through delta-rs.
    OneByOne,
}

/// The Delta output: the tables, opened (created if absent) at start.
#[derive(Debug)]
pub struct DeltaStore {
    root: DeltaRoot,
    /// The data tables, in [`Table::ALL`] order, then the watermark table. One
    /// commit at a time holds the lock.
    pub(crate) targets: Mutex<Vec<Target>>,
    pub(crate) row_group_rows: usize,
}

/// The app id of a (run, rank) in `txn` actions.
pub fn app_id(key: &RankKey) -> String {
    format!("rankscope/{}/{}", key.0, key.1)
}

/// A table's Arrow schema as stored in Delta: unsigned integers as `Int64`
/// (Delta has only signed types), everything else as the collector builds it.
pub fn delta_schema(table: Table) -> SchemaRef {
    let schema = table::schema(table);
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .map(|f| match f.data_type() {
            DataType::UInt32 | DataType::UInt64 => {
                Field::new(f.name(), DataType::Int64, f.is_nullable())
            }
            _ => f.as_ref().clone(),
        })
        .collect();
    Arc::new(Schema::new(fields))
}

/// The watermark table's schema: it holds no rows, but Delta wants columns.
fn watermark_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("run_id", DataType::Utf8, false),
        Field::new("rank", DataType::Int64, false),
        Field::new("seq", DataType::Int64, false),
    ]))
}

impl DeltaRoot {
    /// The URL of the table at `name` under the root (a local root is created).
    fn table_url(&self, name: &str) -> Result<Url, DeltaError> {
        stores::register();
        match self {
            DeltaRoot::Local(dir) => {
                let path = dir.join(name);
                std::fs::create_dir_all(&path).map_err(|e| {
                    DeltaError::Start(format!(
                        "cannot create {} for --out {self}: {e} (is the disk writable?)",
                        path.display()
                    ))
                })?;
                let path = path.canonicalize().map_err(|e| {
                    DeltaError::Start(format!("cannot resolve {}: {e}", path.display()))
                })?;
                Url::from_directory_path(&path).map_err(|()| {
                    DeltaError::Start(format!("{} is not an absolute path", path.display()))
                })
            }
            DeltaRoot::Url(root) => Url::parse(&format!("{root}/{name}/")).map_err(|e| {
                DeltaError::Start(format!(
                    "--out {root}: not a valid URL ({e}); give s3://BUCKET/PREFIX, \
                     gs://BUCKET/PREFIX or az://CONTAINER/PREFIX"
                ))
            }),
        }
    }
}

/// Chooses ring as the process's TLS provider. Two are compiled in with this
/// feature (ring for gRPC and object_store, aws-lc-rs for the HTTP client of
/// delta-rs's kernel), and rustls then refuses to pick one: any TLS client or
/// server built before this call (an agent's connection to a TLS collector, the
/// collector's own listener) would panic. A binary with the feature calls it
/// first thing; later calls do nothing.
pub fn choose_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

impl DeltaStore {
    /// Opens every table under `root`, creating the missing ones. An object
    /// store that cannot be reached, refuses the credentials or lacks the bucket
    /// is an error naming the variable to fix.
    pub async fn open(root: &DeltaRoot, row_group_rows: usize) -> Result<DeltaStore, DeltaError> {
        choose_tls_provider();
        let mut targets = Vec::new();
        let names = Table::ALL
            .iter()
            .map(|t| (t.name().to_string(), delta_schema(*t), true))
            .chain([(WATERMARK_TABLE.to_string(), watermark_schema(), false)]);
        for (name, schema, partitioned) in names {
            let url = root.table_url(&name)?;
            let table =
                tokio::time::timeout(START_TIMEOUT, open_or_create(url, schema, partitioned))
                    .await
                    .map_err(|_| {
                        DeltaError::Start(unreachable_message(root, "no answer within 20 s"))
                    })?
                    .map_err(|source| start_error(root, &name, source))?;
            targets.push(Target {
                name,
                table,
                versions: HashMap::new(),
                txns: Txns::NotRead,
            });
        }
        Ok(DeltaStore {
            root: root.clone(),
            targets: Mutex::new(targets),
            row_group_rows: row_group_rows.max(1),
        })
    }

    pub fn root(&self) -> &DeltaRoot {
        &self.root
    }

    /// The durable watermark of `key`: the version of its `txn` in the watermark
    /// table (0: none). Looked up afresh, so a rank that moved here from another
    /// collector gets what that collector made durable.
    pub async fn durable(&self, key: &RankKey) -> Result<u64, DeltaError> {
        let mut targets = self.targets.lock().await;
        for target in targets.iter_mut() {
            // Forget what the other tables said of this rank: another collector
            // may have committed for it since.
            target.versions.remove(key);
        }
        let watermarks = targets.last_mut().expect("the watermark table is opened");
        refresh(watermarks).await?;
        lookup(watermarks, key).await
    }
}

/// Loads the table at `url`, or creates it (partitioned by `run_id` when
/// `partitioned`) when there is none; another collector creating it at the same
/// time is no error.
async fn open_or_create(
    url: Url,
    schema: SchemaRef,
    partitioned: bool,
) -> Result<DeltaTable, DeltaTableError> {
    // One listing of `_delta_log/`: it also finds a missing bucket or refused
    // credentials before anything is written.
    let mut table = DeltaTableBuilder::from_url(url.clone())?.build()?;
    if table.log_store().is_delta_table_location().await? {
        table.load().await?;
        return Ok(table);
    }
    let kernel: deltalake::kernel::StructType = schema.as_ref().try_into_kernel()?;
    let columns: Vec<StructField> = kernel.fields().cloned().collect();
    let mut create = deltalake::operations::create::CreateBuilder::new()
        .with_location(url.to_string())
        .with_columns(columns)
        .with_save_mode(SaveMode::Ignore)
        .with_configuration_property(
            TableProperty::CheckpointInterval,
            Some(CHECKPOINT_INTERVAL.to_string()),
        );
    if partitioned {
        create = create.with_partition_columns(["run_id"]);
    }
    match create.await {
        Ok(table) => Ok(table),
        // Another collector created it first.
        Err(_) => DeltaTableBuilder::from_url(url)?.load().await,
    }
}

/// Brings `target`'s snapshot, and its [`TxnIndex`] once read, up to the
/// table's latest version.
pub(crate) async fn refresh(target: &mut Target) -> Result<(), DeltaError> {
    let err = |source| DeltaError::Table {
        table: target.name.clone(),
        source: Box::new(source),
    };
    target.table.update_incremental(None).await.map_err(err)?;
    if let Txns::Read(index) = &mut target.txns {
        index
            .catch_up(target.table.log_store().as_ref())
            .await
            .map_err(err)?;
    }
    Ok(())
}

/// The `txn` version of `key` in `target` (0: none), from the cache, else the
/// table's [`TxnIndex`] (read from the log at the first lookup), else delta-rs's
/// lookup of the one app id.
pub(crate) async fn lookup(target: &mut Target, key: &RankKey) -> Result<u64, DeltaError> {
    if let Some(version) = target.versions.get(key) {
        return Ok(*version);
    }
    let err = |source| DeltaError::Table {
        table: target.name.clone(),
        source: Box::new(source),
    };
    if let Txns::NotRead = target.txns {
        target.txns = match TxnIndex::load(target.table.log_store().as_ref())
            .await
            .map_err(err)?
        {
            Some(index) => Txns::Read(index),
            None => Txns::OneByOne,
        };
    }
    let version = match &target.txns {
        Txns::Read(index) => index.get(&app_id(key)),
        Txns::NotRead | Txns::OneByOne => {
            let state = target.table.snapshot().map_err(err)?;
            state
                .transaction_version(target.table.log_store().as_ref(), app_id(key))
                .await
                .map_err(err)?
                .map_or(0, |v| v.max(0) as u64)
        }
    };
    target.versions.insert(key.clone(), version);
    Ok(version)
}

/// The object store of `root`, for the start-up messages (S3 for a local root:
/// its messages name no store variable).
fn store_of(root: &DeltaRoot) -> CloudStore {
    root.store().unwrap_or(CloudStore::S3)
}

/// The message for an object store that did not answer.
fn unreachable_message(root: &DeltaRoot, what: &str) -> String {
    let store = store_of(root);
    let variable = store.endpoint();
    let endpoint = std::env::var(variable).unwrap_or_else(|_| "(unset: the provider's own)".into());
    let credentials = match store {
        CloudStore::S3 => String::new(),
        _ => format!(", and that {} is set", store.credentials()),
    };
    let allow_http = store.allow_http();
    format!(
        "cannot reach the object store for --out {root} ({what}): check {variable}={endpoint} \
         (and {allow_http}=true for an http:// endpoint) and that the server runs{credentials}"
    )
}

/// A start-up failure in words that name the variable or flag to fix.
fn start_error(root: &DeltaRoot, name: &str, source: DeltaTableError) -> DeltaError {
    let store = store_of(root);
    let credentials = store.credentials();
    let text = format!("{source:?} {source}");
    let has = |needle: &str| text.contains(needle);
    let message = if has("NoSuchBucket") || has("bucket does not exist") || has("ContainerNotFound")
    {
        let bucket = match root {
            DeltaRoot::Url(url) => url
                .split("://")
                .nth(1)
                .and_then(|r| r.split('/').next())
                .unwrap_or("")
                .to_string(),
            DeltaRoot::Local(_) => String::new(),
        };
        let kind = store.bucket();
        format!(
            "the {kind} {bucket} of --out {root} does not exist: create it, or fix the {kind} in --out"
        )
    } else if has("Account must be specified") {
        format!("no storage account for --out {root}: set {credentials} ({source})")
    } else if has("InvalidAccessKeyId")
        || has("SignatureDoesNotMatch")
        || has("AccessDenied")
        || has("AuthenticationFailed")
        || has("403")
        || has("Forbidden")
    {
        let region = if store == CloudStore::S3 {
            " (and AWS_REGION)"
        } else {
            ""
        };
        format!(
            "the object store refused the credentials for --out {root}: check {credentials}\
             {region} ({source})"
        )
    } else if has("MissingCredentials")
        || has("redential")
        || has("169.254.169.254")
        || (store != CloudStore::S3 && has("etadata"))
    {
        format!("no credentials for --out {root}: set {credentials} ({source})")
    } else if has("error sending request")
        || has("Connection refused")
        || has("connect")
        || has("dns error")
        || has("timed out")
    {
        unreachable_message(root, &source.to_string())
    } else {
        format!("cannot open the Delta table {name} under --out {root}: {source}")
    };
    DeltaError::Start(message)
}

#[cfg(test)]
mod tests;
