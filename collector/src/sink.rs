//! Where commits go: the [`Output`] opened, one interface for the committer and
//! the service over the output folder ([`store`](crate::store)) and the Delta
//! tables ([`delta`](crate::delta), with the `delta` feature).
//!
//! - [`Sink::open`]: opens the output; returns the durable watermarks known at
//!   start (the folder's commit log has them all; Delta tables are asked per
//!   (run, rank) instead, [`Sink::durable`]).
//! - [`Sink::commit`]: one atomic commit of the buffered rows, off the async
//!   reactor for the folder (fsync), on it for Delta (object store I/O).
//! - [`Sink::durable`]: the watermark of a (run, rank) the collector has not
//!   seen yet, looked up in the Delta log when its first stream arrives.

use std::collections::HashMap;
use std::sync::Arc;

use crate::buffer::{Pending, RankKey};
use crate::output::Output;
use crate::store::commit::CommitSummary;
use crate::store::{Store, StoreError};

/// Why the output could not be opened or committed to.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[cfg(feature = "delta")]
    #[error(transparent)]
    Delta(#[from] crate::delta::DeltaError),
    /// The commit task panicked; its rows went with it.
    #[error("commit task panicked: {0}")]
    Panicked(String),
    /// A Delta output in a build without the `delta` feature.
    #[error("{0}")]
    NotBuilt(String),
}

/// The output a collector commits to.
#[derive(Debug)]
pub enum Sink {
    /// A folder of Parquet files and the collector's commit log.
    Dir(Store),
    /// Delta tables on a local disk or object storage.
    #[cfg(feature = "delta")]
    Delta(crate::delta::DeltaStore),
}

impl Sink {
    /// Opens `out`, recovering a folder after a crash; returns the sink and the
    /// watermarks known at start.
    pub async fn open(
        out: &Output,
        row_group_rows: usize,
    ) -> Result<(Sink, HashMap<RankKey, u64>), SinkError> {
        match out {
            Output::Dir(dir) => {
                let store = Store::open(dir, row_group_rows)?;
                let recovered = store.recover()?;
                Ok((Sink::Dir(store), recovered))
            }
            #[cfg(feature = "delta")]
            Output::Delta(root) => {
                let store = crate::delta::DeltaStore::open(root, row_group_rows).await?;
                Ok((Sink::Delta(store), HashMap::new()))
            }
            #[cfg(not(feature = "delta"))]
            Output::Delta(root) => Err(SinkError::NotBuilt(format!(
                "--out {root} asks for Delta tables, but this rankscope was built without them: \
                 build with `--features delta` (the wheel and `make test` do), or give a folder"
            ))),
        }
    }

    /// Commits `pending` atomically; gives it back with the result (on an error
    /// the caller keeps its rows).
    pub async fn commit(
        self: &Arc<Sink>,
        pending: Pending,
    ) -> (Pending, Result<CommitSummary, SinkError>) {
        match self.as_ref() {
            Sink::Dir(_) => {
                let sink = self.clone();
                let joined = tokio::task::spawn_blocking(move || {
                    // Irrefutable in a build without the `delta` feature.
                    #[allow(irrefutable_let_patterns)]
                    let Sink::Dir(store) = sink.as_ref() else {
                        unreachable!("matched above")
                    };
                    let result = store.commit(&pending).map_err(SinkError::from);
                    (pending, result)
                })
                .await;
                // A panicked task took its rows with it: nothing to give back.
                joined.unwrap_or_else(|join| {
                    (
                        Pending::default(),
                        Err(SinkError::Panicked(join.to_string())),
                    )
                })
            }
            #[cfg(feature = "delta")]
            Sink::Delta(store) => {
                let result = store.commit(&pending).await.map_err(SinkError::from);
                (pending, result)
            }
        }
    }

    /// The durable watermark of `key` where the output must be asked (Delta);
    /// `None` where [`Sink::open`] returned them all (a folder).
    pub async fn durable(&self, key: &RankKey) -> Result<Option<u64>, SinkError> {
        match self {
            Sink::Dir(_) => {
                let _ = key;
                Ok(None)
            }
            #[cfg(feature = "delta")]
            Sink::Delta(store) => Ok(Some(store.durable(key).await?)),
        }
    }
}
