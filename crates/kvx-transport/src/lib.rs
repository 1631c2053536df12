//! kvx-transport: the production implementations of `kvx_io`'s traits. Never built under
//! madsim (the simulation has its own models in `sim/`).
//!
//! Map:
//! - `zmq`: `ZmqTransport`, LMCache's socket pattern and framing: sender DEALER → receiver
//!   ROUTER for `AllocRequest`/`CancelNotif` and replies, sender PUSH → proxy PULL for
//!   `ProxyNotif`, all four sockets speaking kvx's own ZMTP 3 (frame lengths checked before
//!   anything is buffered); reconnects, bounded waits.
//! - `tcp_fabric`: `TcpFabric`, one-sided writes carried over TCP into the receiver's
//!   registered buffer, for clusters without RDMA (zero-copy `splice` sends opt-in; the
//!   crate's other `unsafe` file beside `shm_fabric/map.rs`).
//! - `shm_fabric`: `ShmFabric`, sender and receiver on one host: the receiver maps the
//!   sender's staging read-only and copies each write it admits into its own buffer.

pub mod shm_fabric;
pub mod tcp_fabric;
pub mod zmq;
