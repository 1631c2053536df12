//! What the application on every simulated node (the prefill engine, the decoder, the router)
//! shares: the `Env` its drivers run on, the bytes each chunk carries, and how it reports a
//! broken expectation to the checker.

use kvx_io::TokioEnv;

use crate::fabric::SimFabric;
use crate::net::SimTransport;
use crate::world::World;

/// What every simulated node's drivers run on.
pub type SimEnv = TokioEnv<SimTransport, SimFabric>;

/// `node`'s view of the simulated transport and fabric.
pub fn env(world: &World, node: &str) -> SimEnv {
    TokioEnv::new(
        SimTransport::new(world.clone(), node),
        SimFabric::new(world.clone(), node),
    )
}

/// The bytes chunk `chunk` of one rank of a request carries.
pub fn content(req_id: &str, rank: usize, chunk: u32, out: &mut [u8]) {
    kvx_node::synthetic::chunk_bytes(&format!("{req_id}/r{rank}"), chunk, out);
}

/// Reports a broken expectation to the checker: the run fails with `what`.
pub fn flag(world: &World, what: String) {
    let now = world.now();
    world.lock().checker.flag(now, what);
}
