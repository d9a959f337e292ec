//! TLS for the gRPC listener (rustls): the server's certificate and key, and an
//! optional client CA that makes it mutual (every agent must present a
//! certificate that CA signed).

use tonic::transport::{Certificate, Identity, ServerTlsConfig};

/// PEM contents of the collector's TLS files.
#[derive(Clone)]
pub struct ServerTls {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
    /// When set, clients must present a certificate signed by this CA.
    pub client_ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for ServerTls {
    // Never prints the private key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("mutual", &self.client_ca_pem.is_some())
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// The tonic configuration.
    pub fn config(&self) -> ServerTlsConfig {
        let mut config =
            ServerTlsConfig::new().identity(Identity::from_pem(&self.cert_pem, &self.key_pem));
        if let Some(ca) = &self.client_ca_pem {
            config = config.client_ca_root(Certificate::from_pem(ca));
        }
        config
    }
}
