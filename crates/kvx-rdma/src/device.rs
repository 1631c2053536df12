//! An opened device shared by a fabric's connections, and its completion poller: a dedicated
//! thread that polls the device's one completion queue and hands each work completion to its
//! connection's channel (`route`), from which the connection's async task takes it.
//!
//! The poller takes completions as long as there are any; finding none, it waits as `wake`
//! says (spinning while a post is recent, else parking, and a post unparks it). It holds the
//! device only weakly and ends once the fabric and every connection have let go of it.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::config::RdmaConfig;
use crate::route::Router;
use crate::verbs::{Verbs, Wc};
use crate::wake::{IdleWait, PollerWake};

/// Room for a poll's completions, reused.
const POLL_BATCH: usize = 64;

#[derive(Debug)]
pub(crate) struct Device<V: Verbs> {
    pub verbs: V,
    pub router: Arc<Router>,
    pub config: RdmaConfig,
}

impl<V: Verbs> Device<V> {
    /// Wraps an opened device and starts its poller.
    pub(crate) fn start(verbs: V, config: RdmaConfig) -> std::io::Result<Arc<Self>> {
        Self::start_idling(verbs, config, IdleWait::default())
    }

    /// `start`, with the poller's idle waits given (tests make them long, to see that a post
    /// wakes it).
    pub(crate) fn start_idling(
        verbs: V,
        config: RdmaConfig,
        idle: IdleWait,
    ) -> std::io::Result<Arc<Self>> {
        let device = Arc::new(Device {
            verbs,
            router: Arc::new(Router::with_wake(PollerWake::new(idle))),
            config,
        });
        let weak = Arc::downgrade(&device);
        std::thread::Builder::new()
            .name("kvx-rdma-cq".into())
            .spawn(move || poll_loop(weak))?;
        Ok(device)
    }
}

fn poll_loop<V: Verbs>(device: Weak<Device<V>>) {
    let mut batch: Vec<Wc> = Vec::with_capacity(POLL_BATCH);
    let mut last_completion = Instant::now();
    let mut failures: u64 = 0;
    if let Some(dev) = device.upgrade() {
        dev.router.wake.register_poller();
    }
    loop {
        let Some(dev) = device.upgrade() else {
            return;
        };
        batch.clear();
        if let Err(e) = dev.verbs.poll(&mut batch, POLL_BATCH) {
            failures += 1;
            // A poll error means a broken completion queue; say so, but not in a tight loop.
            if failures.is_power_of_two() {
                tracing::error!(error = %e, failures, "polling the completion queue failed");
            }
            drop(dev);
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        if !batch.is_empty() {
            dev.router.dispatch(&batch);
            last_completion = Instant::now();
            continue;
        }
        let router = dev.router.clone();
        drop(dev);
        router.wake.wait(last_completion.elapsed());
    }
}

/// Runs a verbs call that can block for long — `ibv_reg_mr` pins the whole buffer, bringing
/// a queue pair to RTR resolves the peer's address on RoCE, `ibv_destroy_qp` waits for the
/// device — without holding up the async runtime: on a worker of a multi-threaded runtime
/// through `block_in_place` (the worker's other tasks move to another thread meanwhile),
/// elsewhere (a plain thread, a blocking-pool thread, a current-thread runtime) as it is.
pub(crate) fn off_the_runtime<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}
