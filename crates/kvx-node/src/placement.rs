//! Caller placement at the receiver (`kvx_proto::Placement::Caller`,
//! `docs/spec/protocol.md` §Caller placement): the application owns the receive buffer and
//! lends each request's slots (`ChunkReader::reserve`), takes them back
//! (`ChunkReader::withdraw`), and hears each reservation come back on a stream of its own
//! (`ReceiverHandle::take_returns`), apart from the decoder's notices: a vLLM decode
//! engine's scheduler allocates the blocks, kvx's decoder side reads nothing. What comes
//! back (`Returned`) is the receiver's output, beside its notices (`receiver.rs`).

use kvx_proto::receiver::PlacementError;
use kvx_proto::{ClaimSecret, SlotIndex};

use crate::receiver::{ChunkReader, Cmd, ReceiverHandle, Returns};

impl<M> ChunkReader<M> {
    /// Lends `slots` (chunk i to `slots[i]`) to request `req_id`, which the first batch
    /// that carries `secret` then claims (`ReceiverLedger::handle_reserve`): hand `secret`
    /// to the one sender meant to claim it. Refused with nothing changed (the reason says
    /// why), or `Stopped` once the driver has ended.
    pub async fn reserve(
        &self,
        req_id: &str,
        slots: Vec<SlotIndex>,
        secret: ClaimSecret,
    ) -> Result<(), PlacementError> {
        self.reserve_held(req_id, 0, slots, secret).await
    }

    /// `reserve` for a request whose first `held` chunks the application holds already
    /// (a decode engine's local prefix hit): its sender is told they are sent, and chunk
    /// `held + i` goes to `slots[i]` (`ReceiverLedger::handle_reserve_held`).
    pub async fn reserve_held(
        &self,
        req_id: &str,
        held: u32,
        slots: Vec<SlotIndex>,
        secret: ClaimSecret,
    ) -> Result<(), PlacementError> {
        let req_id = req_id.to_owned();
        self.link
            .ask_or(
                |tx| Cmd::Reserve(req_id, held, slots, secret, tx),
                || PlacementError::Stopped,
            )
            .await
    }

    /// Takes reservation `req_id` back (the application aborted its request); its slots are
    /// returned once no write can land in them (`ReceiverLedger::handle_withdraw`).
    pub async fn withdraw(&self, req_id: &str) -> Result<(), PlacementError> {
        let req_id = req_id.to_owned();
        self.link
            .ask_or(|tx| Cmd::Withdraw(req_id, tx), || PlacementError::Stopped)
            .await
    }
}

impl<M> ReceiverHandle<M> {
    /// The stream of returned reservations, once (`None` after the first call). Take it
    /// before `into_parts` or `into_ready_leases`; a receiver that places requests itself
    /// (`Placement::Pool`) sends nothing on it.
    pub fn take_returns(&mut self) -> Option<Returns> {
        self.returns.take()
    }
}
