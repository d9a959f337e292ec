//! The `--http` server: `GET /metrics`, `/healthz`, `/readyz` and `/live` over
//! HTTP/1.1.
//!
//! | path | answer |
//! |---|---|
//! | `/metrics` | 200, the figures of [`super::metrics`] (OpenMetrics text) |
//! | `/healthz` | 200 `ok` while the process serves at all (liveness) |
//! | `/readyz` | 200 `ready`, or 503 with the reason: draining, or short of disk |
//! | `/live`, `/live/…` | the live view ([`super::live`]), behind the collector's token |
//!
//! It is plain hyper on the tokio runtime the gRPC server uses, without TLS. The
//! ops figures hold run ids and counts, not rows, and need no token; `/live`
//! shows rows and asks for the collector's token when it has one. Bind it to
//! loopback or a monitoring network. It stays up through the drain, so a balancer sees
//! `/readyz` turn 503, and stops once the gRPC server has stopped. Connections are
//! bounded ([`MAX_CONNECTIONS`]) and a request's head must arrive within
//! [`HEADER_TIMEOUT`], so a stuck scraper cannot hold the collector's resources.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::Readiness;
use super::live::LiveEndpoints;
use super::metrics::{CONTENT_TYPE, encode};

/// A response body: whole, or a stream of events (`/live/runs/<run>/events`).
pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// Most HTTP connections served at once; more wait in the listen backlog.
pub const MAX_CONNECTIONS: usize = 64;
/// How long a client may take to send a request's head.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// What the endpoints answer from.
#[derive(Debug, Clone)]
pub struct Endpoints {
    registry: Arc<Registry>,
    readiness: Readiness,
    /// `None` with the live view off (`--live-steps 0`).
    live: Option<LiveEndpoints>,
}

impl Endpoints {
    pub fn new(registry: Registry, readiness: Readiness, live: Option<LiveEndpoints>) -> Endpoints {
        Endpoints {
            registry: Arc::new(registry),
            readiness,
            live,
        }
    }

    /// The answer to one request.
    pub fn respond<B>(&self, request: &Request<B>) -> Response<Body> {
        if request.method() != Method::GET && request.method() != Method::HEAD {
            return text(
                StatusCode::METHOD_NOT_ALLOWED,
                "use GET on /metrics, /healthz, /readyz or /live\n",
            );
        }
        let path = request.uri().path();
        if path == "/live" || path.starts_with("/live/") {
            return match &self.live {
                Some(live) => live.respond(request),
                None => text(
                    StatusCode::NOT_FOUND,
                    "the live view is off (--live-steps 0): start the collector without it\n",
                ),
            };
        }
        match path {
            "/metrics" => {
                let mut response =
                    Response::new(Full::new(Bytes::from(encode(&self.registry))).boxed_unsync());
                response
                    .headers_mut()
                    .insert(header::CONTENT_TYPE, CONTENT_TYPE.parse().expect("valid"));
                response
            }
            "/healthz" => text(StatusCode::OK, "ok\n"),
            "/readyz" => match self.readiness.check() {
                Ok(()) => text(StatusCode::OK, "ready\n"),
                Err(why) => text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!("not ready: {why}\n"),
                ),
            },
            _ => text(
                StatusCode::NOT_FOUND,
                "not found: the collector serves /metrics, /healthz, /readyz and /live\n",
            ),
        }
    }
}

/// A plain-text answer.
pub fn text(status: StatusCode, body: &str) -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())).boxed_unsync());
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        "text/plain; charset=utf-8".parse().expect("valid"),
    );
    response
}

/// Serves `listener` until `stop` turns true (or its sender is dropped), then
/// closes every connection.
pub async fn serve(listener: TcpListener, endpoints: Endpoints, mut stop: watch::Receiver<bool>) {
    let mut connections = JoinSet::new();
    loop {
        if *stop.borrow() {
            break;
        }
        let room = connections.len() < MAX_CONNECTIONS;
        tokio::select! {
            accepted = listener.accept(), if room => match accepted {
                Ok((stream, _)) => {
                    let endpoints = endpoints.clone();
                    connections.spawn(async move {
                        let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                            let response = endpoints.respond(&request);
                            async move { Ok::<_, Infallible>(response) }
                        });
                        let _ = hyper::server::conn::http1::Builder::new()
                            .timer(TokioTimer::new())
                            .header_read_timeout(HEADER_TIMEOUT)
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
                Err(error) => {
                    // Out of file descriptors, say: wait rather than spin.
                    tracing::warn!(%error, "ops http: cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            changed = stop.changed() => if changed.is_err() { break },
        }
    }
    connections.abort_all();
}
