//! `FabricError`: why a fabric, or the memory under it, refused. Apart from `fabric` so that
//! `region` (the memory every fabric stands on) can name it without a circle.

/// Why a fabric could not expose, connect or complete a write.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FabricError {
    /// The endpoint is not one this fabric takes, or is exposed already: fix the address.
    #[error("invalid endpoint {endpoint:?}: {why}")]
    Endpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong with it.
        why: String,
    },
    /// Nothing is exposed at the endpoint (the connection was refused): the receiver is not
    /// up yet, or gone. Retrying may help; the sender's driver does, bounded.
    #[error("no buffer is exposed at {0}")]
    NotExposed(String),
    /// The write (its id) names a slot or a length outside the staging or the remote
    /// memory (the text says which): a caller bug. Nothing of it landed.
    #[error("write {0} is outside the registered memory ({1})")]
    OutOfBounds(u64, String),
    /// The connection was reset or broke while the write was outstanding: nothing of it
    /// lands after this completion, so its staging slot may be reused.
    #[error("the connection was reset; the write was flushed")]
    Flushed,
    /// The receiver's fabric refused the write (nothing of it landed): the connection's
    /// peer holds no current grant for that slot.
    #[error("the receiver refused the write: {0}")]
    Refused(String),
    /// The write's bytes landed but did not match the checksum sent with them; the
    /// receiver fails the request.
    #[error("the receiver found the chunk corrupt: {0}")]
    Corrupt(String),
    /// The receiver does not accept this connection's credential (not issued by it, or by
    /// an earlier incarnation of it).
    #[error("the receiver at {0} refused the fabric credential: {1}")]
    Unauthorized(String, String),
    /// The two sides cannot work together as configured (another chunk size, another
    /// protocol version): retrying cannot help.
    #[error("the fabric at {endpoint} is incompatible: {why}")]
    Incompatible {
        /// The receiver's endpoint.
        endpoint: String,
        /// What differs.
        why: String,
    },
    /// The connection's IO task is gone: nothing more can be posted; connect again.
    #[error("the connection is closed")]
    Closed,
    /// Memory for a buffer or staging could not be had (mapped, registered with the NIC,
    /// or keyed): too large for the machine or its limits (RDMA: the locked-memory limit).
    #[error("cannot allocate {0}")]
    Allocation(String),
    /// This fabric cannot use memory the caller owns: its memory must be of its own kind
    /// (a shared mapping); let it allocate the region and use the views it hands out.
    #[error(
        "{0} cannot use memory the caller owns: it needs a shared mapping of its own; let it \
         allocate the region and use the slot views it hands out"
    )]
    ExternalMemory(String),
    /// The operating system or the device refused, in its words.
    #[error("{0}")]
    Io(String),
}
