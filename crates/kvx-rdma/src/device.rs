//! An opened device shared by a fabric's connections, and its two threads: the completion
//! poller, which polls the device's one completion queue and hands each work completion to its
//! connection's channel (`route`), from which the connection's async task takes it; and the
//! event reader, which takes the device's asynchronous events (`ibv_get_async_event`), logs
//! each, breaks the connection of a queue pair that failed fatally, and on a completion queue
//! or device failure breaks every connection and marks the device unusable, so that no new
//! connection or buffer lands on it.
//!
//! The poller takes completions as long as there are any; finding none, it waits as `wake`
//! says (spinning while a post is recent, else parking, and a post unparks it). It holds the
//! device only weakly and ends once the fabric and every connection have let go of it.

use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::config::RdmaConfig;
use crate::route::Router;
use crate::verbs::{DeviceEvent, EventWait, Verbs, Wc};
use crate::wake::{IdleWait, PollerWake};

/// Room for a poll's completions, reused.
const POLL_BATCH: usize = 64;

/// How long the event reader waits for an event before it checks the device is still used.
const EVENT_WAIT: Duration = Duration::from_millis(100);

#[derive(Debug)]
pub(crate) struct Device<V: Verbs> {
    pub verbs: V,
    pub router: Arc<Router>,
    pub config: RdmaConfig,
    /// Why the device can no longer be used, once an event said so.
    unusable: OnceLock<String>,
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
            unusable: OnceLock::new(),
        });
        let weak = Arc::downgrade(&device);
        std::thread::Builder::new()
            .name("kvx-rdma-cq".into())
            .spawn(move || poll_loop(weak))?;
        let weak = Arc::downgrade(&device);
        std::thread::Builder::new()
            .name("kvx-rdma-events".into())
            .spawn(move || event_loop(weak))?;
        Ok(device)
    }

    /// Why the device cannot be used any more, if an event said so.
    pub(crate) fn unusable(&self) -> Option<&str> {
        self.unusable.get().map(String::as_str)
    }

    /// Acts on one asynchronous event of the device.
    pub(crate) fn on_event(&self, event: DeviceEvent) {
        if let Some(why) = event.fatal_to_the_device() {
            self.fail(why);
            return;
        }
        if let Some((qpn, name)) = event.broken_qp() {
            let why = format!("queue pair {qpn} failed ({name})");
            let known = self.router.break_qp(qpn, &why);
            tracing::error!(qpn, known, event = name, "rdma queue pair failed");
            return;
        }
        match event {
            DeviceEvent::PortError { port } => {
                tracing::error!(port, "rdma port down: writes fail until it is back")
            }
            DeviceEvent::PortActive { port } => tracing::info!(port, "rdma port active"),
            DeviceEvent::GidChange { port }
            | DeviceEvent::LidChange { port }
            | DeviceEvent::SmChange { port } => match self.verbs.refresh_port() {
                Ok(now) => tracing::warn!(
                    port, event = ?event, lid = now.lid, gid = ?now.gid,
                    "rdma port address changed: new connections advertise it; connected \
                     queue pairs keep their path"
                ),
                Err(e) => tracing::warn!(
                    port, event = ?event, error = %e,
                    "rdma port address changed and could not be read again: new connections \
                     advertise the old one"
                ),
            },
            other => tracing::info!(event = ?other, "rdma device event"),
        }
    }

    /// The device failed: every connection is broken, and no new connection, buffer or
    /// staging is taken on it (receivers refuse new senders saying `why`).
    fn fail(&self, why: &str) {
        tracing::error!(why, "rdma device failed: every connection is broken");
        let _ = self.unusable.set(why.to_owned());
        self.router.break_all(why);
    }
}

fn event_loop<V: Verbs>(device: Weak<Device<V>>) {
    loop {
        let Some(dev) = device.upgrade() else {
            return;
        };
        match dev.verbs.next_event(EVENT_WAIT) {
            EventWait::Event(event) => dev.on_event(event),
            EventWait::Quiet => {}
            EventWait::Gone(why) => {
                // Removed or reset: its event channel answers at once from now on, so
                // waiting on it again would spin. The device is done; so is this thread.
                dev.fail(&why);
                return;
            }
        }
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
