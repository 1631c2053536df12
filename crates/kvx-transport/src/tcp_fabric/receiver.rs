//! The receiving side, shared by both fabrics: an accept loop per exposed buffer and a task
//! per sender connection (`receiver_conn.rs` once it has authenticated) that reads write
//! headers, lands payloads (`Landing::Inline`: read from the socket straight into the slot;
//! `Landing::Pulled`: copied out of the sender's staging, mapped read-only), announces them,
//! and acks each write after its bytes are in memory.
//!
//! A connection task is the only thing that applies its sender's writes, so once it has
//! ended (end of stream, an error, a protocol violation, the listener dropped, or aborted by
//! a fence), nothing from that connection lands any more. A fence is a sender's request, over
//! a fresh connection, to abort one of its earlier connections and confirm once it has ended;
//! only the peer that owns a connection may fence it.
//!
//! Every connection authenticates as a control peer in its hello (`FabricAccess`), and every
//! write is checked against that peer's grants before a byte of it touches the slot: a write
//! outside them is read past (at most one slot's worth), acked as refused, counted, and
//! never announced. Every piece of an admitted write's bytes goes into the slot through
//! `FabricAccess::land`, so once its grant is revoked the rest of the write is read past
//! (acked as refused), never into a slot that may hold another sender's chunk by then. A
//! write's checksum is computed over its bytes as they arrive and compared once the last one
//! is in.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kvx_io::LandedWrite;
use kvx_proto::PeerId;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use super::link::{accept_handshake, answer_fence, tune, Accept, Greeted, LinkConfig};
use super::receiver_conn::Conn;
pub(crate) use super::receiver_conn::{Landing, PullSource, Rules, Source};
use super::wire::WelcomeStatus;

/// What the accept loop needs to greet senders.
#[derive(Clone)]
pub(crate) struct Greeting {
    pub magic: [u8; 4],
    /// Trailing bytes of the `Welcome` (none today).
    pub extra: Arc<[u8]>,
    pub config: LinkConfig,
    /// Makes the `Source` of an attaching sender, or refuses it.
    pub accept: Arc<Accept<Source>>,
}

impl std::fmt::Debug for Greeting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Greeting")
            .field("magic", &self.magic)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The connection tasks of one exposed buffer, by connection id, with the peer each one
/// authenticated as, for fences.
type Registry = Arc<Mutex<HashMap<u64, (Option<PeerId>, JoinHandle<()>)>>>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poison| poison.into_inner())
}

/// Accepts senders until the listener's owner drops its `landed` receiver. Every connection
/// takes a place in the buffer's `ConnectionBudget` (`connections_max` in all,
/// `connections_per_source_max` from one address): past a cap a newcomer is still taken and
/// the quietest connection is closed for it (never greeted first, then unauthenticated, then
/// the authenticated one whose last write landed longest ago), so a flood of idle sockets
/// can neither lock a sender out nor close one that is writing. An evicted connection's task
/// ends as a fenced one does (at its next await), so nothing of it lands afterwards.
pub(crate) async fn accept_loop(
    listener: TcpListener,
    landing: Landing,
    landed: mpsc::Sender<LandedWrite>,
    greeting: Greeting,
    rules: Rules,
) {
    let registry: Registry = Arc::default();
    let budget = kvx_io::ConnectionBudget::new(
        greeting.config.connections_max,
        greeting.config.connections_per_source_max,
    );
    // Ids start at a random base: a receiver restarted at the same address must not take a
    // fence meant for its previous incarnation's connection as one for a live connection.
    let mut next_conn = random_u64();
    loop {
        let accepted = tokio::select! {
            biased;
            () = landed.closed() => break,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, peer)) => {
                lock(&registry).retain(|_, (_, t)| !t.is_finished());
                let (held, kvx_io::Evicted(evicted)) = budget.open(peer.ip());
                if evicted > 0 {
                    if let Some(left_out) = rules.refusals_logged.allow() {
                        warn!(
                            %peer, evicted, left_out,
                            "fabric connection closed for a newcomer: the buffer holds \
                             connections_max connections (or connections_per_source_max from \
                             one address), and it was the quietest"
                        );
                    }
                }
                // 0 is what an attaching hello carries; never an id.
                if next_conn == 0 {
                    next_conn = 1;
                }
                let conn = next_conn;
                next_conn = next_conn.wrapping_add(1);
                let landing = landing.clone();
                let landed = landed.clone();
                let greeting = greeting.clone();
                let reg = registry.clone();
                let rules = rules.clone();
                let held = Arc::new(held);
                let task = tokio::spawn(async move {
                    let addr = peer.to_string();
                    let logged = rules.refusals_logged.clone();
                    let serving =
                        serve_sender(stream, landing, landed, &greeting, conn, reg, rules, &held);
                    match held.run(serving).await {
                        Some(Ok(())) => debug!(%addr, conn, "fabric sender left"),
                        Some(Err(why)) => {
                            if let Some(left_out) = logged.allow() {
                                warn!(%addr, conn, %why, left_out, "fabric sender dropped");
                            }
                        }
                        None => debug!(%addr, conn, "fabric connection closed for a newcomer"),
                    }
                });
                // No await between spawn and insert: a fence naming `conn` is accepted by this
                // loop, so it always finds the entry (or the task already ended).
                lock(&registry).insert(conn, (None, task));
            }
            Err(e) => {
                // Out of descriptors or similar: wait instead of spinning on the error.
                warn!(error = %e, "fabric accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    debug!("fabric listener dropped; no more senders accepted");
}

/// 64 random bits from the OS-seeded keys std gives every `RandomState`.
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

#[allow(clippy::too_many_arguments)]
async fn serve_sender(
    mut stream: TcpStream,
    landing: Landing,
    landed: mpsc::Sender<LandedWrite>,
    greeting: &Greeting,
    conn: u64,
    registry: Registry,
    rules: Rules,
    held: &Arc<kvx_io::Held>,
) -> Result<(), String> {
    tune(&stream).map_err(|e| e.to_string())?;
    let ours = landing.geometry();
    let greeted = accept_handshake(
        &mut stream,
        greeting.magic,
        ours,
        &greeting.extra,
        conn,
        &rules.access,
        &*greeting.accept,
        &greeting.config,
    )
    .await?;
    let (peer, source) = match greeted {
        Greeted::Attached(peer, source) => {
            // A valid credential came: no newcomer closes this connection from now on; past
            // the caps it is what closes the quietest authenticated one.
            let kvx_io::Evicted(evicted) = held.authenticated();
            if evicted > 0 {
                debug!(conn, %peer, evicted, "fabric connection closed for an attaching sender");
            }
            (peer, source)
        }
        Greeted::Fence(target, asker) => {
            // A fence lives for one answer: heard, but it closes no attached sender.
            held.heard();
            let status = fence(&registry, target, asker, greeting.config.fence_timeout).await;
            debug!(conn, target, %asker, ?status, "fabric fence");
            return answer_fence(&mut stream, greeting.magic, target, status)
                .await
                .map_err(|e| e.to_string());
        }
    };
    if let Some((owner, _)) = lock(&registry).get_mut(&conn) {
        *owner = Some(peer);
    }
    Conn::new(stream, landing, landed, peer, source, rules, held.clone())
        .run()
        .await
}

/// Stops connection `target` on behalf of `asker`, which must own it. A connection that never
/// existed or already ended applies nothing: that is confirmed at once.
async fn fence(
    registry: &Registry,
    target: u64,
    asker: PeerId,
    fence_timeout: Duration,
) -> WelcomeStatus {
    let task = {
        let mut reg = lock(registry);
        match reg.get(&target) {
            Some((owner, _)) if *owner != Some(asker) => return WelcomeStatus::Unauthorized,
            Some(_) => reg.remove(&target).map(|(_, task)| task),
            None => None,
        }
    };
    let Some(task) = task else {
        return WelcomeStatus::Ok;
    };
    // Abort takes effect at the task's next await; it never stops mid-syscall, and once the
    // handle resolves its future is gone.
    task.abort();
    match tokio::time::timeout(fence_timeout, task).await {
        Ok(_) => WelcomeStatus::Ok,
        Err(_) => WelcomeStatus::FenceTimeout,
    }
}
