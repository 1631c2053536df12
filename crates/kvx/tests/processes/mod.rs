//! What the tests that run `kvx` as separate processes share: the binary, free loopback
//! ports, and reading a role's `/metrics` over HTTP.

#![allow(dead_code)] // Each test file uses its own part.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::time::Duration;

pub fn kvx() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvx"))
}

/// A free loopback port below the kernel's ephemeral range. A port from that range (what
/// binding port 0 gives) can be taken meanwhile as the local port of an outgoing connection,
/// even of a sender reconnecting to that very port while its receiver restarts (a TCP
/// self-connect), and the receiver could then not bind it again.
pub fn free_port() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768)
        .clamp(12_000, 65_535);
    let mut x = u64::from(std::process::id())
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    for _ in 0..1000 {
        // xorshift: enough to spread the picks.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let port = 10_000 + (x % u64::from(low - 10_000)) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port below {low}")
}

pub fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let status = text.split(' ').nth(1)?.parse().ok()?;
    Some((
        status,
        text.split_once("\r\n\r\n")
            .map_or("", |(_, b)| b)
            .to_owned(),
    ))
}

/// The sum of a metric's samples (every label set), when the text has it.
pub fn value(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((key, v)) = line.rsplit_once(' ') else {
            continue;
        };
        let bare = key.split('{').next().unwrap_or(key);
        if bare == name {
            *found.get_or_insert(0.0) += v.parse::<f64>().ok()?;
        }
    }
    found
}
