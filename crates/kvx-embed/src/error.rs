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
    /// The runtime could not be built.
    #[error("runtime: {0}")]
    Runtime(#[from] std::io::Error),
}
