//! The TCP sockets every kvx fabric opens beside its data path (TcpFabric's stream,
//! ShmFabric's notices, RdmaFabric's side channel): resolving an endpoint, binding a
//! receiver's port (retrying briefly while a just-dropped listener lets go of it), and a
//! bounded connect that tells "nothing listens there" apart from other failures.
//!
//! It lives here, beside `FabricError`, because both `kvx-transport` and `kvx-rdma` open these
//! sockets and neither should depend on the other. It is behind the feature `sockets`: it
//! needs the real `tokio::net::TcpSocket`, which madsim's `tokio::net` does not have, and
//! the simulation (which builds this crate under madsim) never opens a real socket.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpSocket, TcpStream};

use crate::FabricError;

/// How long `bind` retries an address in use: a listener dropped just before (a receiver
/// restarting at the same endpoint) lets go of its port only when its task next runs.
const REBIND_GRACE: Duration = Duration::from_millis(500);

/// Accepts `host:port` and `tcp://host:port` (the form LMCache configs use).
fn address(endpoint: &str) -> &str {
    endpoint.strip_prefix("tcp://").unwrap_or(endpoint)
}

/// `FabricError::Endpoint` for `endpoint`.
pub fn bad_endpoint(endpoint: &str, why: impl ToString) -> FabricError {
    FabricError::Endpoint {
        endpoint: endpoint.to_owned(),
        why: why.to_string(),
    }
}

async fn resolve(endpoint: &str) -> Result<SocketAddr, FabricError> {
    let mut addrs = tokio::net::lookup_host(address(endpoint))
        .await
        .map_err(|e| bad_endpoint(endpoint, e))?;
    addrs
        .next()
        .ok_or_else(|| bad_endpoint(endpoint, "resolves to no address"))
}

fn socket_for(addr: &SocketAddr, buffer: Option<u32>) -> io::Result<TcpSocket> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()
    } else {
        TcpSocket::new_v6()
    }?;
    if let Some(bytes) = buffer {
        socket.set_recv_buffer_size(bytes)?;
        socket.set_send_buffer_size(bytes)?;
    }
    Ok(socket)
}

/// Binds a receiver's listener. `buffer` (`SO_RCVBUF`/`SO_SNDBUF`) is set on the listener so
/// that accepted sockets inherit it before the window is negotiated.
pub async fn bind(endpoint: &str, buffer: Option<u32>) -> Result<TcpListener, FabricError> {
    let addr = resolve(endpoint).await?;
    let deadline = tokio::time::Instant::now() + REBIND_GRACE;
    loop {
        let bound = socket_for(&addr, buffer).and_then(|s| {
            s.set_reuseaddr(true)?;
            s.bind(addr)?;
            s.listen(1024)
        });
        match bound {
            Err(e)
                if e.kind() == io::ErrorKind::AddrInUse
                    && tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            r => return r.map_err(|e| bad_endpoint(endpoint, e)),
        }
    }
}

/// `host:port` of a bound listener, for `FabricListener::local_endpoint`.
pub fn local_endpoint(listener: &TcpListener, endpoint: &str) -> Result<String, FabricError> {
    listener
        .local_addr()
        .map(|a| a.to_string())
        .map_err(|e| bad_endpoint(endpoint, e))
}

/// Connects to a receiver's port within `timeout`, with `TCP_NODELAY` (what travels here
/// beside bulk payloads is small and latency-bound). A refused connection is
/// `FabricError::NotExposed`.
pub async fn connect(
    endpoint: &str,
    timeout: Duration,
    buffer: Option<u32>,
) -> Result<TcpStream, FabricError> {
    let addr = resolve(endpoint).await?;
    let socket = socket_for(&addr, buffer).map_err(|e| FabricError::Io(e.to_string()))?;
    let stream = match tokio::time::timeout(timeout, socket.connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) if e.kind() == io::ErrorKind::ConnectionRefused => {
            return Err(FabricError::NotExposed(endpoint.to_owned()))
        }
        Ok(Err(e)) => return Err(FabricError::Io(format!("connect to {endpoint}: {e}"))),
        Err(_) => {
            return Err(FabricError::Io(format!(
                "connect to {endpoint} timed out after {timeout:?}"
            )))
        }
    };
    stream
        .set_nodelay(true)
        .map_err(|e| FabricError::Io(e.to_string()))?;
    Ok(stream)
}
