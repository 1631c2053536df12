//! The connection tables the `World` holds, below both the world and the tasks that use them:
//! the transport's (`net`: bound servers, notice sources, connections and their sessions), the
//! fabric's (`fabric`: exposed buffers, queue pairs, each node's NIC egress) and a node's
//! registered memory (`memory`).

pub mod fabric;
pub mod memory;
pub mod net;
