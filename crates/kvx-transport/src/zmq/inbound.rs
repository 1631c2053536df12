//! The byte budget of a bound socket's received messages that its handle has not finished
//! with: without it, the queue between the connections and the handle (`CHANNEL_DEPTH`
//! messages) could hold `CHANNEL_DEPTH × frame_max_bytes` (1 GiB by default) whenever the
//! handle falls behind a flood.
//!
//! Each payload takes its length (at most the whole budget) from a semaphore before it is
//! queued, and gives it back when the last reference to its bytes is dropped, whoever drops
//! it: the budget follows the bytes, not the queue. A connection whose message finds the
//! budget spent waits, reading nothing more, so the peer meets TCP backpressure and nothing
//! is dropped. The semaphore is fair, so connections are served in the order they asked.
//!
//! The same type bounds a bound socket's large frame bodies while they are read
//! (`ZmqConfig::unfinished_bytes_max`, `zmtp::FrameReader`): a body longer than
//! `zmtp::SMALL_FRAME` reserves its length before it is allocated (`reserve`) and holds it until
//! its message is handed on into this budget, so a thousand connections that each announce a
//! 1 MiB frame and send most of it hold that budget's worth, not a gigabyte, and the others
//! wait. Bodies from 128 KiB on are read into mappings of their own (`read_mapped`), which go
//! back to the system when the bodies do.

use std::io;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bytes in flight from a bound socket's connections to its handle.
#[derive(Debug, Clone)]
pub(super) struct InboundBudget {
    permits: Arc<Semaphore>,
    max: u32,
}

impl InboundBudget {
    /// `bytes` at most (validated by `ZmqConfig::validate` to fit a `u32`).
    pub(super) fn new(bytes: usize) -> Self {
        let max = u32::try_from(bytes).unwrap_or(u32::MAX).max(1);
        Self {
            permits: Arc::new(Semaphore::new(max as usize)),
            max,
        }
    }

    /// `payload`, once the budget has room for it, as `Bytes` that return their share of
    /// the budget when dropped. Waits as long as the budget is spent.
    pub(super) async fn admit(&self, payload: Bytes) -> Bytes {
        let need = u32::try_from(payload.len())
            .unwrap_or(u32::MAX)
            .min(self.max);
        // The semaphore is never closed, so acquiring fails never.
        let Ok(permit) = self.permits.clone().acquire_many_owned(need).await else {
            return payload;
        };
        Bytes::from_owner(Held {
            payload,
            _permit: permit,
        })
    }

    /// A share of `len` bytes (at most the whole budget), taken before the bytes exist: a frame
    /// body about to be read. Waits as long as the budget is spent; dropping it gives it back.
    pub(super) async fn reserve(&self, len: usize) -> Option<OwnedSemaphorePermit> {
        let need = u32::try_from(len).unwrap_or(u32::MAX).min(self.max);
        self.permits.clone().acquire_many_owned(need).await.ok()
    }

    /// Bytes of the budget not in use (for tests).
    #[cfg(test)]
    pub(super) fn available(&self) -> usize {
        self.permits.available_permits()
    }
}

/// A payload and its share of the budget, released together.
struct Held {
    payload: Bytes,
    _permit: OwnedSemaphorePermit,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.payload
    }
}

/// A large frame body of `len` bytes, of which `head` holds the first (and is emptied), the
/// rest read from `io`: into an anonymous mapping of exactly `len` bytes (pages are committed
/// only as its bytes arrive) that goes back to the system whole when the body's last reference
/// is dropped. From the allocator, megabyte bodies freed by connections that come and go stay
/// with it (glibc raises its mapping threshold past the largest block freed, and keeps freed
/// heap blocks): a thousand reconnecting peers would leave a receiver tens of MiB larger than
/// their budget, long after they are gone.
pub(super) async fn read_mapped<R: AsyncRead + Unpin>(
    io: &mut R,
    head: &mut BytesMut,
    len: usize,
) -> io::Result<Bytes> {
    let mut body = memmap2::MmapMut::map_anon(len)?;
    let mut got = head.len().min(len);
    body[..got].copy_from_slice(&head[..got]);
    head.clear();
    while got < len {
        match io.read(&mut body[got..]).await? {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n => got += n,
        }
    }
    Ok(Bytes::from_owner(body))
}

#[cfg(test)]
mod tests {
    use super::super::frames::encode_message;
    use super::super::zmtp::{FrameReader, Incoming, ReadLimits};
    use super::*;
    use std::time::Duration;

    fn limits() -> ReadLimits {
        ReadLimits {
            message_max_bytes: 1 << 20,
            refuse_above_bytes: 1 << 20,
            message_timeout: Duration::from_secs(5),
        }
    }

    #[tokio::test]
    async fn the_budget_follows_the_bytes_until_their_last_reference_drops() {
        let budget = InboundBudget::new(1000);
        let a = budget.admit(Bytes::from(vec![7u8; 600])).await;
        assert_eq!(budget.available(), 400);
        assert_eq!(&a[..3], &[7, 7, 7]);
        let clone = a.slice(10..20);
        drop(a);
        assert_eq!(budget.available(), 400, "a slice still holds it");
        // A second payload that does not fit waits until the first is gone.
        let waiting = budget.admit(Bytes::from(vec![1u8; 500]));
        tokio::pin!(waiting);
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(50), &mut waiting)
                .await
                .is_err(),
            "500 bytes wait while only 400 are free"
        );
        drop(clone);
        let b = waiting.await;
        assert_eq!(budget.available(), 500);
        drop(b);
        assert_eq!(budget.available(), 1000);
    }

    #[tokio::test]
    async fn a_payload_larger_than_the_budget_takes_all_of_it() {
        let budget = InboundBudget::new(100);
        let big = budget.admit(Bytes::from(vec![0u8; 1000])).await;
        assert_eq!((big.len(), budget.available()), (1000, 0));
        drop(big);
        assert_eq!(budget.available(), 100);
    }

    /// Readers sharing a budget of large frames: a body longer than `SMALL_FRAME` holds its
    /// length from its header until its message is handed on; a second one waits (here past
    /// its message's timeout) while the budget is spent; small bodies never wait.
    #[tokio::test]
    async fn large_bodies_share_one_budget_and_give_it_back() {
        let budget = InboundBudget::new(100 << 10);
        let large = vec![1u8; 80 << 10];
        let mut s = Vec::new();
        encode_message(&[b"", &large], &mut s);
        let mut a = FrameReader::new(&s[..], limits()).with_budget(budget.clone());
        let Incoming::Message(frames) = a.next().await.expect("read") else {
            panic!("a message");
        };
        assert_eq!(frames[1].len(), 80 << 10);
        assert_eq!(budget.available(), 20 << 10, "its body holds 80 KiB");
        let quick = ReadLimits {
            message_timeout: Duration::from_millis(100),
            ..limits()
        };
        let mut b = FrameReader::new(&s[..], quick).with_budget(budget.clone());
        let waited = b.next().await.expect_err("the budget is spent");
        assert_eq!(waited.kind(), io::ErrorKind::TimedOut);
        let mut small = Vec::new();
        encode_message(&[b"", &[2u8; 12 << 10]], &mut small);
        let mut c = FrameReader::new(&small[..], quick).with_budget(budget.clone());
        assert!(matches!(c.next().await, Ok(Incoming::Message(_))));
        a.release_reserved();
        assert_eq!(budget.available(), 100 << 10, "handing it on gives it back");
        let mut d = FrameReader::new(&s[..], quick).with_budget(budget.clone());
        assert!(matches!(d.next().await, Ok(Incoming::Message(_))));
        drop(d);
        assert_eq!(
            budget.available(),
            100 << 10,
            "and so does the connection's end"
        );
    }
}
