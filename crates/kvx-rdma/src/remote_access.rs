//! `RemoteAccess`, what a peer may do to this side's memory and queue pair. A leaf, so that
//! `memory` (which registers a region with it) and `verbs` (whose seam takes it when a queue
//! pair or a region is set up, and names `RdmaMemory`) both import it one way.

/// What a peer may do to this side's memory and queue pair: least privilege, so that a
/// peer — or a bug — can write nothing but a receiver's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteAccess {
    /// Nothing: a sender's staging (the NIC only reads it for its own writes) and queue pair.
    None,
    /// RDMA WRITE: a receiver's buffer and queue pair.
    Write,
}
