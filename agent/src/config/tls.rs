//! TLS to the collector from the `RANKSCOPE_TLS_*` variables.

use super::error::ConfigError;
use super::variables::{
    RANKSCOPE_TLS_CA, RANKSCOPE_TLS_CERT, RANKSCOPE_TLS_DOMAIN, RANKSCOPE_TLS_KEY,
};
use crate::transport::ClientTls;

/// TLS settings from `RANKSCOPE_TLS_*` in the process environment (for tools that
/// use the transport without an [`AgentConfig`](super::AgentConfig)).
pub fn client_tls_from_env() -> Result<Option<ClientTls>, ConfigError> {
    super::with_process_env(|env| {
        client_tls_with(&|var: &str| env(var).filter(|v| !v.trim().is_empty()))
    })
}

pub(super) fn client_tls_with(
    env: &impl Fn(&str) -> Option<String>,
) -> Result<Option<ClientTls>, ConfigError> {
    let read = |var: &'static str| -> Result<Option<Vec<u8>>, ConfigError> {
        env(var)
            .map(|path| {
                std::fs::read(path.trim()).map_err(|e| ConfigError::TlsFile {
                    var,
                    path,
                    error: e.to_string(),
                })
            })
            .transpose()
    };
    let identity = match (read(RANKSCOPE_TLS_CERT)?, read(RANKSCOPE_TLS_KEY)?) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        (Some(_), None) => {
            return Err(ConfigError::TlsPair {
                set: RANKSCOPE_TLS_CERT,
                missing: RANKSCOPE_TLS_KEY,
            });
        }
        (None, Some(_)) => {
            return Err(ConfigError::TlsPair {
                set: RANKSCOPE_TLS_KEY,
                missing: RANKSCOPE_TLS_CERT,
            });
        }
    };
    match read(RANKSCOPE_TLS_CA)? {
        Some(ca_pem) => Ok(Some(ClientTls {
            ca_pem,
            identity,
            domain: env(RANKSCOPE_TLS_DOMAIN),
        })),
        None if identity.is_some() => Err(ConfigError::TlsCa),
        None => Ok(None),
    }
}
