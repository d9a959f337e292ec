//! How the metrics worker thread runs (through the C++ shim in `threads.cpp`).
//!
//! It limits itself to one libtorch intra-op thread, so its small matrix products
//! never start a second OpenMP team that would fight the training thread's team
//! for the same cores. The training threads keep their setting.
//!
//! It stays in the normal scheduling class: the overhead budget
//! ([`crate::budget`]) bounds its CPU time by giving it fewer samples. (In the
//! idle class it got no CPU time at all while training kept every core busy.)

unsafe extern "C" {
    fn rankscope_threads_here() -> i32;
    fn rankscope_limit_threads_here(n: i32) -> i32;
}

/// The intra-op threads libtorch uses for operations started on this thread.
pub fn this_thread() -> Option<usize> {
    // SAFETY: the shim takes no pointers and catches every C++ exception.
    let n = unsafe { rankscope_threads_here() };
    usize::try_from(n).ok()
}

/// Limits operations started on this thread to `n` intra-op threads; returns the
/// count now in force, or `None` when the OpenMP runtime could not be found.
pub fn limit_this_thread(n: usize) -> Option<usize> {
    let n = i32::try_from(n.max(1)).unwrap_or(i32::MAX);
    // SAFETY: as above.
    let now = unsafe { rankscope_limit_threads_here(n) };
    usize::try_from(now).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_applies_to_the_calling_thread_only() {
        let before = this_thread().expect("libtorch answers");
        let limited = std::thread::spawn(|| limit_this_thread(1)).join().unwrap();
        assert_eq!(limited, Some(1));
        assert_eq!(this_thread(), Some(before), "other threads keep theirs");
    }
}
