//! The bounded row queue between the training side and the transport thread.
//!
//! A push takes a short uncontended lock and never wakes the transport thread: the
//! thread takes what is queued every [`crate::transport::DRAIN_EVERY`], so a row
//! costs the training thread no system call. When the queue is full (or closed
//! by `finish`) the row comes back to the caller, which counts it as dropped.

use std::sync::Mutex;

use rankscope_proto::Row;

/// Rows queued for the transport thread, at most `capacity` at once.
#[derive(Debug)]
pub(crate) struct RowQueue {
    /// The rows, and whether the queue is closed (after `finish`).
    state: Mutex<(Vec<Row>, bool)>,
    capacity: usize,
}

impl RowQueue {
    pub(crate) fn new(capacity: usize) -> RowQueue {
        RowQueue {
            state: Mutex::new((Vec::new(), false)),
            capacity: capacity.max(1),
        }
    }

    /// Queues `row`, or gives it back when the queue is full or closed.
    // The row comes back by value: boxing it would allocate on the hot path.
    #[allow(clippy::result_large_err)]
    pub(crate) fn push(&self, row: Row) -> Result<(), Row> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (rows, closed) = &mut *state;
        if *closed || rows.len() >= self.capacity {
            return Err(row);
        }
        rows.push(row);
        Ok(())
    }

    /// Everything queued so far, in order; with `close`, later pushes fail.
    pub(crate) fn take(&self, close: bool) -> Vec<Row> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.1 |= close;
        std::mem::take(&mut state.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rankscope_proto::v1::EventRow;

    fn event(value: i64) -> Row {
        Row::Event(EventRow {
            value: Some(value),
            ..Default::default()
        })
    }

    #[test]
    fn bounded_ordered_and_closed_by_finish() {
        let q = RowQueue::new(2);
        assert!(q.push(event(1)).is_ok());
        assert!(q.push(event(2)).is_ok());
        assert_eq!(q.push(event(3)), Err(event(3)));
        assert_eq!(q.take(false), vec![event(1), event(2)]);
        assert!(q.push(event(4)).is_ok());
        assert_eq!(q.take(true), vec![event(4)]);
        assert_eq!(q.push(event(5)), Err(event(5)));
    }
}
