//! Placeholder: TcpFabric is being written.
