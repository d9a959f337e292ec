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

/// The object store behind a Delta root URL, from its scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloudStore {
    /// `s3://`, `s3a://`: S3 or an S3-compatible server.
    S3,
    /// `gs://`: Google Cloud Storage.
    Gcs,
    /// `az://`, `abfs://`, `abfss://`, `adl://`, `azure://`: Azure Blob Storage
    /// or ADLS Gen2.
    Azure,
}

impl CloudStore {
    /// Every URL scheme of [`CloudStore::of_scheme`].
    pub const SCHEMES: [&str; 8] = ["s3", "s3a", "gs", "az", "abfs", "abfss", "adl", "azure"];

    /// The store of URL scheme `scheme`; `None` for one this build cannot write.
    pub fn of_scheme(scheme: &str) -> Option<CloudStore> {
        match scheme {
            "s3" | "s3a" => Some(CloudStore::S3),
            "gs" => Some(CloudStore::Gcs),
            "az" | "abfs" | "abfss" | "adl" | "azure" => Some(CloudStore::Azure),
            _ => None,
        }
    }

    /// What a root URL's first path segment is called.
    pub fn bucket(self) -> &'static str {
        match self {
            CloudStore::Azure => "container",
            CloudStore::S3 | CloudStore::Gcs => "bucket",
        }
    }

    /// What to set for credentials (object_store's variables).
    pub fn credentials(self) -> &'static str {
        match self {
            CloudStore::S3 => {
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (named profiles of ~/.aws/config \
                 are not read; without keys the client asks for a web identity token or the \
                 metadata server of an AWS machine)"
            }
            CloudStore::Gcs => {
                "GOOGLE_APPLICATION_CREDENTIALS or GOOGLE_SERVICE_ACCOUNT (a service account \
                 key file; without one the client asks the metadata server of a Google Cloud \
                 machine)"
            }
            CloudStore::Azure => {
                "AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY (or \
                 AZURE_STORAGE_SAS_KEY; without a key the client asks the managed identity \
                 endpoint of an Azure machine)"
            }
        }
    }

    /// The variable that overrides the endpoint.
    pub fn endpoint(self) -> &'static str {
        match self {
            CloudStore::S3 => "AWS_ENDPOINT_URL",
            CloudStore::Gcs => "GOOGLE_BASE_URL",
            CloudStore::Azure => "AZURE_STORAGE_ENDPOINT",
        }
    }

    /// The variable that allows an `http://` endpoint.
    pub fn allow_http(self) -> &'static str {
        match self {
            CloudStore::S3 => "AWS_ALLOW_HTTP",
            CloudStore::Gcs => "GOOGLE_ALLOW_HTTP",
            CloudStore::Azure => "AZURE_ALLOW_HTTP",
        }
    }
}

impl DeltaRoot {
    /// The object store of the root; `None` for a local disk.
    pub fn store(&self) -> Option<CloudStore> {
        match self {
            DeltaRoot::Local(_) => None,
            DeltaRoot::Url(url) => CloudStore::of_scheme(url.split_once("://")?.0),
        }
    }
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
        if scheme == "file" {
            return Ok(Output::Delta(DeltaRoot::Local(PathBuf::from(rest))));
        }
        let Some(store) = CloudStore::of_scheme(scheme) else {
            return Err(format!(
                "--out {text}: unknown scheme {scheme}://; give a folder, delta:PATH, \
                 s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or az://CONTAINER/PREFIX"
            ));
        };
        if rest.split('/').next().unwrap_or("").is_empty() {
            let bucket = store.bucket();
            let upper = bucket.to_uppercase();
            return Err(format!(
                "--out {text} names no {bucket}: give {scheme}://{upper}/PREFIX"
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
    fn a_root_names_its_object_store() {
        for (text, store) in [
            ("s3a://b/p", Some(CloudStore::S3)),
            ("gs://b/p", Some(CloudStore::Gcs)),
            (
                "abfss://c@account.dfs.core.windows.net/p",
                Some(CloudStore::Azure),
            ),
            ("delta:/data", None),
        ] {
            let Ok(Output::Delta(root)) = Output::parse(text) else {
                panic!("{text} is a Delta root");
            };
            assert_eq!(root.store(), store, "{text}");
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
