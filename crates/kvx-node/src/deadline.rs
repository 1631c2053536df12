//! The drivers' timer: each driver's `select!` sleeps until its core's next deadline.

/// Sleeps until the core's next deadline, or forever when it has none (the drivers'
/// `select!` arm for timers).
pub(crate) async fn sleep_until_deadline<E: kvx_io::Env>(
    env: &E,
    deadline: Option<kvx_proto::Instant>,
) {
    match deadline {
        Some(at) => env.sleep_until(at).await,
        None => std::future::pending().await,
    }
}
