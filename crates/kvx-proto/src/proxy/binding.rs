//! Who a notice comes from, and who a request's notices may come from: a request binds to
//! the principal of its first notice, and each connection speaks for at most
//! `ProxyConfig::ranks_per_connection` of its ranks (`docs/spec/protocol.md` §Proxy).

use crate::ids::{Principal, ReqId};

/// Who sent a notice, as the notice channel's transport knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NoticeFrom {
    /// The connection it came on: a number the transport gives each connection of one notice
    /// channel, never twice while it runs (a PUSH that reconnects comes on a new one).
    pub connection: u64,
    /// Under CURVE, the principal of the key the connection proved (a keyed hash, as for the
    /// alloc channel's `Principal`); `None` where nothing authenticates the sender (NULL).
    pub principal: Option<Principal>,
}

impl NoticeFrom {
    /// A notice from `connection`, with no authenticated principal (NULL).
    pub fn connection(connection: u64) -> Self {
        Self {
            connection,
            principal: None,
        }
    }
}

/// Why a notice was refused: its sender is not one the request is bound to. A refused
/// notice changes nothing; it is counted (`ProxyTracker::refused_notices`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum NoticeRefusal {
    /// Under CURVE: the request is bound to the key of its first notice, and this one came
    /// from another.
    OtherPrincipal,
    /// A `ProxyNotif` from a connection that has spoken for `ranks_per_connection` ranks of
    /// the request already: a repeat, not another rank.
    RankRepeated,
}

impl NoticeRefusal {
    /// Every refusal, in the order `kind` labels them.
    pub const ALL: [NoticeRefusal; 2] =
        [NoticeRefusal::OtherPrincipal, NoticeRefusal::RankRepeated];

    /// A short name of the refusal: a metric's label.
    pub fn kind(self) -> &'static str {
        match self {
            NoticeRefusal::OtherPrincipal => "other_principal",
            NoticeRefusal::RankRepeated => "rank_repeated",
        }
    }
}

/// A refused notice, for the driver's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// Why.
    pub why: NoticeRefusal,
    /// The request it named.
    pub req_id: ReqId,
    /// The principal the request is bound to (`None` without CURVE).
    pub bound_to: Option<Principal>,
}

/// Who a request's notices came from: the principal its first notice bound it to, and every
/// connection that spoke for it with the ranks each counted for. Bounded by the notices
/// counted (at most `ranks` entries for an awaited request; for a kept one, its entry's bytes
/// count every connection: `early_bytes`).
#[derive(Debug, Clone, Default)]
pub(super) struct Binding {
    /// The first notice's principal; meaningful once `connections` is not empty.
    pub(super) principal: Option<Principal>,
    /// (connection, ranks counted from it); a connection that only failed the request counts
    /// 0 ranks.
    pub(super) connections: Vec<(u64, u32)>,
}

impl Binding {
    /// Whether a notice from `from` may count (`rank`: a `ProxyNotif`, which counts a rank;
    /// else a `FailNotif`). A failure needs the right principal only: without CURVE any
    /// connection may be a rank not heard from yet, and a failure ends the request whoever
    /// of its ranks says so.
    pub(super) fn admits(
        &self,
        from: NoticeFrom,
        rank: bool,
        per_connection: u32,
    ) -> Result<(), NoticeRefusal> {
        if !self.connections.is_empty() && self.principal != from.principal {
            return Err(NoticeRefusal::OtherPrincipal);
        }
        if rank && self.ranks_of(from.connection) >= per_connection {
            return Err(NoticeRefusal::RankRepeated);
        }
        Ok(())
    }

    /// Records a notice `admits` let through.
    pub(super) fn record(&mut self, from: NoticeFrom, rank: bool) {
        if self.connections.is_empty() {
            self.principal = from.principal;
        }
        let add = u32::from(rank);
        match self
            .connections
            .iter_mut()
            .find(|(c, _)| *c == from.connection)
        {
            Some((_, ranks)) => *ranks = ranks.saturating_add(add),
            None => self.connections.push((from.connection, add)),
        }
    }

    pub(super) fn ranks_of(&self, connection: u64) -> u32 {
        self.connections
            .iter()
            .find(|(c, _)| *c == connection)
            .map_or(0, |(_, ranks)| *ranks)
    }

    /// Ranks counted, over every connection.
    pub(super) fn ranks(&self) -> u64 {
        self.connections.iter().map(|(_, r)| u64::from(*r)).sum()
    }
}
