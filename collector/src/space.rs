//! Free space on the output filesystem, and the `--min-free-bytes` floor below
//! which the collector refuses new batches.
//!
//! A full disk alone loses nothing: a failed commit removes its temporary files,
//! keeps its rows and is retried, and nothing unacknowledged leaves an agent. But
//! the collector would go on accepting rows it cannot write, until its buffer bound
//! stops the streams. The floor refuses batches *before* the disk is full, with
//! `RESOURCE_EXHAUSTED` (the gRPC code for "the file system is out of space") and a
//! message naming the free bytes, the directory and the fix. Agents treat it like
//! any failed stream: they keep their batches and resend them with backoff, so the
//! rows land once space is freed. Batches already accepted are still committed.
//!
//! Free space is probed with `statvfs` at most once per [`PROBE_INTERVAL`], not per
//! batch; a probe that fails counts as "enough space" (the commit path still
//! reports a full disk on its own).

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// The default floor: refuse batches when less than this is free.
pub const DEFAULT_MIN_FREE_BYTES: u64 = 256 * 1024 * 1024;
/// How long one probe of the free space is trusted.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// A batch refused because the output filesystem is below the floor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the filesystem holding {dir} has {free_bytes} bytes free, below --min-free-bytes {min_free_bytes}: free space there or restart the collector with --out on a larger disk; resend this batch later"
)]
pub struct LowSpace {
    pub dir: PathBuf,
    pub free_bytes: u64,
    pub min_free_bytes: u64,
}

type Probe = Box<dyn Fn(&Path) -> io::Result<u64> + Send + Sync>;

/// Decides whether there is room for new batches.
pub struct SpaceGuard {
    dir: PathBuf,
    min_free_bytes: u64,
    probe: Probe,
    /// When the last probe ran and what it found (`None`: the probe failed).
    last: Mutex<Option<(Instant, Option<u64>)>>,
}

impl std::fmt::Debug for SpaceGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpaceGuard")
            .field("dir", &self.dir)
            .field("min_free_bytes", &self.min_free_bytes)
            .finish_non_exhaustive()
    }
}

impl SpaceGuard {
    /// Guards `dir` with `statvfs`; a floor of 0 turns the guard off.
    pub fn new(dir: &Path, min_free_bytes: u64) -> SpaceGuard {
        SpaceGuard::with_probe(dir, min_free_bytes, available_bytes)
    }

    /// Guards `dir` with another way to measure free bytes (for tests).
    pub fn with_probe(
        dir: &Path,
        min_free_bytes: u64,
        probe: impl Fn(&Path) -> io::Result<u64> + Send + Sync + 'static,
    ) -> SpaceGuard {
        SpaceGuard {
            dir: dir.to_path_buf(),
            min_free_bytes,
            probe: Box::new(probe),
            last: Mutex::new(None),
        }
    }

    /// Whether a new batch may be accepted.
    pub fn check(&self) -> Result<(), LowSpace> {
        if self.min_free_bytes == 0 {
            return Ok(());
        }
        match self.free_bytes() {
            Some(free_bytes) if free_bytes < self.min_free_bytes => Err(LowSpace {
                dir: self.dir.clone(),
                free_bytes,
                min_free_bytes: self.min_free_bytes,
            }),
            _ => Ok(()),
        }
    }

    /// The free bytes, probed at most once per [`PROBE_INTERVAL`]; logs when the
    /// answer crosses the floor.
    fn free_bytes(&self) -> Option<u64> {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if let Some((at, free)) = *last
            && now.duration_since(at) < PROBE_INTERVAL
        {
            return free;
        }
        let free = match (self.probe)(&self.dir) {
            Ok(free) => Some(free),
            Err(error) => {
                if !matches!(*last, Some((_, None))) {
                    tracing::warn!(dir = %self.dir.display(), %error, "cannot measure free space; accepting batches");
                }
                None
            }
        };
        let low = |f: Option<u64>| f.is_some_and(|f| f < self.min_free_bytes);
        let was_low = last.is_some_and(|(_, f)| low(f));
        if low(free) && !was_low {
            tracing::warn!(
                dir = %self.dir.display(),
                free_bytes = free.unwrap_or_default(),
                min_free_bytes = self.min_free_bytes,
                "output filesystem below --min-free-bytes: refusing new batches until space is freed"
            );
        } else if was_low && !low(free) {
            tracing::info!(dir = %self.dir.display(), "output filesystem has room again: accepting batches");
        }
        *last = Some((now, free));
        free
    }
}

/// Bytes an unprivileged process may still write on the filesystem holding `dir`.
pub fn available_bytes(dir: &Path) -> io::Result<u64> {
    #[cfg(unix)]
    {
        let stat = rustix::fs::statvfs(dir)?;
        Ok(stat.f_bavail.saturating_mul(stat.f_frsize))
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "free space is only measured on Unix",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A probe reporting `free` and counting its calls.
    fn probe(free: Arc<AtomicU64>, calls: Arc<AtomicU64>) -> impl Fn(&Path) -> io::Result<u64> {
        move |_| {
            calls.fetch_add(1, Ordering::Relaxed);
            Ok(free.load(Ordering::Relaxed))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn refuses_below_the_floor_and_probes_at_most_once_a_second() {
        let (free, calls) = (Arc::new(AtomicU64::new(100)), Arc::new(AtomicU64::new(0)));
        let guard =
            SpaceGuard::with_probe(Path::new("/out"), 1000, probe(free.clone(), calls.clone()));
        for _ in 0..50 {
            let low = guard.check().unwrap_err();
            assert_eq!(low.free_bytes, 100);
        }
        assert_eq!(calls.load(Ordering::Relaxed), 1, "one probe for 50 batches");
        let message = guard.check().unwrap_err().to_string();
        for part in [
            "/out",
            "100 bytes free",
            "--min-free-bytes 1000",
            "free space",
        ] {
            assert!(message.contains(part), "{part:?} missing from {message}");
        }

        free.store(5000, Ordering::Relaxed);
        assert!(
            guard.check().is_err(),
            "the old answer holds within a second"
        );
        tokio::time::advance(PROBE_INTERVAL).await;
        assert_eq!(guard.check(), Ok(()));
        assert_eq!(calls.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_zero_floor_never_probes_and_a_failed_probe_accepts() {
        let calls = Arc::new(AtomicU64::new(0));
        let guard = SpaceGuard::with_probe(
            Path::new("/out"),
            0,
            probe(Arc::new(AtomicU64::new(0)), calls.clone()),
        );
        assert_eq!(guard.check(), Ok(()));
        assert_eq!(calls.load(Ordering::Relaxed), 0);
        let failing = SpaceGuard::with_probe(Path::new("/out"), u64::MAX, |_| {
            Err(io::Error::other("no statvfs here"))
        });
        assert_eq!(failing.check(), Ok(()));
    }

    #[test]
    fn statvfs_measures_a_real_directory() {
        let dir = tempfile::tempdir().unwrap();
        assert!(available_bytes(dir.path()).unwrap() > 0);
        assert!(available_bytes(&dir.path().join("missing")).is_err());
    }
}
