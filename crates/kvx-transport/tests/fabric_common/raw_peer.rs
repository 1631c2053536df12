//! A hand-written peer speaking the fabric wire (`docs/spec/fabrics.md`) straight to a
//! receiver: what a fabric's own sender never sends, to show the receiver checks its bounds
//! and grants itself.

use super::*;

/// The wire, as `docs/spec/fabrics.md` gives it, for hand-written peers.
pub mod raw {
    use super::*;

    /// An attaching hello (the current version, 3), with `credential`.
    pub fn hello(
        magic: &[u8; 4],
        slots: u32,
        slot_bytes: u64,
        credential: &FabricCredential,
    ) -> Vec<u8> {
        let mut b = hello_v1(magic, slots, slot_bytes);
        b[4..6].copy_from_slice(&3u16.to_le_bytes());
        b.extend_from_slice(&credential.to_bytes());
        b.extend_from_slice(&[0u8; 8]);
        b
    }

    /// A version-1 hello (32 bytes, no credential), as kvx spoke before credentials.
    pub fn hello_v1(magic: &[u8; 4], slots: u32, slot_bytes: u64) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(magic);
        b.extend_from_slice(&1u16.to_le_bytes()); // version
        b.extend_from_slice(&0u16.to_le_bytes()); // kind: attach
        b.extend_from_slice(&slots.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&slot_bytes.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes()); // conn
        b
    }

    /// A welcome as a receiver sends it.
    pub fn welcome_bytes(
        magic: &[u8; 4],
        slots: u32,
        slot_bytes: u64,
        conn: u64,
        extra: &[u8],
    ) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(magic);
        b.extend_from_slice(&3u16.to_le_bytes()); // version
        b.extend_from_slice(&0u16.to_le_bytes()); // status: ok
        b.extend_from_slice(&slots.to_le_bytes());
        b.extend_from_slice(&(extra.len() as u32).to_le_bytes());
        b.extend_from_slice(&slot_bytes.to_le_bytes());
        b.extend_from_slice(&conn.to_le_bytes());
        b.extend_from_slice(extra);
        b
    }

    pub fn header(id: u64, remote: u32, len: u64, imm: Option<u32>) -> Vec<u8> {
        header_with_checksum(id, remote, len, imm, None)
    }

    /// A 40-byte write header, from staging slot 0 (which only `ShmFabric` reads).
    pub fn header_with_checksum(
        id: u64,
        remote: u32,
        len: u64,
        imm: Option<u32>,
        checksum: Option<u32>,
    ) -> Vec<u8> {
        let flags = u32::from(imm.is_some()) | (u32::from(checksum.is_some()) << 1);
        let mut b = Vec::new();
        b.extend_from_slice(&id.to_le_bytes());
        b.extend_from_slice(&remote.to_le_bytes());
        b.extend_from_slice(&flags.to_le_bytes());
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(&imm.unwrap_or(0).to_le_bytes());
        b.extend_from_slice(&checksum.unwrap_or(0).to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes()); // staging slot 0
        b.extend_from_slice(&0u32.to_le_bytes());
        b
    }

    /// An attaching hello followed by `extra` (`ShmFabric`: the ticket of its staging handoff).
    pub fn hello_with(
        magic: &[u8; 4],
        slots: u32,
        slot_bytes: u64,
        credential: &FabricCredential,
        extra: &[u8],
    ) -> Vec<u8> {
        let mut b = hello(magic, slots, slot_bytes, credential);
        b[12..16].copy_from_slice(&(extra.len() as u32).to_le_bytes());
        b.extend_from_slice(extra);
        b
    }

    /// Offers `fds` as a sender's staging of `slots × slot_bytes` at the shm handoff socket
    /// of the buffer whose control port is `port` (`docs/spec/fabrics.md` §ShmFabric):
    /// (status, ticket, reason).
    pub async fn offer(
        port: u16,
        fds: Vec<std::os::fd::OwnedFd>,
        slots: u32,
        slot_bytes: u64,
        credential: &FabricCredential,
    ) -> (u16, u64, String) {
        let offer = offer_bytes(slots, slot_bytes, credential);
        let exchange = tokio::task::spawn_blocking(move || blocking_offer(port, &fds, &offer));
        step("offer", exchange).await.expect("offer task")
    }

    /// A 48-byte offer of a staging of `slots × slot_bytes`.
    pub fn offer_bytes(slots: u32, slot_bytes: u64, credential: &FabricCredential) -> Vec<u8> {
        let mut offer = Vec::new();
        offer.extend_from_slice(b"KVXD");
        offer.extend_from_slice(&1u16.to_le_bytes());
        offer.extend_from_slice(&0u16.to_le_bytes());
        offer.extend_from_slice(&slots.to_le_bytes());
        offer.extend_from_slice(&0u32.to_le_bytes());
        offer.extend_from_slice(&slot_bytes.to_le_bytes());
        offer.extend_from_slice(&credential.to_bytes());
        offer
    }

    /// `offer`, on this thread: (status, ticket, reason).
    pub fn blocking_offer(
        port: u16,
        fds: &[std::os::fd::OwnedFd],
        offer: &[u8],
    ) -> (u16, u64, String) {
        use std::io::Read;
        use std::os::fd::AsFd;
        use std::os::linux::net::SocketAddrExt;
        use std::os::unix::net::{SocketAddr, UnixStream};
        let name = format!("kvx-shm-fabric.{port}");
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).expect("abstract name");
        let mut s = UnixStream::connect_addr(&addr).expect("handoff connect");
        s.set_read_timeout(Some(STEP)).expect("timeout");
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
        if !borrowed.is_empty() {
            assert!(control.push(rustix::net::SendAncillaryMessage::ScmRights(&borrowed)));
        }
        let sent = rustix::net::sendmsg(
            &s,
            &[std::io::IoSlice::new(offer)],
            &mut control,
            rustix::net::SendFlags::NOSIGNAL,
        );
        // A receiver replies only once it has read the whole offer.
        assert_eq!(sent, Ok(offer.len()));
        let mut reply = [0u8; 16];
        s.read_exact(&mut reply).expect("reply");
        assert_eq!(&reply[0..4], b"KVXD");
        let status = u16::from_le_bytes([reply[4], reply[5]]);
        let reason_len = u16::from_le_bytes([reply[6], reply[7]]);
        let ticket = u64::from_le_bytes(reply[8..16].try_into().expect("8 bytes"));
        let mut reason = vec![0u8; usize::from(reason_len)];
        s.read_exact(&mut reason).expect("reason");
        (status, ticket, String::from_utf8(reason).expect("utf-8"))
    }

    /// (status, slots, slot_bytes, extra)
    pub async fn welcome(s: &mut TcpStream) -> (u16, u32, u64, Vec<u8>) {
        let mut b = [0u8; 32];
        step("welcome", s.read_exact(&mut b))
            .await
            .expect("welcome");
        let status = u16::from_le_bytes([b[6], b[7]]);
        let slots = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
        let extra_len = u32::from_le_bytes(b[12..16].try_into().expect("4 bytes"));
        let slot_bytes = u64::from_le_bytes(b[16..24].try_into().expect("8 bytes"));
        let mut extra = vec![0u8; extra_len as usize];
        step("welcome extra", s.read_exact(&mut extra))
            .await
            .expect("extra");
        (status, slots, slot_bytes, extra)
    }

    /// (id, status)
    pub async fn ack(s: &mut TcpStream) -> (u64, u32) {
        let mut b = [0u8; 16];
        step("ack", s.read_exact(&mut b)).await.expect("ack");
        (
            u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")),
            u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
        )
    }
}

/// How a hand-written peer delivers a write's bytes.
pub enum Raw<'a> {
    /// TCP: they follow the header on the socket.
    Inline,
    /// Shared memory: they are in the peer's staging (slot 0), whose descriptor the peer
    /// hands over first; the hello names the ticket it got.
    Staged(&'a kvx_transport::shm_fabric::ShmMemory),
}

impl Raw<'_> {
    fn inline(&self) -> bool {
        matches!(self, Raw::Inline)
    }

    /// The hello to the buffer at `ep`; staged, after handing over the staging (a refused
    /// offer leaves ticket 0, which names nothing).
    async fn hello(
        &self,
        ep: &str,
        magic: &[u8; 4],
        slot_bytes: u64,
        credential: &FabricCredential,
    ) -> Vec<u8> {
        match self {
            Raw::Inline => raw::hello(magic, 1, slot_bytes, credential),
            Raw::Staged(memory) => {
                let port = port_of(ep);
                let fd = memory
                    .memfd()
                    .expect("staging")
                    .try_clone_to_owned()
                    .expect("dup");
                let (status, ticket, _) =
                    raw::offer(port, vec![fd], memory.slots(), slot_bytes, credential).await;
                let ticket = if status == 0 { ticket } else { 0 };
                raw::hello_with(
                    magic,
                    memory.slots(),
                    slot_bytes,
                    credential,
                    &ticket.to_le_bytes(),
                )
            }
        }
    }

    /// `header`, with `bytes` after it (inline) or put in staging slot 0 first (staged).
    fn write(&self, header: Vec<u8>, bytes: &[u8]) -> Vec<u8> {
        let mut out = header;
        match self {
            Raw::Inline => out.extend_from_slice(bytes),
            Raw::Staged(memory) if !bytes.is_empty() => memory.write_slot(0, bytes),
            Raw::Staged(_) => {}
        }
        out
    }
}

/// Runs as a hand-written sender sends them: a run of two (`FLAG_RUN` and the count 2 on the
/// first header, both payloads after the second) lands both pieces, each announced; a run
/// announced longer than `WriteRun::MAX_PIECES`, or whose headers' flags disagree with its
/// count, ends the connection (TCP), as does any run where no payload follows its headers
/// (shared memory, which carries none). A version-2 hello is welcomed.
pub async fn receiver_bounds_runs<F: Fabric>(f: &F, endpoint: &str, magic: &[u8; 4], raw: Raw<'_>) {
    const FLAG_RUN: u32 = 4;
    let flagged = |mut h: Vec<u8>| {
        let flags = u32::from_le_bytes(h[12..16].try_into().expect("4")) | FLAG_RUN;
        h[12..16].copy_from_slice(&flags.to_le_bytes());
        h
    };
    // A run's first header: flagged, with the run's length at offset 36.
    let first = |h: Vec<u8>, pieces: u32| {
        let mut h = flagged(h);
        h[36..40].copy_from_slice(&pieces.to_le_bytes());
        h
    };
    let mut listener = f
        .expose(endpoint, SlotGeometry::new(4, 1024).expect("a geometry"))
        .await
        .expect("expose");
    let ep = listener.local_endpoint.clone();
    let me = PeerId(9);
    for slot in 0..4 {
        listener.access.grant(slot, me, 3);
    }
    let credential = listener.access.credential_for(me);
    let mut s = TcpStream::connect(&ep).await.expect("raw connect");
    s.write_all(&raw.hello(&ep, magic, 1024, &credential).await)
        .await
        .expect("hello");
    let (status, ..) = raw::welcome(&mut s).await;
    assert_eq!(status, 0);
    // A version-2 sender (no runs) is still served: receivers upgrade before senders.
    let mut v2 = TcpStream::connect(&ep).await.expect("raw connect");
    let mut hello = raw.hello(&ep, magic, 1024, &credential).await;
    hello[4..6].copy_from_slice(&2u16.to_le_bytes());
    v2.write_all(&hello).await.expect("hello");
    assert_eq!(
        raw::welcome(&mut v2).await.0,
        0,
        "a version-2 hello is welcomed"
    );
    drop(v2);
    let mut out = first(raw::header(1, 1, 1024, imm(1, 3)), 2);
    out.extend(raw::header(2, 2, 1024, imm(2, 3)));
    let mut b = [0u8; 16];
    if !raw.inline() {
        s.write_all(&out).await.expect("run headers");
        let r = step("answer to a run over shared memory", s.read(&mut b)).await;
        assert!(matches!(r, Ok(0) | Err(_)), "connection dropped: {r:?}");
        return;
    }
    out.extend(pattern(1, 1024));
    out.extend(pattern(2, 1024));
    s.write_all(&out).await.expect("a run of two");
    assert_eq!(raw::ack(&mut s).await, (1, 0), "first piece landed");
    assert_eq!(raw::ack(&mut s).await, (2, 0), "second piece landed");
    for (slot, tag) in [(1, 1), (2, 2)] {
        let l = step("landed", listener.landed.recv()).await.expect("open");
        assert_eq!(l.slot, SlotIndex(slot));
        let mut got = vec![0u8; 1024];
        listener.memory.read_slot(slot, &mut got);
        assert!(got == pattern(tag, 1024), "piece {tag} landed in its slot");
    }
    // A run of three whose second header says it is the last: the receiver hangs up.
    let mut out = first(raw::header(3, 0, 1024, imm(0, 3)), 3);
    out.extend(raw::header(4, 1, 1024, imm(1, 3)));
    out.extend(raw::header(5, 2, 1024, imm(2, 3)));
    s.write_all(&out).await.expect("a run that ends early");
    let r = step("answer to a run that ends early", s.read(&mut b)).await;
    assert!(matches!(r, Ok(0) | Err(_)), "connection dropped: {r:?}");
    // One piece more than a run may hold: the receiver hangs up at its first header.
    let max = kvx_io::WriteRun::MAX_PIECES as u32;
    let mut s = TcpStream::connect(&ep).await.expect("raw connect");
    s.write_all(&raw.hello(&ep, magic, 1024, &credential).await)
        .await
        .expect("hello");
    assert_eq!(raw::welcome(&mut s).await.0, 0);
    s.write_all(&first(raw::header(6, 0, 1024, imm(0, 3)), max + 1))
        .await
        .expect("an overlong run");
    let r = step("answer to an overlong run", s.read(&mut b)).await;
    assert!(matches!(r, Ok(0) | Err(_)), "connection dropped: {r:?}");
}

/// A hand-written sender checks the receiver's own bounds (a fabric sender checks first and
/// never sends such writes): an out-of-bounds write is acked as refused and announces
/// nothing, the next write lands, and an absurd length drops only that connection (inline)
/// or is refused (staged).
pub async fn receiver_checks_bounds<F: Fabric>(
    f: &F,
    endpoint: &str,
    magic: &[u8; 4],
    raw: Raw<'_>,
) {
    let mut listener = f
        .expose(endpoint, SlotGeometry::new(2, 1024).expect("a geometry"))
        .await
        .expect("expose");
    let ep = listener.local_endpoint.clone();
    let me = PeerId(9);
    listener.access.grant(1, me, 3);
    let mut s = TcpStream::connect(&ep).await.expect("raw connect");
    let credential = listener.access.credential_for(me);
    s.write_all(&raw.hello(&ep, magic, 1024, &credential).await)
        .await
        .expect("hello");
    let (status, slots, slot_bytes, _) = raw::welcome(&mut s).await;
    assert_eq!((status, slots, slot_bytes), (0, 2, 1024));

    let payload = pattern(7, 1024);
    let mut out = raw.write(raw::header(1, 2, 1024, imm(2, 3)), &payload);
    out.extend(raw.write(raw::header(2, 1, 1024, imm(1, 3)), &payload));
    s.write_all(&out).await.expect("writes");
    assert_eq!(raw::ack(&mut s).await, (1, 1), "out of bounds: refused");
    assert_eq!(raw::ack(&mut s).await, (2, 0), "in bounds: landed");
    let l = step("landed", listener.landed.recv()).await.expect("open");
    assert_eq!(
        (l.peer, l.slot),
        (me, SlotIndex(1)),
        "only the landed write is announced"
    );
    let mut got = vec![0u8; 1024];
    listener.memory.read_slot(1, &mut got);
    assert!(got == payload, "the payload landed whole");

    // A length no slot can hold: the receiver hangs up on this sender (inline) or refuses
    // the write (staged, where nothing follows the header).
    s.write_all(&raw::header(3, 0, 1 << 40, imm(0, 1)))
        .await
        .expect("bad header");
    let mut b = [0u8; 16];
    let r = step("answer to an absurd write", s.read(&mut b)).await;
    if raw.inline() {
        assert!(matches!(r, Ok(0) | Err(_)), "connection dropped: {r:?}");
    } else {
        assert_eq!(r.expect("ack"), 16);
        assert_eq!(u32::from_le_bytes(b[8..12].try_into().expect("4")), 1);
    }
    // Junk instead of a hello: dropped without an answer.
    let mut junk = TcpStream::connect(&ep).await.expect("junk connect");
    junk.write_all(&[0xFF; 64]).await.expect("junk");
    let r = step("answer to junk", junk.read(&mut b)).await;
    assert!(matches!(r, Ok(0) | Err(_)), "junk dropped: {r:?}");

    // The buffer still serves fabric senders.
    let staging = f
        .allocate_staging(SlotGeometry::new(1, 1024).expect("a geometry"))
        .expect("staging");
    let bytes = pattern(8, 1024);
    staging.write_slot(0, &bytes);
    let mut conn = step("connect", f.connect(&ep, staging, credential))
        .await
        .expect("connect");
    conn.post(granted(&listener.access, me, 5, 0, 0, 4, &bytes))
        .expect("post");
    assert_eq!(completion(&mut conn, "completion").await.result, Ok(()));
    let l = step("landed", listener.landed.recv()).await.expect("open");
    assert_eq!(l.slot, SlotIndex(0));
    listener.memory.read_slot(0, &mut got);
    assert!(got == bytes);
}

/// Hand-written peers attack the grants (the defects a hostile review found: a peer that
/// merely reached the port could announce another request's chunks as landed with an empty
/// write, or overwrite another sender's slots with full ones). Each attempt must be refused
/// (ack status 2), change no byte and announce nothing, while the grant holder's own write
/// lands; a hello without a credential this buffer issued gets no welcome and no writes.
pub async fn receiver_checks_grants<F: Fabric>(
    f: &F,
    endpoint: &str,
    magic: &[u8; 4],
    raw: Raw<'_>,
) {
    const BYTES: usize = 1024;
    let mut listener = f
        .expose(endpoint, SlotGeometry::new(4, BYTES).expect("a geometry"))
        .await
        .expect("expose");
    let ep = listener.local_endpoint.clone();
    let (victim, attacker) = (PeerId(1), PeerId(2));
    listener.access.grant(0, victim, 7);
    listener.access.grant(1, attacker, 7);

    // Unauthenticated: a made-up credential, and the old credential-less hello.
    for (what, hello) in [
        (
            "a credential this buffer did not issue",
            raw.hello(
                &ep,
                magic,
                BYTES as u64,
                &FabricAccess::new(1, [3; 16]).credential_for(victim),
            )
            .await,
        ),
        ("a version-1 hello", raw::hello_v1(magic, 1, BYTES as u64)),
    ] {
        let mut s = TcpStream::connect(&ep).await.expect("raw connect");
        s.write_all(&hello).await.expect("hello");
        let mut b = [0u8; 32];
        step("welcome", s.read_exact(&mut b)).await.expect(what);
        let status = u16::from_le_bytes([b[6], b[7]]);
        let extra_len = u32::from_le_bytes(b[12..16].try_into().expect("4"));
        assert!(
            status == 4 || status == 1,
            "{what}: refused (status {status})"
        );
        assert_eq!(extra_len, 0, "{what}: nothing more for a refused sender");
        let r = step("close", s.read(&mut b)).await;
        assert!(matches!(r, Ok(0) | Err(_)), "{what}: then closed: {r:?}");
    }

    // Authenticated as itself, the attacker names the victim's grant.
    let mut s = TcpStream::connect(&ep).await.expect("raw connect");
    let credential = listener.access.credential_for(attacker);
    s.write_all(&raw.hello(&ep, magic, BYTES as u64, &credential).await)
        .await
        .expect("hello");
    assert_eq!(raw::welcome(&mut s).await.0, 0);
    let junk = vec![0xEEu8; BYTES];
    let attempts: Vec<(&str, Vec<u8>, bool)> = vec![
        // Defect 1: an empty write naming the victim's slot and generation.
        (
            "a forged empty landing",
            raw::header(1, 0, 0, imm(0, 7)),
            false,
        ),
        // Defect 2: a full write into the victim's slot under the victim's grant.
        (
            "an overwrite of another peer's slot",
            raw::header(2, 0, BYTES as u64, imm(0, 7)),
            true,
        ),
        // Its own slot, but naming the victim's.
        (
            "an immediate naming another slot",
            raw::header(3, 1, BYTES as u64, imm(0, 7)),
            true,
        ),
        // Its own slot under a generation it does not hold.
        (
            "a stale generation",
            raw::header(4, 1, BYTES as u64, imm(1, 6)),
            true,
        ),
        // No immediate at all.
        (
            "a write naming no grant",
            raw::header(5, 1, BYTES as u64, None),
            true,
        ),
    ];
    for (i, (what, header, payload)) in attempts.into_iter().enumerate() {
        let out = raw.write(header, if payload { &junk } else { &[] });
        s.write_all(&out).await.expect(what);
        assert_eq!(raw::ack(&mut s).await, (i as u64 + 1, 2), "{what}: refused");
    }
    // The attacker's own grant works once (its write carries a checksum; it matches).
    let own = pattern(5, BYTES);
    let header = raw::header_with_checksum(
        6,
        1,
        BYTES as u64,
        imm(1, 7),
        Some(kvx_io::chunk_checksum(&own)),
    );
    s.write_all(&raw.write(header, &own))
        .await
        .expect("own write");
    assert_eq!(raw::ack(&mut s).await, (6, 0), "its own grant");
    let l = step("landed", listener.landed.recv()).await.expect("open");
    assert_eq!(
        (l.peer, l.slot),
        (attacker, SlotIndex(1)),
        "the only notice is the attacker's write into its own slot"
    );
    // A second write under the same grant is refused.
    let out = raw.write(raw::header(7, 1, BYTES as u64, imm(1, 7)), &own);
    s.write_all(&out).await.expect("second write");
    assert_eq!(raw::ack(&mut s).await, (7, 2), "a grant admits one write");

    // The victim's slot is untouched, nothing else was announced, and the victim's own
    // write lands.
    let mut got = vec![0u8; BYTES];
    listener.memory.read_slot(0, &mut got);
    assert!(
        got.iter().all(|&b| b == 0),
        "no byte of the victim's slot changed"
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(100), listener.landed.recv())
            .await
            .is_err(),
        "no refused write is announced"
    );
    assert!(listener.access.refused() >= 6, "refusals are counted");
    let staging = f
        .allocate_staging(SlotGeometry::new(1, BYTES).expect("a geometry"))
        .expect("staging");
    let mine = pattern(1, BYTES);
    staging.write_slot(0, &mine);
    let mut conn = step(
        "connect",
        f.connect(&ep, staging, listener.access.credential_for(victim)),
    )
    .await
    .expect("connect");
    conn.post(granted(&listener.access, victim, 1, 0, 0, 7, &mine))
        .expect("post");
    assert_eq!(completion(&mut conn, "victim's write").await.result, Ok(()));
    let l = step("landed", listener.landed.recv()).await.expect("open");
    assert_eq!((l.peer, l.slot), (victim, SlotIndex(0)));
    assert_eq!(l.checksum, kvx_io::ChecksumCheck::Match);
    listener.memory.read_slot(0, &mut got);
    assert!(got == mine);
}

/// A write outliving its grant (the defect a second hostile review found: 188 corrupt chunks
/// read by a decoder in a run of 3,000 requests). A peer starts a write into the slot it
/// holds, stops half-way, and its grant is revoked (a cancel claiming `drained`, or a
/// quarantine's end); the slot is granted to another sender, whose whole chunk lands and
/// passes its checksum; then the first peer sends the rest of its payload. That rest is read
/// past and acked as refused (2): the slot holds the second sender's bytes, and only its write
/// is announced. Deterministic: each step waits (bounded) for the one before it to be seen.
/// Over TCP only, where a payload follows its header and can stop half-way.
pub async fn a_write_never_outlives_its_grant<F: Fabric>(f: &F, endpoint: &str, magic: &[u8; 4]) {
    const BYTES: usize = 64 << 10;
    let mut listener = f
        .expose(endpoint, SlotGeometry::new(1, BYTES).expect("a geometry"))
        .await
        .expect("expose");
    let ep = listener.local_endpoint.clone();
    let (attacker, victim) = (PeerId(1), PeerId(2));
    listener.access.grant(0, attacker, 1);

    let mut s = TcpStream::connect(&ep).await.expect("raw connect");
    let credential = listener.access.credential_for(attacker);
    s.write_all(&raw::hello(magic, 1, BYTES as u64, &credential))
        .await
        .expect("hello");
    assert_eq!(raw::welcome(&mut s).await.0, 0, "attached");
    let junk = vec![0xEEu8; BYTES];
    let half = BYTES / 2;
    let mut first = raw::header(1, 0, BYTES as u64, imm(0, 1));
    first.extend_from_slice(&junk[..half]);
    s.write_all(&first).await.expect("half a write");
    // The receiver has read the first half into the slot (its grant stood then).
    step("the first half to land", async {
        let mut got = vec![0u8; BYTES];
        loop {
            listener.memory.read_slot(0, &mut got);
            if got[..half].iter().all(|&b| b == 0xEE) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;

    // Revoked, then granted to the victim, whose whole chunk lands and checks out.
    listener.access.apply(kvx_proto::slots::GrantChange {
        slot: SlotIndex(0),
        grant: None,
    });
    let staging = f
        .allocate_staging(SlotGeometry::new(1, BYTES).expect("a geometry"))
        .expect("staging");
    let mine = pattern(2, BYTES);
    staging.write_slot(0, &mine);
    let mut conn = step(
        "connect",
        f.connect(&ep, staging, listener.access.credential_for(victim)),
    )
    .await
    .expect("connect");
    conn.post(granted(&listener.access, victim, 1, 0, 0, 2, &mine))
        .expect("post");
    assert_eq!(completion(&mut conn, "victim's write").await.result, Ok(()));
    let l = step("landed", listener.landed.recv()).await.expect("open");
    assert_eq!((l.peer, l.slot), (victim, SlotIndex(0)));
    assert_eq!(l.checksum, kvx_io::ChecksumCheck::Match);

    // The rest of the revoked write arrives.
    s.write_all(&junk[half..]).await.expect("the rest");
    assert_eq!(
        raw::ack(&mut s).await,
        (1, 2),
        "the rest of a revoked write is refused"
    );
    let mut got = vec![0u8; BYTES];
    listener.memory.read_slot(0, &mut got);
    assert!(
        got == mine,
        "the slot holds the victim's chunk: {} bytes differ",
        got.iter().zip(&mine).filter(|(a, b)| a != b).count()
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(100), listener.landed.recv())
            .await
            .is_err(),
        "the revoked write is not announced"
    );
    // The connection stays usable: the attacker's next write under a grant of its own lands.
    listener.access.grant(0, attacker, 3);
    let own = pattern(3, BYTES);
    let mut next = raw::header(2, 0, BYTES as u64, imm(0, 3));
    next.extend_from_slice(&own);
    s.write_all(&next).await.expect("next write");
    assert_eq!(
        raw::ack(&mut s).await,
        (2, 0),
        "its next write, under a grant of its own"
    );
}
