//! Transport and fabric as trait objects: `AnyTransport`, `AnyFabric` (over `AnyMemory`) and
//! `AnyEnv`, the environment a program that picks its transport and fabric at run time (the
//! `kvx` binary, the Python package) runs every driver on. As quinn's `Runtime`, the choice
//! is made once and crosses the IO edge as an object: `SenderNode<AnyEnv>` is one type
//! whatever was chosen, so a program needs no visitor over the choices and no second,
//! type-erased copy of each client call.
//!
//! The cost stays off the data path. What goes through a vtable here is setup (bind,
//! connect, expose, allocate) and a slot access (`SlotMemory`, one call per chunk staged or
//! read, which was already a `&dyn SlotMemory` call in the leases); writes are posted on
//! `FabricConn`, which is concrete, and control messages travel on the transports' own
//! channel-backed handles. The simulation and the tests of each fabric keep their concrete
//! `Env`s: they are generic, and lose nothing by it.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::access::FabricCredential;
use crate::env::TokioEnv;
use crate::fabric::{Fabric, FabricConn, FabricError, FabricListener, SlotMemory};
use crate::geometry::SlotGeometry;
use crate::region::ExternalRegion;
use crate::transport::{
    ControlClient, ControlServer, NotifySink, NotifySource, Transport, TransportError,
};

// The `impl Trait` futures own what they borrow (an `Arc` of the object, the endpoint), so
// that they outlive the call as the traits allow: setup only, where a copy costs nothing.
type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The environment of a run-time choice: tokio's clock and executor, any transport, any
/// fabric.
pub type AnyEnv = TokioEnv<AnyTransport, AnyFabric>;

impl AnyEnv {
    /// `transport` and `fabric` as objects, on tokio's clock (its epoch is now).
    pub fn of<T: Transport, F: Fabric>(transport: T, fabric: F) -> Self {
        TokioEnv::new(AnyTransport::new(transport), AnyFabric::new(fabric))
    }
}

/// `Transport` in a form that can be a trait object (its futures boxed).
trait ObjectTransport: Send + Sync + 'static {
    fn serve<'a>(
        &'a self,
        endpoint: &'a str,
    ) -> BoxFuture<'a, Result<ControlServer, TransportError>>;
    fn connect<'a>(
        &'a self,
        endpoint: &'a str,
        identity: &'a str,
    ) -> BoxFuture<'a, Result<ControlClient, TransportError>>;
    fn notify_sink<'a>(
        &'a self,
        endpoint: &'a str,
    ) -> BoxFuture<'a, Result<NotifySink, TransportError>>;
    fn notify_source<'a>(
        &'a self,
        endpoint: &'a str,
    ) -> BoxFuture<'a, Result<NotifySource, TransportError>>;
    fn name(&self) -> &'static str;
}

impl<T: Transport> ObjectTransport for T {
    fn serve<'a>(
        &'a self,
        endpoint: &'a str,
    ) -> BoxFuture<'a, Result<ControlServer, TransportError>> {
        Box::pin(Transport::serve(self, endpoint))
    }
    fn connect<'a>(
        &'a self,
        endpoint: &'a str,
        identity: &'a str,
    ) -> BoxFuture<'a, Result<ControlClient, TransportError>> {
        Box::pin(Transport::connect(self, endpoint, identity))
    }
    fn notify_sink<'a>(
        &'a self,
        endpoint: &'a str,
    ) -> BoxFuture<'a, Result<NotifySink, TransportError>> {
        Box::pin(Transport::notify_sink(self, endpoint))
    }
    fn notify_source<'a>(
        &'a self,
        endpoint: &'a str,
    ) -> BoxFuture<'a, Result<NotifySource, TransportError>> {
        Box::pin(Transport::notify_source(self, endpoint))
    }
    fn name(&self) -> &'static str {
        std::any::type_name::<T>()
    }
}

/// Any transport, as one type. Clones share it.
#[derive(Clone)]
pub struct AnyTransport(Arc<dyn ObjectTransport>);

impl AnyTransport {
    /// `transport` as an object.
    pub fn new<T: Transport>(transport: T) -> Self {
        Self(Arc::new(transport))
    }
}

impl fmt::Debug for AnyTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("AnyTransport").field(&self.0.name()).finish()
    }
}

impl Transport for AnyTransport {
    fn serve(
        &self,
        endpoint: &str,
    ) -> impl Future<Output = Result<ControlServer, TransportError>> + Send {
        let (this, endpoint) = (self.0.clone(), endpoint.to_owned());
        async move { this.serve(&endpoint).await }
    }
    fn connect(
        &self,
        endpoint: &str,
        identity: &str,
    ) -> impl Future<Output = Result<ControlClient, TransportError>> + Send {
        let (this, endpoint, identity) = (self.0.clone(), endpoint.to_owned(), identity.to_owned());
        async move { this.connect(&endpoint, &identity).await }
    }
    fn notify_sink(
        &self,
        endpoint: &str,
    ) -> impl Future<Output = Result<NotifySink, TransportError>> + Send {
        let (this, endpoint) = (self.0.clone(), endpoint.to_owned());
        async move { this.notify_sink(&endpoint).await }
    }
    fn notify_source(
        &self,
        endpoint: &str,
    ) -> impl Future<Output = Result<NotifySource, TransportError>> + Send {
        let (this, endpoint) = (self.0.clone(), endpoint.to_owned());
        async move { this.notify_source(&endpoint).await }
    }
}

/// Memory of any fabric: its slots through `SlotMemory`, and the concrete memory kept for
/// the fabric that made it (`AnyFabric::connect` hands it back to that fabric).
pub struct AnyMemory {
    slots: Arc<dyn SlotMemory>,
    concrete: Arc<dyn Any + Send + Sync>,
}

impl AnyMemory {
    fn new<M: SlotMemory>(memory: Arc<M>) -> Self {
        Self {
            slots: memory.clone(),
            concrete: memory,
        }
    }
}

impl fmt::Debug for AnyMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.slots.fmt(f)
    }
}

// Every method is forwarded, the defaulted ones too, so that a memory's own (faster) forms
// of them are kept.
impl SlotMemory for AnyMemory {
    fn slots(&self) -> u32 {
        self.slots.slots()
    }
    fn slot_bytes(&self) -> usize {
        self.slots.slot_bytes()
    }
    fn geometry(&self) -> SlotGeometry {
        self.slots.geometry()
    }
    fn with_slot(&self, slot: u32, f: &mut dyn FnMut(&mut [u8])) {
        self.slots.with_slot(slot, f);
    }
    fn write_slot(&self, slot: u32, data: &[u8]) {
        self.slots.write_slot(slot, data);
    }
    fn read_slot(&self, slot: u32, out: &mut [u8]) {
        self.slots.read_slot(slot, out);
    }
    fn fill_slot(&self, slot: u32, len: usize, f: &mut dyn FnMut(&mut [u8])) {
        self.slots.fill_slot(slot, len, f);
    }
    fn viewable(&self) -> Option<(std::ptr::NonNull<u8>, usize)> {
        self.slots.viewable()
    }
    fn inspect_slot(&self, slot: u32, len: usize, f: &mut dyn FnMut(&[u8])) {
        self.slots.inspect_slot(slot, len, f);
    }
}

type Listening<'a> = BoxFuture<'a, Result<FabricListener<AnyMemory>, FabricError>>;

/// `Fabric` in a form that can be a trait object (its futures boxed, its memory `AnyMemory`).
trait ObjectFabric: Send + Sync + 'static {
    fn allocate_staging(&self, geometry: SlotGeometry) -> Result<AnyMemory, FabricError>;
    fn staging_in(&self, region: ExternalRegion) -> Result<AnyMemory, FabricError>;
    fn expose_in<'a>(&'a self, endpoint: &'a str, region: ExternalRegion) -> Listening<'a>;
    fn expose<'a>(&'a self, endpoint: &'a str, geometry: SlotGeometry) -> Listening<'a>;
    fn connect<'a>(
        &'a self,
        endpoint: &'a str,
        staging: &AnyMemory,
        credential: FabricCredential,
    ) -> BoxFuture<'a, Result<FabricConn, FabricError>>;
    fn name(&self) -> &'static str;
}

/// A concrete listener's memory made `AnyMemory`.
fn any_listener<M: SlotMemory>(listener: FabricListener<M>) -> FabricListener<AnyMemory> {
    let FabricListener {
        local_endpoint,
        memory,
        landed,
        access,
        revocation_stops_writes,
    } = listener;
    FabricListener {
        local_endpoint,
        memory: Arc::new(AnyMemory::new(memory)),
        landed,
        access,
        revocation_stops_writes,
    }
}

impl<F: Fabric> ObjectFabric for F {
    fn allocate_staging(&self, geometry: SlotGeometry) -> Result<AnyMemory, FabricError> {
        Fabric::allocate_staging(self, geometry).map(AnyMemory::new)
    }
    fn staging_in(&self, region: ExternalRegion) -> Result<AnyMemory, FabricError> {
        Fabric::staging_in(self, region).map(AnyMemory::new)
    }
    fn expose_in<'a>(&'a self, endpoint: &'a str, region: ExternalRegion) -> Listening<'a> {
        Box::pin(async move {
            Fabric::expose_in(self, endpoint, region)
                .await
                .map(any_listener)
        })
    }
    fn expose<'a>(&'a self, endpoint: &'a str, geometry: SlotGeometry) -> Listening<'a> {
        Box::pin(async move {
            Fabric::expose(self, endpoint, geometry)
                .await
                .map(any_listener)
        })
    }
    fn connect<'a>(
        &'a self,
        endpoint: &'a str,
        staging: &AnyMemory,
        credential: FabricCredential,
    ) -> BoxFuture<'a, Result<FabricConn, FabricError>> {
        let staging = staging.concrete.clone().downcast::<F::Memory>();
        Box::pin(async move {
            let staging = staging.map_err(|_| FabricError::Incompatible {
                endpoint: endpoint.to_owned(),
                why: format!(
                    "the staging was not made by this fabric ({})",
                    std::any::type_name::<F>()
                ),
            })?;
            Fabric::connect(self, endpoint, staging, credential).await
        })
    }
    fn name(&self) -> &'static str {
        std::any::type_name::<F>()
    }
}

/// Any fabric, as one type. Clones share it.
#[derive(Clone)]
pub struct AnyFabric(Arc<dyn ObjectFabric>);

impl AnyFabric {
    /// `fabric` as an object.
    pub fn new<F: Fabric>(fabric: F) -> Self {
        Self(Arc::new(fabric))
    }
}

impl fmt::Debug for AnyFabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("AnyFabric").field(&self.0.name()).finish()
    }
}

impl Fabric for AnyFabric {
    type Memory = AnyMemory;

    fn allocate_staging(&self, geometry: SlotGeometry) -> Result<Arc<AnyMemory>, FabricError> {
        self.0.allocate_staging(geometry).map(Arc::new)
    }
    fn staging_in(&self, region: ExternalRegion) -> Result<Arc<AnyMemory>, FabricError> {
        self.0.staging_in(region).map(Arc::new)
    }
    fn expose_in(
        &self,
        endpoint: &str,
        region: ExternalRegion,
    ) -> impl Future<Output = Result<FabricListener<AnyMemory>, FabricError>> + Send {
        let (this, endpoint) = (self.0.clone(), endpoint.to_owned());
        async move { this.expose_in(&endpoint, region).await }
    }
    fn expose(
        &self,
        endpoint: &str,
        geometry: SlotGeometry,
    ) -> impl Future<Output = Result<FabricListener<AnyMemory>, FabricError>> + Send {
        let (this, endpoint) = (self.0.clone(), endpoint.to_owned());
        async move { this.expose(&endpoint, geometry).await }
    }
    fn connect(
        &self,
        endpoint: &str,
        staging: Arc<AnyMemory>,
        credential: FabricCredential,
    ) -> impl Future<Output = Result<FabricConn, FabricError>> + Send {
        let (this, endpoint) = (self.0.clone(), endpoint.to_owned());
        async move { this.connect(&endpoint, &staging, credential).await }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::MemFabric;

    #[tokio::test]
    async fn staging_of_another_fabric_is_refused_by_name() {
        struct Other;
        impl fmt::Debug for Other {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("Other")
            }
        }
        impl SlotMemory for Other {
            fn slots(&self) -> u32 {
                1
            }
            fn slot_bytes(&self) -> usize {
                1
            }
            fn with_slot(&self, _: u32, f: &mut dyn FnMut(&mut [u8])) {
                f(&mut [0]);
            }
        }
        let fabric = AnyFabric::new(MemFabric::new());
        let staging = Arc::new(AnyMemory::new(Arc::new(Other)));
        let credential = FabricCredential::from_bytes(&[0; FabricCredential::LEN]);
        let got = Fabric::connect(&fabric, "nowhere", staging, credential).await;
        match got {
            Err(FabricError::Incompatible { why, .. }) => {
                assert!(why.contains("MemFabric"), "names the fabric: {why}")
            }
            other => panic!("refused as incompatible, got {other:?}"),
        }
    }
}
