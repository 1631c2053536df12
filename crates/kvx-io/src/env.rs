//! `Env`: what a driver needs from the world — a transport, a fabric, a clock and `spawn` —
//! in one type parameter, so drivers are `SenderNode<E: Env>` and monomorphised for each
//! environment (production's, the simulation's), with no `dyn` on the data path.

use std::future::Future;

use crate::fabric::Fabric;
use crate::transport::Transport;

/// Everything a driver touches outside its state machine. Clones share the same transport,
/// fabric and epoch.
pub trait Env: Clone + Send + Sync + 'static {
    /// The control plane.
    type Transport: Transport;
    /// The data plane.
    type Fabric: Fabric;

    /// The transport drivers bind and connect with.
    fn transport(&self) -> &Self::Transport;
    /// The fabric drivers expose buffers and write with.
    fn fabric(&self) -> &Self::Fabric;
    /// Now, as the core counts time: since this environment's epoch. Never goes back (the
    /// state machines rely on it).
    fn now(&self) -> kvx_proto::Instant;
    /// Sleeps until the core instant `at` (returns at once if it has passed).
    fn sleep_until(&self, at: kvx_proto::Instant) -> impl Future<Output = ()> + Send;
    /// Runs `fut` as a task of its own, detached: drivers run their loops this way.
    fn spawn<F>(&self, fut: F)
    where
        F: Future<Output = ()> + Send + 'static;
}

/// The environment on tokio's clock and executor: real time in production, and virtual time
/// under madsim (the workspace's `tokio` is madsim-tokio).
#[derive(Debug, Clone)]
pub struct TokioEnv<T, F> {
    transport: T,
    fabric: F,
    epoch: tokio::time::Instant,
}

impl<T: Transport, F: Fabric> TokioEnv<T, F> {
    /// An environment whose epoch is now. `spawn` needs a tokio runtime (it calls
    /// `tokio::spawn`).
    pub fn new(transport: T, fabric: F) -> Self {
        Self {
            transport,
            fabric,
            epoch: tokio::time::Instant::now(),
        }
    }
}

impl<T: Transport, F: Fabric> Env for TokioEnv<T, F> {
    type Transport = T;
    type Fabric = F;

    fn transport(&self) -> &T {
        &self.transport
    }

    fn fabric(&self) -> &F {
        &self.fabric
    }

    fn now(&self) -> kvx_proto::Instant {
        kvx_proto::Instant::from_duration(self.epoch.elapsed())
    }

    fn sleep_until(&self, at: kvx_proto::Instant) -> impl Future<Output = ()> + Send {
        tokio::time::sleep_until(self.epoch + at.since_epoch())
    }

    fn spawn<Fut>(&self, fut: Fut)
    where
        Fut: Future<Output = ()> + Send + 'static,
    {
        tokio::spawn(fut);
    }
}
