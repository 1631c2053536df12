//! Measurements of kvx: the criterion benches live in `benches/`; `fairness` measures
//! admission's utilization and fairness in virtual time (`bin/fairness.rs` prints it).

pub mod fairness;
