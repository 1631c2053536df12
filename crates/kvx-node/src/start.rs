//! Why a driver could not start (`StartError`), and the one place a node's memory shape is
//! made from its configuration (`configured_geometry`) or a lent region is held to it
//! (`lent_fits`).

/// Why a driver could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The configuration cannot work (the state machine's `validate` says why): fix it.
    #[error(transparent)]
    Config(#[from] kvx_proto::ConfigError),
    // Not `#[from]`: that would make the inner error a `source` as well, and error chains
    // (`{:#}`) would print it twice.
    /// Binding or connecting the control channel failed.
    #[error("transport: {0}")]
    Transport(kvx_io::TransportError),
    /// Exposing the receive buffer or allocating staging failed.
    #[error("fabric: {0}")]
    Fabric(kvx_io::FabricError),
    /// Memory the caller lent does not fit the configuration (its slot count or size).
    #[error("memory: {0}")]
    Memory(String),
    /// The sender's driver has ended (shut down, closed, or its runtime went away), so it
    /// can connect to no receiver (`SenderHandle::add_receiver`): make a new sender.
    #[error(
        "this sender has stopped (shut down, closed, or its runtime ended): make a new sender"
    )]
    Stopped,
}

impl From<kvx_io::TransportError> for StartError {
    fn from(e: kvx_io::TransportError) -> Self {
        Self::Transport(e)
    }
}

impl From<kvx_io::FabricError> for StartError {
    fn from(e: kvx_io::FabricError) -> Self {
        Self::Fabric(e)
    }
}

/// The shape of a node's own memory (a sender's staging, a receiver's buffer): the slot count
/// its configuration names (`SenderConfig::staging_slots`, `ReceiverConfig::buffer_slots`),
/// of `slot_bytes` each, checked by `SlotGeometry::new`.
///
/// Derived here, in one place, rather than taken from the caller beside the configuration:
/// the core's state machines count the configuration's slots, so a second slot count passed
/// with the memory's shape could disagree with them; derived from the configuration, it
/// cannot. Memory a caller lends (`start_in`) brings its own shape, which `lent_fits` holds
/// to the configuration.
pub(crate) fn configured_geometry(
    config_slots: u32,
    slot_bytes: usize,
) -> Result<kvx_io::SlotGeometry, StartError> {
    Ok(kvx_io::SlotGeometry::new(config_slots, slot_bytes)?)
}

/// The one check that lent memory (`start_in`) has the slot count the configuration names:
/// refused, naming both, rather than a state machine counting slots the memory lacks (or
/// never using some it has).
pub(crate) fn lent_fits(
    what: &str,
    region: &kvx_io::ExternalRegion,
    config_slots: u32,
) -> Result<(), StartError> {
    if region.slots() == config_slots {
        return Ok(());
    }
    Err(StartError::Memory(format!(
        "the {what} region holds {} slots of {} bytes, the configuration {config_slots} {what} \
         slots",
        region.slots(),
        region.slot_bytes(),
    )))
}
