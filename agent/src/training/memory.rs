//! Memory readings: the process's resident set, and the accelerator allocator's
//! allocated / reserved / peak bytes, read by whatever the adapter sets
//! ([`DeviceMemory`]: the Python package asks torch, a tch program libtorch).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Allocator bytes of one accelerator device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceBytes {
    pub allocated: u64,
    pub reserved: u64,
    pub peak: u64,
}

/// Reads the accelerator allocator's bytes for a step row (`None`: no accelerator).
/// Called on the training thread at the end of every step: it must cost microseconds
/// and never wait for the device.
pub trait DeviceMemory: Send + std::fmt::Debug {
    fn read(&self) -> Option<DeviceBytes>;
}

/// How often the resident set is read again; steps in between reuse the value, so
/// a step costs no system call.
pub const RSS_REFRESH: Duration = Duration::from_millis(100);

/// Reads the resident set size (`VmRSS` of `/proc/self/status`, whatever the page
/// size), keeping the file open,
/// at most every [`RSS_REFRESH`].
#[derive(Debug)]
pub struct RssReader {
    state: Mutex<RssState>,
}

#[derive(Debug)]
struct RssState {
    file: Option<File>,
    last: Option<(Instant, u64)>,
}

impl Default for RssReader {
    fn default() -> Self {
        RssReader {
            state: Mutex::new(RssState {
                file: File::open("/proc/self/status").ok(),
                last: None,
            }),
        }
    }
}

impl RssReader {
    /// Resident bytes (at most [`RSS_REFRESH`] old), or `None` where `/proc` is
    /// unavailable.
    pub fn read(&self) -> Option<u64> {
        let mut state = self.state.lock().ok()?;
        if let Some((at, bytes)) = state.last
            && at.elapsed() < RSS_REFRESH
        {
            return Some(bytes);
        }
        let bytes = self.read_now(state.file.as_mut()?)?;
        state.last = Some((Instant::now(), bytes));
        Some(bytes)
    }

    fn read_now(&self, file: &mut File) -> Option<u64> {
        let mut buf = [0u8; 4096];
        file.seek(SeekFrom::Start(0)).ok()?;
        let n = file.read(&mut buf).ok()?;
        let text = std::str::from_utf8(&buf[..n]).ok()?;
        let line = text.lines().find(|l| l.starts_with("VmRSS:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rss_is_plausible() {
        let rss = RssReader::default().read().expect("linux has /proc");
        assert!(rss > 1 << 20, "{rss}");
    }
}
