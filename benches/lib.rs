//! Shared helpers for the criterion benches live in `benches/`; this library is empty.
