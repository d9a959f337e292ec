//! TLS from the agent (and the tools built on its transport) to the collector:
//! the PEM contents read once from `RANKSCOPE_TLS_*` ([`crate::config`]) and the
//! tonic settings made from them.

use tonic::transport::{Certificate, ClientTlsConfig, Identity};

/// PEM contents for TLS to the collector.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientTls {
    /// The CA that signed the collector's certificate.
    pub ca_pem: Vec<u8>,
    /// Client certificate and key, for mutual TLS.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// The name to verify in the collector's certificate, if not the address's host.
    pub domain: Option<String>,
}

impl std::fmt::Debug for ClientTls {
    // Never prints the private key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("mutual", &self.identity.is_some())
            .field("domain", &self.domain)
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    /// The tonic settings; PEM problems surface when the endpoint is built.
    pub(crate) fn config(&self) -> ClientTlsConfig {
        let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.ca_pem));
        if let Some((cert, key)) = &self.identity {
            config = config.identity(Identity::from_pem(cert, key));
        }
        if let Some(domain) = &self.domain {
            config = config.domain_name(domain.clone());
        }
        config
    }
}
