//! Why an embedded kvx object could not be made or used, in the words of the layer that
//! refused (the environment, the driver, the runtime).

/// An error from kvx-embed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EmbedError {
    /// The transport or fabric could not be made.
    #[error(transparent)]
    Env(#[from] crate::choice::EnvError),
    /// A driver could not start (a port in use, an invalid configuration, …).
    #[error(transparent)]
    Start(#[from] kvx_node::StartError),
    /// Releasing a read lease failed: the receiver has stopped (`ConsumeError::Stopped`).
    #[error(transparent)]
    Consume(kvx_proto::receiver::ConsumeError),
    /// Caller placement: a reservation or withdrawal was refused (the reason says why), or
    /// the receiver has stopped (`PlacementError::Stopped`).
    #[error(transparent)]
    Placement(kvx_proto::receiver::PlacementError),
    /// A blocking call gave up after its timeout.
    #[error("no answer within {0:?}")]
    TimedOut(std::time::Duration),
    /// The runtime could not be built.
    #[error("runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

impl EmbedError {
    /// Whether a receiver refused this sender's connection (`TransportError::Refused`): for
    /// a kvx receiver, another connection holds the sender's identity, or the identity breaks
    /// ZMQ's rules. Retrying under the same identity does not help while the other lasts.
    pub fn is_refused(&self) -> bool {
        matches!(
            self,
            Self::Start(kvx_node::StartError::Transport(
                kvx_io::TransportError::Refused { .. }
            ))
        )
    }

    /// Whether the sender or receiver asked has stopped: its driver task ended (a shutdown,
    /// a close, or its runtime went away). Nothing more on that object can succeed; a new
    /// one must be started.
    pub fn is_stopped(&self) -> bool {
        matches!(
            self,
            Self::Start(kvx_node::StartError::Stopped)
                | Self::Consume(kvx_proto::receiver::ConsumeError::Stopped)
                | Self::Placement(kvx_proto::receiver::PlacementError::Stopped)
        )
    }
}
