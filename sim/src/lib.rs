//! kvx-sim: deterministic simulation of kvx under madsim. The real kvx-node drivers (not
//! copies) run on simulated nodes over a simulated transport and fabric; a global checker
//! watches the wire, the memory and every node's notices; a swarm runner draws a topology, a
//! workload and a set of faults from each seed. Built only with `--cfg madsim` in its own
//! target directory (`sim/run.sh`, `docs/sim.md`); never part of the production build.
//!
//! Map, from the bottom up (a module imports only modules named on lines above its own):
//! - `config`: what a run is — topology, every node's configuration, the network's
//!   `LinkModel`, requests, faults; `trace`: the hashed event trace; `known_bugs`: kvx bugs
//!   the simulation found, worked around in the application until fixed. Everything drawn
//!   from a seed comes from `kvx_proto::rng::SeededRng`; madsim's own RNG only orders ready
//!   tasks.
//! - `checker`: the global checker over the wire and the memory; `outcomes`: end-to-end
//!   verdicts per request (exactly-once ends, bytes read back, liveness).
//! - `commands`: what the router and the run hand a node's application (jobs, verdicts,
//!   queries), and each node's channel.
//! - `tables`: the transport's and the fabric's tables (`tables::net`, `tables::fabric`, over
//!   `tables::memory`, a node's registered memory), and what a break does to them.
//! - `world`: the shared simulated world (nodes, faults, latency model, those tables, the
//!   checker, outcomes, channels, trace) and the faults' effect on connections.
//! - `net`: `SimTransport` — ZMQ-over-TCP ordering: FIFO per connection, loss only on a break.
//!   `fabric`: `SimFabric` — a verbs model: node memory, queue pairs (`fabric::qp`), flush on
//!   error.
//! - `app`: what every node's application shares (its `Env`, a chunk's bytes, flags).
//! - `engine` (the prefill engine on a sender node), `decoder` (on a receiver node).
//! - `nodes`: what runs on each node — the drivers, then its engine or decoder; `router`: the
//!   front end that issues requests; `faults`: the injector; `plan`: the swarm generator
//!   that draws a run from a seed.
//! - `run`: one run on its own thread and runtime, with its report.

pub mod app;
pub mod checker;
pub mod commands;
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
pub mod router;
pub mod run;
pub mod tables;
pub mod trace;
pub mod world;

pub use config::{RequestPlan, SimConfig};
pub use run::{run, RunOptions, RunReport};
