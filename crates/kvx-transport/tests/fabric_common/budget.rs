//! A listener's budget (`docs/spec/fabrics.md` §1): floods of silent, greeting and
//! authenticated idle connections past `connections_max`, and the hello deadline.

use super::*;

/// A raw TCP connection to `addr` from the loopback address `source` (127.x.y.z), which then
/// says nothing: what a flood of idle sockets is made of.
pub async fn silent_from(addr: std::net::SocketAddr, source: [u8; 4]) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(std::net::SocketAddr::from((source, 0)))
        .expect("bind a loopback source");
    step("a silent connection", socket.connect(addr))
        .await
        .expect("connects")
}

/// Whether the receiver has closed `s` by now (end of stream or reset), within 1 ms.
async fn closed_now(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 64];
    matches!(
        tokio::time::timeout(Duration::from_millis(1), s.read(&mut b)).await,
        Ok(Ok(0) | Err(_))
    )
}

/// Waits (bounded: 5 s) until `want` of `conns` are closed, then 200 ms more, so that one
/// closed too many shows; which ones are.
pub async fn closed_of(conns: &mut [TcpStream], want: usize) -> Vec<bool> {
    let mut closed = vec![false; conns.len()];
    let began = std::time::Instant::now();
    let mut settled = None;
    // Bounded: at most 5.2 s of passes 10 ms apart.
    for _ in 0..1_000 {
        for (c, s) in closed.iter_mut().zip(conns.iter_mut()) {
            *c = *c || closed_now(s).await;
        }
        let n = closed.iter().filter(|c| **c).count();
        if settled.is_none() && (n >= want || began.elapsed() > Duration::from_secs(5)) {
            settled = Some(std::time::Instant::now());
        }
        if settled.is_some_and(|t| t.elapsed() > Duration::from_millis(200)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    closed
}

/// One granted write of `SLOT`-sized `tag` bytes into `slot` (generation `generation`) on
/// `conn`, which must complete `Ok`.
async fn one_write(
    conn: &mut FabricConn,
    staging: &impl SlotMemory,
    access: &FabricAccess,
    peer: PeerId,
    (id, slot, generation): (u64, u32, u32),
    what: &str,
) {
    let bytes = pattern(id as u32, staging.slot_bytes());
    staging.write_slot(0, &bytes);
    conn.post(granted(access, peer, id, 0, slot, generation, &bytes))
        .expect("post");
    let c = completion(conn, what).await;
    assert_eq!((c.id, c.result), (WriteId(id), Ok(())), "{what}");
}

/// The fabric's listener under a flood of silent connections, with `connections_max` 8 and
/// `connections_per_source_max` 4 (the caller's config) and a long `hello_timeout`: past a
/// cap a newcomer is taken and a silent connection (the oldest) is closed for it, never a
/// sender that authenticated; a sender attaching amid the flood is served; and one address
/// past its own cap loses its own oldest connections, nobody else's.
pub async fn idle_connections_never_lock_a_sender_out<F: Fabric>(f: &F, endpoint: &str) {
    const SLOT: usize = 4096;
    let mut listener = f
        .expose(endpoint, SlotGeometry::new(8, SLOT).expect("a geometry"))
        .await
        .expect("expose");
    let ep = listener.local_endpoint.clone();
    let addr: std::net::SocketAddr = ep
        .trim_start_matches("tcp://")
        .parse()
        .expect("an ip:port endpoint");
    let access = listener.access.clone();
    // Notices are drained as a receiver's driver drains them.
    let drain = tokio::spawn(async move { while listener.landed.recv().await.is_some() {} });
    let (a, b) = (PeerId(1), PeerId(2));
    let staging_a = f
        .allocate_staging(SlotGeometry::new(1, SLOT).expect("a geometry"))
        .expect("staging");
    let mut conn_a = step(
        "A connects",
        f.connect(&ep, staging_a.clone(), access.credential_for(a)),
    )
    .await
    .expect("A attaches");
    one_write(
        &mut conn_a,
        &*staging_a,
        &access,
        a,
        (1, 0, 1),
        "A's first write",
    )
    .await;

    // 12 silent connections from three addresses, 4 each: with A, 13 for 8 places.
    let mut silent = Vec::new();
    for i in 0..12u8 {
        silent.push(silent_from(addr, [127, 0, 0, 2 + i / 4]).await);
    }
    let closed = closed_of(&mut silent, 5).await;
    assert_eq!(
        closed.iter().filter(|c| **c).count(),
        5,
        "as many silent connections as go past the cap are closed: {closed:?}"
    );
    assert!(
        closed[..5].iter().all(|c| *c),
        "the oldest first: {closed:?}"
    );
    one_write(
        &mut conn_a,
        &*staging_a,
        &access,
        a,
        (2, 1, 1),
        "A amid the flood",
    )
    .await;

    // B attaches amid the flood: a silent connection makes room for it.
    let staging_b = f
        .allocate_staging(SlotGeometry::new(1, SLOT).expect("a geometry"))
        .expect("staging");
    let mut conn_b = step(
        "B connects",
        f.connect(&ep, staging_b.clone(), access.credential_for(b)),
    )
    .await
    .expect("B attaches amid the flood");
    one_write(
        &mut conn_b,
        &*staging_b,
        &access,
        b,
        (1, 2, 1),
        "B amid the flood",
    )
    .await;

    // One more address opens 6: past its own cap of 4 it loses its own two oldest.
    let mut one_address = Vec::new();
    for _ in 0..6 {
        one_address.push(silent_from(addr, [127, 0, 0, 9]).await);
    }
    let own = closed_of(&mut one_address, 2).await;
    assert_eq!(
        own,
        [true, true, false, false, false, false],
        "its own oldest go"
    );
    one_write(
        &mut conn_a,
        &*staging_a,
        &access,
        a,
        (3, 3, 1),
        "A after all",
    )
    .await;
    one_write(
        &mut conn_b,
        &*staging_b,
        &access,
        b,
        (2, 4, 1),
        "B after all",
    )
    .await;
    drop((conn_a, conn_b));
    drain.abort();
}

/// A connection that says nothing, or only part of a hello, is closed after `hello_timeout`
/// (the caller's config: 300 ms); a sender that greets at once is served.
pub async fn a_silent_or_slow_hello_is_cut_off<F: Fabric>(f: &F, endpoint: &str) {
    const SLOT: usize = 4096;
    let mut listener = f
        .expose(endpoint, SlotGeometry::new(2, SLOT).expect("a geometry"))
        .await
        .expect("expose");
    let ep = listener.local_endpoint.clone();
    let addr: std::net::SocketAddr = ep
        .trim_start_matches("tcp://")
        .parse()
        .expect("an ip:port endpoint");
    let access = listener.access.clone();
    let drain = tokio::spawn(async move { while listener.landed.recv().await.is_some() {} });
    let began = std::time::Instant::now();
    let mut silent = silent_from(addr, [127, 0, 0, 1]).await;
    let mut slow = silent_from(addr, [127, 0, 0, 1]).await;
    slow.write_all(b"KVX").await.expect("a first byte or three");
    let closed = closed_of(std::slice::from_mut(&mut silent), 1).await;
    assert_eq!(closed, [true], "the silent connection is closed");
    let closed = closed_of(std::slice::from_mut(&mut slow), 1).await;
    assert_eq!(closed, [true], "the slow hello is closed");
    let took = began.elapsed();
    assert!(took < Duration::from_secs(3), "closed after {took:?}");
    let staging = f
        .allocate_staging(SlotGeometry::new(1, SLOT).expect("a geometry"))
        .expect("staging");
    let mut conn = step(
        "a sender connects",
        f.connect(&ep, staging.clone(), access.credential_for(PeerId(1))),
    )
    .await
    .expect("attaches");
    one_write(
        &mut conn,
        &*staging,
        &access,
        PeerId(1),
        (1, 0, 1),
        "its write",
    )
    .await;
    drop(conn);
    drain.abort();
}

/// A raw attach from `source` with `credential`, welcomed (TCP: `KVXT`, no ticket).
async fn idle_attach(
    addr: std::net::SocketAddr,
    source: [u8; 4],
    slot_bytes: usize,
    credential: &FabricCredential,
) -> TcpStream {
    let mut s = silent_from(addr, source).await;
    let hello = raw::hello(b"KVXT", 1, slot_bytes as u64, credential);
    s.write_all(&hello).await.expect("hello");
    assert_eq!(raw::welcome(&mut s).await.0, 0, "welcomed");
    s
}

/// Every place taken by authenticated connections that idle (`connections_max` 8, the
/// caller's config), and more of them attaching all the time: a sender still attaches (a
/// newcomer is taken beyond the cap while it greets, and its authentication closes an idle
/// one: its own address's heard from longest ago, else the busiest address's), and while it
/// writes, newcomers close idle ones, never it.
pub async fn authenticated_idlers_never_lock_a_writer_out<F: Fabric>(f: &F, endpoint: &str) {
    const SLOT: usize = 4096;
    let mut listener = f
        .expose(endpoint, SlotGeometry::new(16, SLOT).expect("a geometry"))
        .await
        .expect("expose");
    let ep = listener.local_endpoint.clone();
    let addr: std::net::SocketAddr = ep
        .trim_start_matches("tcp://")
        .parse()
        .expect("an ip:port endpoint");
    let access = listener.access.clone();
    let drain = tokio::spawn(async move { while listener.landed.recv().await.is_some() {} });
    // The attacker is somebody too: a credential of its own.
    let idler = access.credential_for(PeerId(9));
    let mut old = Vec::new();
    for i in 0..8u8 {
        old.push(idle_attach(addr, [127, 0, 0, 2 + i / 4], SLOT, &idler).await);
    }
    let a = PeerId(1);
    let staging = f
        .allocate_staging(SlotGeometry::new(1, SLOT).expect("a geometry"))
        .expect("staging");
    let mut conn = step(
        "A connects",
        f.connect(&ep, staging.clone(), access.credential_for(a)),
    )
    .await
    .expect("A attaches while idle authenticated connections fill every place");
    one_write(
        &mut conn,
        &*staging,
        &access,
        a,
        (1, 0, 1),
        "A's first write",
    )
    .await;
    let mut new = Vec::new();
    for i in 0..8u8 {
        tokio::time::sleep(Duration::from_millis(2)).await;
        new.push(idle_attach(addr, [127, 0, 0, 4 + i / 4], SLOT, &idler).await);
        tokio::time::sleep(Duration::from_millis(2)).await;
        let w = u64::from(i) + 2;
        one_write(
            &mut conn,
            &*staging,
            &access,
            a,
            (w, w as u32, 1),
            "A amid them",
        )
        .await;
    }
    // Nine authentications past the cap (A's and the new idlers'), nine idlers closed: the
    // first new idler of each address closes the busiest older address's quietest, the
    // rest their own address's; the writer never goes (its writes above all completed).
    let mut all: Vec<TcpStream> = old.into_iter().chain(new).collect();
    let closed = closed_of(&mut all, 9).await;
    assert_eq!(
        closed.iter().filter(|c| **c).count(),
        9,
        "nine idlers closed: {closed:?}"
    );
    one_write(
        &mut conn,
        &*staging,
        &access,
        a,
        (20, 10, 1),
        "A after them",
    )
    .await;
    drop(conn);
    drain.abort();
}
