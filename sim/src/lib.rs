//! kvx-sim: deterministic simulation of kvx under madsim. The real kvx-node drivers (not
//! copies) run on simulated nodes over a simulated transport and fabric; a global checker
//! watches the wire, the memory and every node's notices; a swarm runner draws a topology, a
//! workload and a set of faults from each seed. Built only with `--cfg madsim` in its own
//! target directory (`sim/run.sh`, `docs/sim.md`); never part of the production build.
//!
//! Map:
//! - `world`: the shared simulated world (nodes, faults, latency model, tables, trace).
//! - `net`: `SimTransport` — ZMQ-over-TCP ordering: FIFO per connection, loss only on a break.
//! - `fabric`, `qp`: `SimFabric` — a verbs model: node memory, queue pairs, flush on error.
//! - `checker`: the global checker over the wire and the memory; `outcomes`: end-to-end
//!   verdicts per request (exactly-once ends, bytes read back, liveness).
//! - `config`, `plan`: what a run is; the swarm generator that draws one from a seed.
//! - `nodes`: what runs on each node — the drivers, `engine` (the prefill engine) and
//!   `decoder`; `router`: the front end that issues requests; `faults`: the injector.
//! - `run`: one run on its own thread and runtime, with its report.
//! - `known_bugs`: kvx bugs the simulation found, worked around in the application until fixed.
//! - `rng`, `trace`: deterministic randomness and the hashed event trace.

pub mod checker;
pub mod config;
pub mod decoder;
pub mod engine;
pub mod fabric;
pub mod faults;
pub mod known_bugs;
pub mod net;
pub mod nodes;
pub mod outcomes;
pub mod plan;
mod qp;
pub mod rng;
pub mod router;
pub mod run;
pub mod trace;
pub mod world;

pub use config::{RequestPlan, SimConfig};
pub use run::{run, RunOptions, RunReport};
