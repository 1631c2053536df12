//! Placeholder: ZmqTransport is being written.
