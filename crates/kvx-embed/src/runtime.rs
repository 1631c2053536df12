//! The tokio runtime an embedding program gets without running one itself: kvx's tasks (the
//! drivers, the sockets) run on its worker threads, and the embedding program's threads call
//! in with blocking calls (bounded, so a caller can stay responsive, e.g. to Ctrl-C) or with
//! async ones it awaits on a runtime of its own.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// A multi-threaded tokio runtime, shared by every kvx object made on it (clone freely).
/// Dropping the last clone shuts the runtime down; its tasks stop.
#[derive(Debug, Clone)]
pub struct Runtime {
    inner: Arc<tokio::runtime::Runtime>,
}

impl Runtime {
    /// A runtime with `workers` threads (at least one), named `kvx-worker`.
    pub fn new(workers: usize) -> std::io::Result<Self> {
        let inner = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers.max(1))
            .thread_name("kvx-worker")
            .enable_all()
            .build()?;
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// Runs `fut` to completion on this runtime, blocking the calling thread. Never call it
    /// from a task of this runtime (tokio panics).
    pub fn block_on<F: Future>(&self, fut: F) -> F::Output {
        self.inner.block_on(fut)
    }

    /// `block_on`, giving up after `timeout`: `None` then (the future is dropped).
    pub fn block_on_for<F: Future>(&self, timeout: Duration, fut: F) -> Option<F::Output> {
        self.inner
            .block_on(async { tokio::time::timeout(timeout, fut).await.ok() })
    }

    /// Starts `fut` on the runtime's workers.
    pub fn spawn<F>(&self, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.inner.spawn(fut)
    }

    /// The tokio handle, for code that awaits kvx's async calls on its own runtime.
    pub fn handle(&self) -> &tokio::runtime::Handle {
        self.inner.handle()
    }

    /// The tokio runtime itself, for a bridge that must be handed one to spawn on (Python's
    /// asyncio bridge: kvx's awaitables then run on kvx's workers, not on a second runtime).
    pub fn tokio(&self) -> &tokio::runtime::Runtime {
        &self.inner
    }
}
