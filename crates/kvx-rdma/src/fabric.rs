//! `RdmaFabric`: `kvx_io::Fabric` over a `Verbs` device.

use std::sync::Arc;

use kvx_io::{
    ExternalRegion, Fabric, FabricConn, FabricError, FabricListener, SlotGeometry, SlotMemory,
};

use crate::config::RdmaConfig;
use crate::device::Device;
use crate::memory::RdmaMemory;
use crate::verbs::{RemoteAccess, Verbs};
use crate::wire::{checked_geometry, within_one_write};
use crate::{link, receiver, sender};

/// Why an RDMA fabric could not be opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RdmaError {
    /// No usable device: libibverbs is missing, or it lists no device.
    #[error("no RDMA device found: {0}")]
    NoDevice(String),
    /// `RdmaConfig::device` names a device that is not there.
    #[error("no RDMA device named {name:?} (found: {found})")]
    DeviceNotFound { name: String, found: String },
    /// The device is there but cannot be used as configured.
    #[error("RDMA device {device}: {detail}")]
    Device { device: String, detail: String },
    #[error("cannot start the completion poller thread: {0}")]
    Poller(String),
}

/// One-sided writes over RDMA: a receiver's exposed buffer and each sender's staging pool are
/// memory regions of one device; each (sender, receiver) pair gets its own reliable-connected
/// queue pair, connected through the side channel at the exposed endpoint; each write is an
/// RDMA WRITE (with immediate when the caller gives one, which the receiver turns into a
/// `Landed` notice).
///
/// Clones share the device (one protection domain, one completion queue and its poller
/// thread); every exposed buffer and every connection is independent.
#[derive(Debug)]
pub struct RdmaFabric<V: Verbs> {
    device: Arc<Device<V>>,
}

impl<V: Verbs> Clone for RdmaFabric<V> {
    fn clone(&self) -> Self {
        RdmaFabric {
            device: self.device.clone(),
        }
    }
}

impl<V: Verbs> RdmaFabric<V> {
    /// A fabric over an opened device (`ibv::IbvVerbs::open`, or a model in tests); starts its
    /// completion poller.
    pub fn with_verbs(verbs: V, config: RdmaConfig) -> Result<Self, RdmaError> {
        let device = Device::start(verbs, config).map_err(|e| RdmaError::Poller(e.to_string()))?;
        Ok(RdmaFabric { device })
    }

    /// `with_verbs`, the poller's idle waits given (tests: long ones, to see a post wake it).
    #[cfg(test)]
    pub(crate) fn with_verbs_idling(
        verbs: V,
        config: RdmaConfig,
        idle: crate::wake::IdleWait,
    ) -> Result<Self, RdmaError> {
        let device = Device::start_idling(verbs, config, idle)
            .map_err(|e| RdmaError::Poller(e.to_string()))?;
        Ok(RdmaFabric { device })
    }

    pub fn config(&self) -> &RdmaConfig {
        &self.device.config
    }

    pub fn verbs(&self) -> &V {
        &self.device.verbs
    }

    fn registered(
        &self,
        geometry: SlotGeometry,
        access: RemoteAccess,
    ) -> Result<Arc<RdmaMemory>, FabricError> {
        let SlotGeometry { slots, slot_bytes } = within_one_write(geometry)?;
        let memory = RdmaMemory::anonymous(geometry).map_err(|e| {
            FabricError::Allocation(format!("{slots} x {slot_bytes} B of memory: {e}"))
        })?;
        self.register(memory, access)
    }

    /// Refuses a staging the device's send queue cannot hold a write from each slot of.
    fn staging_fits(&self, slots: u32) -> Result<(), FabricError> {
        self.device
            .verbs
            .limits()
            .check_staging(slots)
            .map_err(FabricError::Allocation)
    }

    /// The caller's region, registered with the device.
    fn registered_external(
        &self,
        region: ExternalRegion,
        access: RemoteAccess,
    ) -> Result<Arc<RdmaMemory>, FabricError> {
        checked_geometry(region.slots(), region.slot_bytes())?;
        // One registration covers one range. Parts end to end in memory (per-layer views of
        // one allocation, as kvx's vLLM connector lends its host buffer) are one range
        // already (`ExternalRegion::join`); separate allocations would need a registration
        // and remote addresses per part, which one range costs none of.
        if region.parts() > 1 {
            return Err(FabricError::Allocation(format!(
                "a region in {} separate parts cannot be registered over RDMA: lend one \
                 contiguous region (parts that are views of one allocation, in order, are one)",
                region.parts()
            )));
        }
        self.register(RdmaMemory::external(region), access)
    }

    /// Staging is registered for local access only (the NIC reads it for its own writes), a
    /// buffer for peers' writes too.
    /// Refuses new work on a device an event declared unusable.
    fn usable(&self) -> Result<(), FabricError> {
        match self.device.unusable() {
            Some(why) => Err(FabricError::Io(format!(
                "the RDMA device is unusable: {why}"
            ))),
            None => Ok(()),
        }
    }

    fn register(
        &self,
        memory: RdmaMemory,
        access: RemoteAccess,
    ) -> Result<Arc<RdmaMemory>, FabricError> {
        self.usable()?;
        self.device
            .verbs
            .limits()
            .check_memory(memory.slots(), memory.slot_bytes())
            .map_err(FabricError::Allocation)?;
        let memory = Arc::new(memory);
        crate::blocking::off_the_runtime(|| self.device.verbs.register(&memory, access)).map_err(
            |e| {
                FabricError::Allocation(format!(
                    "registering {} x {} B: {e}",
                    memory.slots(),
                    memory.slot_bytes()
                ))
            },
        )?;
        Ok(memory)
    }

    /// Accepts writes into the registered `memory` at `endpoint`.
    async fn expose_memory(
        &self,
        endpoint: &str,
        memory: Arc<RdmaMemory>,
    ) -> Result<FabricListener<RdmaMemory>, FabricError> {
        let (slots, slot_bytes) = (memory.slots(), memory.slot_bytes());
        let listener = link::bind(endpoint).await?;
        let local_endpoint = link::local_endpoint(&listener, endpoint)?;
        let (landed_tx, landed) = kvx_io::landing_channel(slots);
        let access = Arc::new(kvx_io::FabricAccess::with_random_key(slots)?);
        tokio::spawn(receiver::accept_loop(
            listener,
            self.device.clone(),
            memory.clone(),
            landed_tx,
            access.clone(),
        ));
        tracing::debug!(%local_endpoint, slots, slot_bytes, "rdma buffer exposed");
        Ok(FabricListener {
            local_endpoint,
            memory,
            landed,
            access,
            // The NIC writes first; the access rules are checked before a write is announced.
            revocation_stops_writes: false,
        })
    }
}

impl<V: Verbs> Fabric for RdmaFabric<V> {
    type Memory = RdmaMemory;

    fn allocate_staging(&self, geometry: SlotGeometry) -> Result<Arc<RdmaMemory>, FabricError> {
        self.staging_fits(geometry.slots)?;
        self.registered(geometry, RemoteAccess::None)
    }

    /// Staging in the caller's region, registered with the device (GPU memory where the
    /// NIC can reach it: docs/operations.md).
    fn staging_in(&self, region: ExternalRegion) -> Result<Arc<RdmaMemory>, FabricError> {
        self.staging_fits(region.slots())?;
        self.registered_external(region, RemoteAccess::None)
    }

    async fn expose(
        &self,
        endpoint: &str,
        geometry: SlotGeometry,
    ) -> Result<FabricListener<RdmaMemory>, FabricError> {
        let memory = self.registered(geometry, RemoteAccess::Write)?;
        self.expose_memory(endpoint, memory).await
    }

    async fn expose_in(
        &self,
        endpoint: &str,
        region: ExternalRegion,
    ) -> Result<FabricListener<RdmaMemory>, FabricError> {
        let memory = self.registered_external(region, RemoteAccess::Write)?;
        self.expose_memory(endpoint, memory).await
    }

    async fn connect(
        &self,
        endpoint: &str,
        staging: Arc<RdmaMemory>,
        credential: kvx_io::FabricCredential,
    ) -> Result<FabricConn, FabricError> {
        self.usable()?;
        sender::connect(self.device.clone(), endpoint, staging, credential).await
    }
}
