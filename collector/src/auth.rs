//! Bearer-token authentication: with a token configured, every stream must carry
//! `authorization: Bearer <token>` in its metadata, or it is refused with
//! `UNAUTHENTICATED` before any of its bytes are read as rows.

use tonic::service::Interceptor;
use tonic::{Request, Status};

/// The interceptor; lets everything through when no token is configured.
#[derive(Debug, Clone)]
pub struct BearerToken {
    expected: Option<Vec<u8>>,
}

impl BearerToken {
    pub fn new(token: Option<String>) -> BearerToken {
        BearerToken {
            expected: token.map(|t| format!("Bearer {}", t.trim()).into_bytes()),
        }
    }
}

impl Interceptor for BearerToken {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.expected else {
            return Ok(request);
        };
        let given = request
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes())
            .unwrap_or_default();
        if constant_time_eq(given, expected) {
            Ok(request)
        } else {
            Err(Status::unauthenticated(
                "missing or wrong bearer token: set RANKSCOPE_TOKEN on the agents to the contents of the collector's --token-file",
            ))
        }
    }
}

/// Compares without an early exit, so timing does not leak the token's prefix.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(auth: Option<&str>) -> Request<()> {
        let mut r = Request::new(());
        if let Some(a) = auth {
            r.metadata_mut().insert("authorization", a.parse().unwrap());
        }
        r
    }

    #[test]
    fn checks_the_token_only_when_configured() {
        let mut open = BearerToken::new(None);
        assert!(open.call(request(None)).is_ok());
        let mut locked = BearerToken::new(Some("s3cret\n".into()));
        assert!(locked.call(request(Some("Bearer s3cret"))).is_ok());
        for bad in [
            None,
            Some("Bearer s3cre"),
            Some("Bearer s3cret2"),
            Some("s3cret"),
        ] {
            let err = locked.call(request(bad)).unwrap_err();
            assert_eq!(err.code(), tonic::Code::Unauthenticated);
        }
    }
}
