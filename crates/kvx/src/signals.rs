//! Stopping a role: the first SIGINT (Ctrl-C) or SIGTERM asks it to stop cleanly (it stops
//! taking work, ends what it holds within a bound, logs a summary and exits 0); a second
//! one ends the process at once, with status 130, for an operator who will not wait.

use std::time::Duration;

use tokio::signal::unix::{signal, SignalKind};

/// How long a stopping role may take to end what it holds before it gives up on it.
pub const DRAIN_BOUND: Duration = Duration::from_secs(10);

/// Resolves at the first SIGINT or SIGTERM, or after `limit` when given (`--exit-after-s`,
/// for tests), naming which; from then on, the next signal exits the process at once.
pub async fn first_stop(limit: Option<Duration>) -> &'static str {
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        tracing::error!("cannot listen for SIGINT and SIGTERM: stopping at the time limit only");
        match limit {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending::<()>().await,
        }
        return "the time limit";
    };
    let timer = async {
        match limit {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    let why = tokio::select! {
        _ = int.recv() => "SIGINT",
        _ = term.recv() => "SIGTERM",
        () = timer => "the time limit",
    };
    // The second signal: no more waiting.
    tokio::spawn(async move {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        eprintln!("kvx: second signal: exiting now");
        std::process::exit(130);
    });
    why
}
