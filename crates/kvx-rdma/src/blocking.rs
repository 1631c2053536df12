//! `off_the_runtime`: where every verbs call that can block for long runs — registering and
//! deregistering memory, creating, moving and destroying a queue pair — so that none holds up
//! a tokio worker. A leaf: `verbs` (`Qp`), `memory` and the connection tasks all use it.

/// Runs a verbs call that can block for long — `ibv_reg_mr` pins the whole buffer and
/// `ibv_dereg_mr` unpins it, every `ibv_modify_qp` is a firmware command (bringing a queue pair
/// to RTR also resolves the peer's address on RoCE), `ibv_destroy_qp` waits for the device —
/// without holding up the async runtime: on a worker of a multi-threaded runtime
/// through `block_in_place` (the worker's other tasks move to another thread meanwhile),
/// elsewhere (a plain thread, a blocking-pool thread, a current-thread runtime) as it is.
pub(crate) fn off_the_runtime<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}
