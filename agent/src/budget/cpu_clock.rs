//! CPU clocks for the overhead budget ([`super::controller`]): the whole process's
//! (`CLOCK_PROCESS_CPUTIME_ID`) and one thread's, read from any thread of the
//! process (`pthread_getcpuclockid`). Each read is one `clock_gettime` call.

use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

fn read(clock: libc::clockid_t) -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    if rc != 0 {
        return None;
    }
    let secs = u64::try_from(ts.tv_sec).ok()?;
    let nanos = u64::try_from(ts.tv_nsec).ok()?;
    Some(secs.saturating_mul(1_000_000_000).saturating_add(nanos))
}

/// CPU time of the whole process (all its threads), in nanoseconds.
pub fn process_ns() -> Option<u64> {
    read(libc::CLOCK_PROCESS_CPUTIME_ID)
}

/// The process's CPU time and the transport thread's, as the transport thread
/// last read them ([`TickClocks::refresh`], on its tick).
///
/// Reading the process's clock visits every thread of the process, and reading
/// another thread's clock reaches into that thread's CPU. On a loaded machine
/// (more busy threads than cores) such a read took milliseconds of wall time: 4
/// training processes of 3 threads each on 2 cores read the process's clock in
/// 16 µs at the median but 13.6 ms at the 99th percentile (BENCHMARKS.md, "The
/// issue's own run"). So the training thread's budget decisions read these
/// values, at most a tick old, which only makes the agent's share look larger
/// (the process's time lags), never smaller.
#[derive(Debug, Default)]
pub struct TickClocks {
    process: AtomicU64,
    transport: AtomicU64,
}

impl TickClocks {
    /// Reads the process's clock and the calling thread's, which must be the
    /// transport thread.
    pub fn refresh(&self) {
        if let Some(ns) = process_ns() {
            self.process.fetch_max(ns, Ordering::Relaxed);
        }
        if let Some(ns) = this_thread_ns() {
            self.transport.fetch_max(ns, Ordering::Relaxed);
        }
    }

    /// The process's CPU time at the last read; `None` before the first.
    pub fn process_ns(&self) -> Option<u64> {
        Some(self.process.load(Ordering::Relaxed)).filter(|&ns| ns > 0)
    }

    /// The transport thread's CPU time at the last read; `None` before the first.
    pub fn transport_ns(&self) -> Option<u64> {
        Some(self.transport.load(Ordering::Relaxed)).filter(|&ns| ns > 0)
    }
}

/// CPU time of the calling thread, in nanoseconds.
pub fn this_thread_ns() -> Option<u64> {
    read(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// The CPU clock of another thread of this process. Read it only while the thread
/// is not yet joined: after that the clock may name another thread.
#[derive(Debug, Clone, Copy)]
pub struct ThreadClock(libc::clockid_t);

impl ThreadClock {
    /// The clock of the thread behind `handle`.
    pub fn of<T>(handle: &JoinHandle<T>) -> Option<ThreadClock> {
        let mut clock: libc::clockid_t = 0;
        // SAFETY: the handle is not joined, so its pthread_t is valid; `clock` is
        // a valid out-pointer.
        let rc = unsafe { libc::pthread_getcpuclockid(handle.as_pthread_t(), &mut clock) };
        (rc == 0).then_some(ThreadClock(clock))
    }

    /// The thread's CPU time in nanoseconds.
    pub fn read_ns(self) -> Option<u64> {
        read(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn a_threads_clock_counts_its_work_and_the_process_clock_counts_all() {
        let (go, wait) = mpsc::channel::<()>();
        let (done, finished) = mpsc::channel::<u64>();
        let worker = std::thread::spawn(move || {
            wait.recv().unwrap();
            // Busy until this thread's own clock has run 20 ms.
            let start = this_thread_ns().unwrap();
            let mut x = 0u64;
            while this_thread_ns().unwrap() - start < 20_000_000 {
                x = std::hint::black_box(x.wrapping_add(1));
            }
            done.send(this_thread_ns().unwrap()).unwrap();
            // Stay unjoined until the clock has been read from outside.
            wait.recv().ok();
        });
        let clock = ThreadClock::of(&worker).expect("a thread clock");
        let process_before = process_ns().unwrap();
        let before = clock.read_ns().unwrap();
        go.send(()).unwrap();
        let own = finished.recv().unwrap();
        let after = clock.read_ns().unwrap();
        assert!(
            after >= own && after - before >= 20_000_000,
            "{before} {after}"
        );
        assert!(process_ns().unwrap() - process_before >= 20_000_000);
        drop(go);
        worker.join().unwrap();
    }
}
