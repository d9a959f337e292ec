//! Ops endpoints: what a monitoring system and a load balancer ask the collector.
//!
//! - `--http ADDR` (off by default) serves `GET /metrics` (Prometheus, in the
//!   OpenMetrics text format), `GET /healthz` (liveness) and `GET /readyz`
//!   (readiness) over plain HTTP/1.1;
//! - the standard gRPC health service, `grpc.health.v1.Health`, runs beside
//!   `rankscope.v1.Collector` on the gRPC port, always.
//!
//! Both say the same thing about readiness, from [`Readiness`]: ready while the
//! collector accepts batches; not ready while it drains (after SIGTERM) or while
//! its output filesystem is below `--min-free-bytes`, so a balancer sends new
//! streams elsewhere. Liveness is the process answering at all: restarting a
//! collector fixes none of the reasons it is not ready.
//!
//! Layout:
//! - [`metrics`]: `/metrics`: the Prometheus names of the counters the service and
//!   the committer keep ([`crate::counters`]), and the gauges read at scrape time;
//! - [`http`]: the HTTP server;
//! - [`live`]: `/live`, the live view as JSON, events and a page;
//! - this module: [`Readiness`] and the gRPC health reporter.

pub mod http;
pub mod live;
pub mod metrics;

use std::sync::Arc;
use std::time::Duration;

use rankscope_proto::v1::collector_server::SERVICE_NAME;
use tokio::sync::watch;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::phase::Phase;
use crate::space::SpaceGuard;

/// How often the gRPC health status is recomputed between phase changes (it
/// follows the free space, which is probed at most once a second anyway).
const HEALTH_REFRESH: Duration = Duration::from_secs(1);

/// Whether the collector wants new streams.
#[derive(Debug, Clone)]
pub struct Readiness {
    phase: watch::Receiver<Phase>,
    space: Arc<SpaceGuard>,
}

impl Readiness {
    pub fn new(phase: watch::Receiver<Phase>, space: Arc<SpaceGuard>) -> Readiness {
        Readiness { phase, space }
    }

    /// `Ok` when ready; otherwise why not, in words for the `/readyz` body.
    pub fn check(&self) -> Result<(), String> {
        match *self.phase.borrow() {
            Phase::Serving => {}
            Phase::Draining => {
                return Err("draining: committing what was accepted before it stops".into());
            }
            Phase::Drained => return Err("stopping: drained".into()),
        }
        self.space.check().map_err(|low| low.to_string())
    }

    /// Whether the collector has finished draining (nothing more will change).
    fn drained(&self) -> bool {
        *self.phase.borrow() == Phase::Drained
    }
}

/// Keeps the gRPC health statuses (the server's, `""`, and
/// `rankscope.v1.Collector`'s) equal to [`Readiness`] until the collector has
/// drained.
pub async fn report_grpc_health(reporter: HealthReporter, readiness: Readiness) {
    let mut phase = readiness.phase.clone();
    let mut last = None;
    loop {
        let status = match readiness.check() {
            Ok(()) => ServingStatus::Serving,
            Err(_) => ServingStatus::NotServing,
        };
        if last != Some(status) {
            for name in ["", SERVICE_NAME] {
                reporter.set_service_status(name, status).await;
            }
            last = Some(status);
        }
        if readiness.drained() {
            return;
        }
        tokio::select! {
            changed = phase.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(HEALTH_REFRESH) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus as Wire;
    use tonic_health::pb::health_server::Health;
    use tonic_health::server::HealthService;

    #[tokio::test]
    async fn not_ready_while_draining_or_short_of_space() {
        let (tx, rx) = watch::channel(Phase::Serving);
        let roomy = Arc::new(SpaceGuard::with_probe(Path::new("/out"), 10, |_| Ok(100)));
        let ready = Readiness::new(rx.clone(), roomy);
        assert_eq!(ready.check(), Ok(()));
        tx.send(Phase::Draining).unwrap();
        assert!(ready.check().unwrap_err().contains("draining"));

        let cramped = Arc::new(SpaceGuard::with_probe(Path::new("/out"), 1000, |_| Ok(100)));
        let (_tx, rx) = watch::channel(Phase::Serving);
        let why = Readiness::new(rx, cramped).check().unwrap_err();
        assert!(why.contains("--min-free-bytes"), "{why}");
    }

    async fn grpc_status(health: &HealthService) -> i32 {
        let request = tonic::Request::new(HealthCheckRequest {
            service: SERVICE_NAME.into(),
        });
        health.check(request).await.unwrap().into_inner().status
    }

    #[tokio::test(start_paused = true)]
    async fn grpc_health_follows_the_phase() {
        let (tx, rx) = watch::channel(Phase::Serving);
        let space = Arc::new(SpaceGuard::with_probe(Path::new("/out"), 0, |_| Ok(0)));
        let (reporter, _server) = tonic_health::server::health_reporter();
        let health = HealthService::from_health_reporter(reporter.clone());
        let task = tokio::spawn(report_grpc_health(reporter, Readiness::new(rx, space)));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(grpc_status(&health).await, Wire::Serving as i32);
        tx.send(Phase::Draining).unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(grpc_status(&health).await, Wire::NotServing as i32);
        tx.send(Phase::Drained).unwrap();
        task.await.unwrap();
    }
}
