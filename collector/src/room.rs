//! The room for decoding: an eighth of the memory bound, shared by the messages
//! still arriving (unfinished) and the batches being decoded.
//!
//! A message's bytes first wait in the stream's read buffer until the last one
//! arrives, then the stream decodes the message into Arrow builders and hands the
//! rows to the buffer. Both stages hold memory that no stream's own share
//! (`intake::stream_bytes`) counts, so both take room here first:
//!
//! - an **unfinished** message takes its declared length (the 5-byte gRPC prefix
//!   says it) as soon as the prefix arrives, before any of its bytes are read on:
//!   tonic sizes the read buffer to that length then, and the bytes that arrive
//!   fill it. It gives the room back once its last byte is read (`grpc`), or when
//!   its stream ends. While it waits for room, its stream is not read, so HTTP/2
//!   flow control holds the sender after one window (64 KiB). A message of at
//!   most 8 KiB, or no larger than the largest its stream sent before rounded up
//!   to a power of two, takes none: it arrives in a read buffer its stream's
//!   share counts already;
//! - a **batch being decoded** takes an upper estimate of its decoded size until
//!   its rows are in the buffer (`service`).
//!
//! Both ask in one queue, in the order they ask (a request larger than the
//! room left waits at the head for it, and later ones wait behind it, so a
//! large message is never starved). A first version let batches being decoded
//! go first: under 1,024 loadgen ranks their decoding kept the room busy, the
//! first large message of a stream starved behind it, ranks ran unevenly and
//! peak RSS rose by about 40 MiB.
//!
//! No stream holds room here while it waits for more: an unfinished message asks
//! only when its stream has nothing else in hand, and gives it back before the
//! batch it becomes asks for its own; a batch holds its room only while it is
//! decoded and admitted (`service`: at most `FULL_WAIT`). Unfinished messages are
//! held for at most `--message-timeout` after their first byte (`grpc`), so room
//! held by a sender that stalls comes back.
//!
//! Below `grpc`, `service` and `intake`, which hold it; imports nothing of the
//! collector.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// `bytes` in whole KiB, at least 1 and at most `u32::MAX` (4 TiB, the most
/// `acquire_many` takes).
fn kib(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(1024))
        .unwrap_or(u32::MAX)
        .max(1)
}

/// The room for decoding (see the module's header).
#[derive(Debug)]
pub struct Room {
    /// Free room, in KiB; its waiters queue in the order they ask.
    free: Arc<Semaphore>,
    total_kib: u32,
    bytes: usize,
    /// Room held by unfinished messages (their declared lengths), in bytes.
    unfinished: AtomicUsize,
}

impl Room {
    /// Room of `bytes` (at least 1 KiB).
    pub fn new(bytes: usize) -> Arc<Room> {
        let total_kib = kib(bytes);
        Arc::new(Room {
            free: Arc::new(Semaphore::new(total_kib as usize)),
            total_kib,
            bytes,
            unfinished: AtomicUsize::new(0),
        })
    }

    /// The whole room, in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Room held by unfinished messages now, in bytes.
    pub fn unfinished_bytes(&self) -> usize {
        self.unfinished.load(Ordering::Relaxed)
    }

    /// Room held now by unfinished messages and batches being decoded, in bytes
    /// (counted in whole KiB).
    pub fn used_bytes(&self) -> usize {
        (self.total_kib as usize).saturating_sub(self.free.available_permits()) * 1024
    }

    async fn take(self: Arc<Self>, bytes: usize, unfinished: usize) -> RoomPermit {
        let permit = self
            .free
            .clone()
            .acquire_many_owned(kib(bytes).min(self.total_kib))
            .await
            .expect("the semaphore is never closed");
        self.unfinished.fetch_add(unfinished, Ordering::Relaxed);
        RoomPermit {
            _permit: permit,
            room: self,
            unfinished,
        }
    }

    /// Waits for room to decode a batch of about `bytes` (one larger than the
    /// whole room waits for all of it).
    pub async fn decode(self: &Arc<Self>, bytes: usize) -> RoomPermit {
        self.clone().take(bytes, 0).await
    }

    /// Waits for room for an unfinished message of `bytes` (its declared length).
    pub async fn unfinished(self: Arc<Self>, bytes: usize) -> RoomPermit {
        self.take(bytes, bytes).await
    }
}

/// Room held; given back when dropped.
#[derive(Debug)]
pub struct RoomPermit {
    _permit: OwnedSemaphorePermit,
    room: Arc<Room>,
    /// Bytes of an unfinished message it counts, or 0.
    unfinished: usize,
}

impl Drop for RoomPermit {
    fn drop(&mut self) {
        self.room
            .unfinished
            .fetch_sub(self.unfinished, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn pending<F: std::future::Future>(f: std::pin::Pin<&mut F>) -> bool {
        tokio::time::timeout(Duration::from_millis(20), f)
            .await
            .is_err()
    }

    #[tokio::test(start_paused = true)]
    async fn unfinished_messages_take_their_length_and_give_it_back() {
        let room = Room::new(64 << 10);
        let a = room.clone().unfinished(40 << 10).await;
        assert_eq!(room.unfinished_bytes(), 40 << 10);
        assert_eq!(room.used_bytes(), 40 << 10);
        let b = room.clone().unfinished(30 << 10);
        tokio::pin!(b);
        assert!(pending(b.as_mut()).await, "no room for 30 KiB beside 40");
        drop(a);
        let b = b.await;
        assert_eq!(room.unfinished_bytes(), 30 << 10);
        drop(b);
        assert_eq!(room.unfinished_bytes(), 0);
        assert_eq!(room.used_bytes(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn unfinished_messages_and_batches_share_one_queue_in_order() {
        let room = Room::new(64 << 10);
        let held = room.clone().unfinished(64 << 10).await;
        // An unfinished message asks first, a batch to decode after it.
        let unfinished = room.clone().unfinished(48 << 10);
        tokio::pin!(unfinished);
        assert!(pending(unfinished.as_mut()).await);
        let decode = room.decode(32 << 10);
        tokio::pin!(decode);
        assert!(pending(decode.as_mut()).await);
        drop(held);
        // The first to ask gets its room; the batch waits for more.
        let unfinished = unfinished.await;
        assert!(pending(decode.as_mut()).await);
        assert_eq!(room.unfinished_bytes(), 48 << 10);
        drop(unfinished);
        let decoding = decode.await;
        assert_eq!(room.unfinished_bytes(), 0);
        assert_eq!(room.used_bytes(), 32 << 10);
        drop(decoding);
        assert_eq!(room.used_bytes(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_large_unfinished_message_is_not_overtaken_by_small_ones() {
        let room = Room::new(64 << 10);
        let held = room.clone().unfinished(8 << 10).await;
        let large = room.clone().unfinished(64 << 10);
        tokio::pin!(large);
        assert!(pending(large.as_mut()).await);
        let small = room.clone().unfinished(1 << 10);
        tokio::pin!(small);
        assert!(pending(small.as_mut()).await, "small waits behind large");
        drop(held);
        let large = large.await;
        assert!(pending(small.as_mut()).await);
        drop(large);
        small.await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_larger_than_the_room_takes_all_of_it() {
        let room = Room::new(64 << 10);
        let all = room.clone().unfinished(1 << 30).await;
        assert_eq!(room.used_bytes(), 64 << 10);
        assert_eq!(room.unfinished_bytes(), 1 << 30);
        drop(all);
        assert_eq!(room.unfinished_bytes(), 0);
    }
}
