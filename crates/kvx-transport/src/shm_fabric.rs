//! Placeholder: ShmFabric is being written.
