//! The side channel's sockets: binding the receiver's port (LMCache's init port per TP rank),
//! connecting, and reading and writing fixed-size frames, every step bounded.

use std::io;
use std::time::Duration;

use kvx_io::sockets;
use kvx_io::FabricError;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Binds the receiver's side-channel port (LMCache's init port per TP rank).
pub(crate) async fn bind(endpoint: &str) -> Result<TcpListener, FabricError> {
    sockets::bind(endpoint, None).await
}

pub(crate) use kvx_io::sockets::local_endpoint;

/// Connects a sender's side channel within `timeout`.
pub(crate) async fn connect(endpoint: &str, timeout: Duration) -> Result<TcpStream, FabricError> {
    sockets::connect(endpoint, timeout, None).await
}

/// Reads one `N`-byte frame within `timeout`.
pub(crate) async fn read_frame<const N: usize>(
    stream: &mut TcpStream,
    timeout: Duration,
) -> io::Result<[u8; N]> {
    let mut b = [0u8; N];
    match tokio::time::timeout(timeout, stream.read_exact(&mut b)).await {
        Ok(Ok(_)) => Ok(b),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no {N}-byte frame within {timeout:?}"),
        )),
    }
}

/// Writes one frame within `timeout`.
pub(crate) async fn write_frame(
    stream: &mut TcpStream,
    frame: &[u8],
    timeout: Duration,
) -> io::Result<()> {
    match tokio::time::timeout(timeout, stream.write_all(frame)).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("a {}-byte frame not sent within {timeout:?}", frame.len()),
        )),
    }
}

/// A fresh 24-bit packet sequence number: random enough that a stale packet of an earlier
/// connection between the same queue pair numbers is not taken for a current one.
pub(crate) fn fresh_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    (h.finish() as u32) & 0x00FF_FFFF
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psns_fit_24_bits() {
        for _ in 0..100 {
            assert!(fresh_psn() < 1 << 24);
        }
    }

    #[tokio::test]
    async fn frames_are_bounded_by_the_timeout() {
        let listener = bind("tcp://127.0.0.1:0").await.expect("bind");
        let endpoint = local_endpoint(&listener, "x").expect("endpoint");
        let mut a = connect(&endpoint, Duration::from_secs(5))
            .await
            .expect("connect");
        let (mut b, _) = listener.accept().await.expect("accept");
        write_frame(&mut a, &[1, 2, 3, 4], Duration::from_secs(1))
            .await
            .expect("write");
        assert_eq!(
            read_frame::<4>(&mut b, Duration::from_secs(1))
                .await
                .expect("read"),
            [1, 2, 3, 4]
        );
        let e = read_frame::<4>(&mut b, Duration::from_millis(20))
            .await
            .expect_err("nothing more comes");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        drop(listener);
        assert_eq!(
            connect(&endpoint, Duration::from_secs(1)).await.err(),
            Some(FabricError::NotExposed(endpoint.clone()))
        );
    }
}
