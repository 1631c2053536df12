//! kvx-transport: the production implementations of `kvx_io`'s traits. Never built under
//! madsim (the simulation has its own models in `sim/`).
//!
//! Map:
//! - `zmq`: `ZmqTransport`, LMCache's socket pattern and framing on the `zeromq` crate:
//!   sender DEALER → receiver ROUTER for `AllocRequest`/`CancelNotif` and replies, sender
//!   PUSH → proxy PULL for `ProxyNotif`; reconnects, bounded waits, a frame-size limit.
//! - `tcp_fabric`: `TcpFabric`, one-sided writes carried over TCP into the receiver's
//!   registered buffer, for clusters without RDMA.
//! - `shm_fabric`: `ShmFabric`, sender and receiver on one host: the sender writes straight
//!   into the receiver's buffer through a shared memory mapping.

pub mod shm_fabric;
pub mod tcp_fabric;
pub mod zmq;
