//! Where the collector writes: `--out` as the user gives it.
//!
//! - a plain path: a folder of hive-partitioned Parquet files with the
//!   collector's own commit log ([`crate::store`]), the default;
//! - `delta:PATH`: one Delta Lake table per table under `PATH` on a local or
//!   shared disk;
//! - `s3://BUCKET/PREFIX` (also `s3a://`): the same Delta tables on S3 or an
//!   S3-compatible server, with the credentials and endpoint of the standard
//!   `AWS_*` variables;
//! - `gs://BUCKET/PREFIX` (GCS) and `az://CONTAINER/PREFIX` (Azure; also
//!   `abfs://`, `abfss://`, `adl://`, `azure://`): the same Delta tables, with
//!   object_store's `GOOGLE_*` and `AZURE_*` variables. Compiled in, but tested
//!   against S3 only (docs/past-one-machine.md).
//!
//! Parsing needs no feature: a build without `delta` refuses a Delta output when
//! the collector starts, naming the feature to build with.

use std::fmt;
use std::path::{Path, PathBuf};

/// The prefix of a Delta table root on a local or shared disk.
pub const DELTA_PREFIX: &str = "delta:";

/// Where the collector writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Parquet files and the collector's commit log under this folder.
    Dir(PathBuf),
    /// One Delta table per table under this root.
    Delta(DeltaRoot),
}

/// The root under which each table is the Delta table `<root>/<table>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeltaRoot {
    /// A folder on a local or shared disk (`delta:PATH`).
    Local(PathBuf),
    /// An object store URL (`s3://bucket/prefix`, `gs://…`, `az://…`), without
    /// a trailing slash.
    Url(String),
}

impl Output {
    /// Reads `--out`: `delta:PATH`, an object store URL (`s3://`, `gs://`,
    /// `az://`…) or a plain path. A URL scheme this build cannot write is an
    /// error naming the ones it can.
    pub fn parse(text: &str) -> Result<Output, String> {
        if text.is_empty() {
            return Err("--out is empty: give a folder, delta:PATH or s3://BUCKET/PREFIX".into());
        }
        if let Some(path) = text.strip_prefix(DELTA_PREFIX) {
            if path.is_empty() {
                return Err(format!(
                    "--out {text} names no folder: give delta:PATH, the folder that holds (or will hold) the Delta tables"
                ));
            }
            return Ok(Output::Delta(DeltaRoot::Local(PathBuf::from(path))));
        }
        let Some((scheme, rest)) = text.split_once("://") else {
            return Ok(Output::Dir(PathBuf::from(text)));
        };
        let (store, container) = match scheme {
            "s3" | "s3a" => ("S3", "bucket"),
            "gs" => ("GCS", "bucket"),
            "az" | "abfs" | "abfss" | "adl" | "azure" => ("Azure", "container"),
            "file" => return Ok(Output::Delta(DeltaRoot::Local(PathBuf::from(rest)))),
            _ => {
                return Err(format!(
                    "--out {text}: unknown scheme {scheme}://; give a folder, delta:PATH, \
                     s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or az://CONTAINER/PREFIX"
                ));
            }
        };
        if rest.split('/').next().unwrap_or("").is_empty() {
            let upper = container.to_uppercase();
            return Err(format!(
                "--out {text} names no {container}: give {scheme}://{upper}/PREFIX ({store})"
            ));
        }
        Ok(Output::Delta(DeltaRoot::Url(
            text.trim_end_matches('/').to_string(),
        )))
    }

    /// The local folder written to, whose free space `--min-free-bytes` watches;
    /// `None` for object storage.
    pub fn local_dir(&self) -> Option<&Path> {
        match self {
            Output::Dir(dir) | Output::Delta(DeltaRoot::Local(dir)) => Some(dir),
            Output::Delta(DeltaRoot::Url(_)) => None,
        }
    }
}

impl fmt::Display for Output {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Output::Dir(dir) => write!(f, "{}", dir.display()),
            Output::Delta(root) => write!(f, "{root}"),
        }
    }
}

impl fmt::Display for DeltaRoot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeltaRoot::Local(dir) => write!(f, "{DELTA_PREFIX}{}", dir.display()),
            DeltaRoot::Url(url) => f.write_str(url),
        }
    }
}

impl From<PathBuf> for Output {
    fn from(dir: PathBuf) -> Output {
        Output::Dir(dir)
    }
}

impl From<&Path> for Output {
    fn from(dir: &Path) -> Output {
        Output::Dir(dir.to_path_buf())
    }
}

impl From<&PathBuf> for Output {
    fn from(dir: &PathBuf) -> Output {
        Output::Dir(dir.clone())
    }
}

impl From<&str> for Output {
    fn from(dir: &str) -> Output {
        Output::Dir(PathBuf::from(dir))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_reads_a_folder_a_local_delta_root_and_object_store_urls() {
        assert_eq!(
            Output::parse("rankscope-out"),
            Ok(Output::Dir("rankscope-out".into()))
        );
        assert_eq!(
            Output::parse("delta:/data/tables"),
            Ok(Output::Delta(DeltaRoot::Local("/data/tables".into())))
        );
        assert_eq!(
            Output::parse("s3://bucket/runs/"),
            Ok(Output::Delta(DeltaRoot::Url("s3://bucket/runs".into())))
        );
        assert_eq!(
            Output::parse("s3://bucket/runs").unwrap().to_string(),
            "s3://bucket/runs"
        );
        assert_eq!(Output::parse("delta:x").unwrap().to_string(), "delta:x");
        for url in [
            "gs://bucket/runs",
            "az://container/runs",
            "abfss://container@account.dfs.core.windows.net/runs",
        ] {
            assert_eq!(
                Output::parse(&format!("{url}/")),
                Ok(Output::Delta(DeltaRoot::Url(url.into())))
            );
        }
    }

    #[test]
    fn out_refuses_what_it_cannot_write_naming_the_fix() {
        for (text, says) in [
            ("", "--out is empty"),
            ("delta:", "names no folder"),
            ("s3://", "names no bucket"),
            ("s3:///prefix", "names no bucket"),
            ("gs://", "give gs://BUCKET/PREFIX"),
            ("az:///p", "names no container: give az://CONTAINER/PREFIX"),
            ("ftp://host/p", "unknown scheme ftp://"),
        ] {
            let error = Output::parse(text).unwrap_err();
            assert!(error.contains(says), "{text}: {error}");
        }
    }
}
