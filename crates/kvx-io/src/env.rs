//! `Env`: what a driver needs from the world — a transport, a fabric, a clock and `spawn` —
//! in one type parameter, so drivers are `SenderNode<E: Env>` and monomorphised for each
//! environment (production's, the simulation's), with no `dyn` on the data path.

use std::future::Future;

use crate::fabric::Fabric;
use crate::transport::Transport;

pub trait Env: Clone + Send + Sync + 'static {
    type Transport: Transport;
    type Fabric: Fabric;

    fn transport(&self) -> &Self::Transport;
    fn fabric(&self) -> &Self::Fabric;
    /// Now, as the core counts time: since this environment's epoch.
    fn now(&self) -> kvx_proto::Instant;
    /// Sleeps until the core instant `at` (returns at once if it has passed).
    fn sleep_until(&self, at: kvx_proto::Instant) -> impl Future<Output = ()> + Send;
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
