//! The object stores a Delta root can name (`s3://`, `gs://`, `az://`, …), for
//! delta-rs: object_store's own clients, configured from the standard variables
//! object_store reads (`AWS_*`, `GOOGLE_*`, `AZURE_*`), and delta-rs's default
//! log store, which commits with put-if-absent (S3's `If-None-Match: *`, GCS's
//! and Azure's preconditions).
//!
//! delta-rs's own S3 crate (`deltalake-aws`) does the same with the AWS SDK for
//! credentials: 47 more packages in the command's build for what object_store's
//! credential chain already covers on a cluster (the variables, a web identity
//! token, the instance's or container's role). Not covered: named profiles and
//! SSO of `~/.aws/config`; export the variables instead
//! (docs/past-one-machine.md).

use std::sync::{Arc, Once};

use deltalake::logstore::{
    LogStore, LogStoreFactory, ObjectStoreFactory, ObjectStoreRef, StorageConfig, default_logstore,
    logstore_factories, object_store_factories,
};
use deltalake::{DeltaResult, DeltaTableError, Path};
use object_store::ObjectStoreScheme;
use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use url::Url;

use crate::output::CloudStore;

/// Registers every scheme of [`CloudStore::SCHEMES`] with delta-rs; later calls
/// do nothing.
pub fn register() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let logs: Arc<dyn LogStoreFactory> = Arc::new(DefaultLogs);
        for scheme in CloudStore::SCHEMES {
            let Some(store) = CloudStore::of_scheme(scheme) else {
                continue;
            };
            let url = Url::parse(&format!("{scheme}://")).expect("a scheme is a URL");
            object_store_factories().insert(url.clone(), Arc::new(store));
            logstore_factories().insert(url, logs.clone());
        }
    });
}

/// A client of `$builder` for `$url`: object_store's variables first
/// (`from_env`), then each option whose key the builder knows (as object_store's
/// own `parse_url_opts` does, which starts from no variables).
macro_rules! from_env_with {
    ($builder:ty, $url:expr, $options:expr) => {{
        let builder = $options.fold(
            <$builder>::from_env().with_url($url.as_str()),
            |builder, (key, value)| match key.parse() {
                Ok(key) => builder.with_config(key, value),
                Err(_) => builder,
            },
        );
        Arc::new(builder.build()?) as ObjectStoreRef
    }};
}

impl ObjectStoreFactory for CloudStore {
    fn parse_url_opts(
        &self,
        url: &Url,
        config: &StorageConfig,
    ) -> DeltaResult<(ObjectStoreRef, Path)> {
        // Options given to delta-rs override the variables; keys as object_store
        // spells them, in any case.
        let options = config
            .raw
            .iter()
            .map(|(k, v)| (k.to_ascii_lowercase(), v.clone()));
        let store: ObjectStoreRef = match self {
            CloudStore::S3 => from_env_with!(AmazonS3Builder, url, options),
            CloudStore::Gcs => from_env_with!(GoogleCloudStorageBuilder, url, options),
            CloudStore::Azure => from_env_with!(MicrosoftAzureBuilder, url, options),
        };
        let (_, path) =
            ObjectStoreScheme::parse(url).map_err(|e| DeltaTableError::GenericError {
                source: Box::new(e),
            })?;
        Ok((store, Path::parse(path)?))
    }
}

/// delta-rs's default log store: commits by put-if-absent of the next log entry.
#[derive(Debug)]
struct DefaultLogs;

impl LogStoreFactory for DefaultLogs {
    fn with_options(
        &self,
        prefixed_store: ObjectStoreRef,
        root_store: ObjectStoreRef,
        location: &Url,
        options: &StorageConfig,
    ) -> DeltaResult<Arc<dyn LogStore>> {
        Ok(default_logstore(
            prefixed_store,
            root_store,
            location,
            options,
        ))
    }
}
