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
//! wait.

use std::sync::Arc;

use bytes::Bytes;
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
