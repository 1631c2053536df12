//! CURVE (RFC 26) on kvx's ZMQ sockets, live on loopback: kvx against kvx (the handshake, the
//! authenticated key per peer, refusals counted), and against libzmq's own CURVE through
//! pyzmq, both ways, with certificates written by each side and read by the other. The pyzmq
//! cases are skipped, with a message, where python3 lacks pyzmq, unless KVX_REQUIRE_PYTHON=1
//! (CI sets it, after installing it).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use bytes::Bytes;
use kvx_io::transport::{ClientEvent, ControlServer, TransportError};
use kvx_io::Transport;
use kvx_transport::zmq::{AllowList, CurveConfig, CurveKeyPair, ZmqConfig, ZmqTransport};

const STEP: Duration = Duration::from_secs(20);

async fn step<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(STEP, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {STEP:?}"))
}

fn transport(curve: Option<CurveConfig>) -> ZmqTransport {
    ZmqTransport::new(ZmqConfig {
        curve: curve.map(Box::new),
        connect_timeout: Duration::from_secs(3),
        ..ZmqConfig::default()
    })
    .expect("valid")
}

fn server_side(keys: &CurveKeyPair, allowed: &[&CurveKeyPair]) -> Option<CurveConfig> {
    Some(CurveConfig {
        keys: keys.clone(),
        allowed_clients: Some(AllowList::new(allowed.iter().map(|k| k.public()))),
        server_key: None,
    })
}

fn client_side(keys: &CurveKeyPair, server: &CurveKeyPair) -> Option<CurveConfig> {
    Some(CurveConfig {
        keys: keys.clone(),
        allowed_clients: None,
        server_key: Some(server.public()),
    })
}

/// Answers every request with `re:<payload>`, and reports each sender's proven key.
fn echo(t: &ZmqTransport, mut server: ControlServer) -> tokio::sync::mpsc::Receiver<[u8; 32]> {
    let (keys, rx) = tokio::sync::mpsc::channel(16);
    let t = t.clone();
    tokio::spawn(async move {
        while let Some((peer, payload)) = server.recv().await {
            let key = t.peer_public_key(peer).unwrap_or([0; 32]);
            let _ = keys.try_send(key);
            let mut reply = b"re:".to_vec();
            reply.extend_from_slice(&payload);
            if server.send(peer, Bytes::from(reply)).await.is_err() {
                return;
            }
        }
    });
    rx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvx_to_kvx_over_curve_with_the_key_as_principal() {
    let (server_keys, client_keys) = (CurveKeyPair::generate(), CurveKeyPair::generate());
    let ts = transport(server_side(&server_keys, &[&client_keys]));
    let server = ts.serve("tcp://127.0.0.1:0").await.expect("bind");
    let endpoint = server.local_endpoint().to_owned();
    let mut keys = echo(&ts, server);
    let mut notices = ts.notify_source("tcp://127.0.0.1:0").await.expect("bind");

    let tc = transport(client_side(&client_keys, &server_keys));
    let mut client = step("connect", tc.connect(&endpoint, "s0-to-r0"))
        .await
        .expect("connect");
    for i in 0..3 {
        let payload = Bytes::from(format!("request {i} {}", "x".repeat(i * 200)));
        client.send(payload.clone()).await.expect("send");
        let mut want = b"re:".to_vec();
        want.extend_from_slice(&payload);
        assert_eq!(
            step("reply", client.recv()).await,
            Some(ClientEvent::Message(Bytes::from(want)))
        );
        assert_eq!(
            step("key", keys.recv()).await,
            Some(client_keys.public()),
            "the ROUTER names the key the DEALER proved"
        );
    }
    let sink = step("push", tc.notify_sink(notices.local_endpoint()))
        .await
        .expect("connect");
    sink.send(Bytes::from_static(b"done")).await.expect("send");
    assert_eq!(
        step("notice", notices.recv()).await,
        Some(Bytes::from_static(b"done"))
    );
    assert_eq!(ts.stats().curve_refused, 0);
    assert_eq!(tc.stats().curve_refused, 0);
}

/// Waits (at most `STEP`) until `count()` is `want`: a server counts a refusal in its own task,
/// which may run after the refused client has returned.
async fn counted(what: &str, want: u64, count: impl Fn() -> u64) {
    let deadline = tokio::time::Instant::now() + STEP;
    while count() != want {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: {} counted, not {want}",
            count()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_counted_and_say_why() {
    let (server_keys, allowed, stranger) = (
        CurveKeyPair::generate(),
        CurveKeyPair::generate(),
        CurveKeyPair::generate(),
    );
    let ts = transport(server_side(&server_keys, &[&allowed]));
    let server = ts.serve("tcp://127.0.0.1:0").await.expect("bind");
    let endpoint = server.local_endpoint().to_owned();
    let _keys = echo(&ts, server);

    let refused = |r: Result<_, TransportError>| match r {
        Err(TransportError::Refused { why, .. }) => why,
        Err(e) => panic!("refused, not {e}"),
        Ok(_) => panic!("refused, not connected"),
    };
    // A client whose key is not on the allow-list.
    let t = transport(client_side(&stranger, &server_keys));
    let why = refused(step("stranger", t.connect(&endpoint, "s1")).await);
    assert!(why.contains("allow-list"), "{why}");
    // A NULL client against the CURVE server.
    let t = transport(None);
    let why = refused(step("null", t.connect(&endpoint, "s2")).await);
    assert!(why.contains("CURVE"), "{why}");
    assert_eq!(t.stats().curve_refused, 1);
    // A client holding the wrong server key.
    let t = transport(client_side(&allowed, &stranger));
    refused(step("wrong server key", t.connect(&endpoint, "s3")).await);
    counted("the CURVE server", 3, || ts.stats().curve_refused).await;
    assert_eq!(ts.stats().handshakes_failed, 0);

    // A CURVE client against a NULL server.
    let tn = transport(None);
    let plain = tn.serve("tcp://127.0.0.1:0").await.expect("bind");
    let t = transport(client_side(&allowed, &server_keys));
    let why = refused(step("curve to null", t.connect(plain.local_endpoint(), "s4")).await);
    assert!(why.contains("NULL"), "{why}");
    assert_eq!(t.stats().curve_refused, 1);
    counted("the NULL server", 1, || tn.stats().curve_refused).await;
}

/// The principal a ROUTER names for each peer (`ControlServer::principal`, what the receiver
/// binds shares to): under CURVE one per proven key, whatever the identity; without CURVE one
/// per source address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn principals_follow_the_key_not_the_identity() {
    let (server_keys, a, b) = (
        CurveKeyPair::generate(),
        CurveKeyPair::generate(),
        CurveKeyPair::generate(),
    );
    for curve in [true, false] {
        let ts = transport(if curve {
            server_side(&server_keys, &[&a, &b])
        } else {
            None
        });
        let mut server = ts.serve("tcp://127.0.0.1:0").await.expect("bind");
        let endpoint = server.local_endpoint().to_owned();
        let (mut principals, mut connected) = (Vec::new(), Vec::new());
        for (keys, identity) in [(&a, "a-1"), (&a, "a-2"), (&b, "b-1")] {
            let t = transport(curve.then(|| client_side(keys, &server_keys)).flatten());
            let client = step("connect", t.connect(&endpoint, identity))
                .await
                .expect("connect");
            client.send(Bytes::from_static(b"hi")).await.expect("send");
            let (peer, _) = step("request", server.recv()).await.expect("a request");
            principals.push(server.principal(peer).expect("a principal"));
            assert_eq!(
                ts.peer_public_key(peer),
                curve.then(|| keys.public()),
                "the key it proved"
            );
            assert_eq!(
                ts.peer_source(peer),
                Some(std::net::IpAddr::from([127, 0, 0, 1]))
            );
            connected.push(client); // each stays connected, holding its identity
        }
        assert_eq!(
            principals[0], principals[1],
            "one key (or address), one principal"
        );
        if curve {
            assert_ne!(
                principals[0], principals[2],
                "another key, another principal"
            );
        } else {
            assert_eq!(principals[0], principals[2], "one address, one principal");
        }
    }
}

/// Under CURVE an identity belongs to the key that first presented it: another allowed key
/// presenting it after the first key's connection ended is refused, with the reason, and
/// the first key gets it back; its `PeerId` (and every right bound to it) never changes
/// hands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_identity_belongs_to_the_key_that_first_presented_it() {
    let (server_keys, a, b) = (
        CurveKeyPair::generate(),
        CurveKeyPair::generate(),
        CurveKeyPair::generate(),
    );
    let ts = transport(server_side(&server_keys, &[&a, &b]));
    let mut server = ts.serve("tcp://127.0.0.1:0").await.expect("bind");
    let endpoint = server.local_endpoint().to_owned();
    let ta = transport(client_side(&a, &server_keys));
    let first = step("a connects", ta.connect(&endpoint, "s0"))
        .await
        .expect("a connects");
    first.send(Bytes::from_static(b"hi")).await.expect("send");
    let (peer, _) = step("a's request", server.recv()).await.expect("a request");
    drop(first);
    // A's connection is gone; B presents A's identity.
    let tb = transport(client_side(&b, &server_keys));
    let mut refused = None;
    for _ in 0..50 {
        match step("b connects", tb.connect(&endpoint, "s0")).await {
            // A's connection may still hold the identity for a moment.
            Err(TransportError::Refused { why, .. }) if why.contains("another connection") => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(TransportError::Refused { why, .. }) => {
                refused = Some(why);
                break;
            }
            other => panic!("b refused, not {:?}", other.map(|_| "connected")),
        }
    }
    let why = refused.expect("b refused within a second");
    assert!(why.contains("another CURVE key"), "{why}");
    counted("identities refused", 1, || ts.stats().identities_refused).await;
    // A gets its identity back, with its PeerId.
    let again = step("a reconnects", ta.connect(&endpoint, "s0"))
        .await
        .expect("a reconnects");
    again
        .send(Bytes::from_static(b"again"))
        .await
        .expect("send");
    let (same, _) = step("a's request", server.recv()).await.expect("a request");
    assert_eq!(same, peer, "the identity's PeerId stays the key's");
}

#[test]
fn curve_settings_are_validated() {
    let keys = CurveKeyPair::generate();
    let neither = ZmqConfig {
        curve: Some(Box::new(CurveConfig {
            keys: keys.clone(),
            allowed_clients: None,
            server_key: None,
        })),
        ..ZmqConfig::default()
    };
    assert!(neither.validate().is_err());
    let empty = ZmqConfig {
        curve: Some(Box::new(CurveConfig {
            keys,
            allowed_clients: Some(AllowList::new([])),
            server_key: None,
        })),
        ..ZmqConfig::default()
    };
    assert!(empty.validate().is_err());
}

// ---------------------------------------------------------------------------------------
// libzmq (pyzmq)

fn pyzmq_ready() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import zmq, zmq.auth; assert zmq.has('curve')"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var_os("KVX_REQUIRE_PYTHON").is_none(),
            "KVX_REQUIRE_PYTHON is set but python3 lacks pyzmq with CURVE"
        );
        eprintln!("skipped: python3 with pyzmq (CURVE) is not available (pip install pyzmq)");
    }
    ok
}

/// Runs a pyzmq script (which stops itself after 30 s) and returns its output; bounded here
/// too.
async fn python(script: &str, args: &[&Path]) -> Output {
    let child = Command::new("python3")
        .arg("-c")
        .arg(format!("import signal; signal.alarm(30)\n{script}"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let out = tokio::time::timeout(
        Duration::from_secs(45),
        tokio::task::spawn_blocking(move || child.wait_with_output()),
    )
    .await
    .expect("python within 45 s")
    .expect("joined")
    .expect("waited");
    eprintln!("python: {}", String::from_utf8_lossy(&out.stderr));
    out
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvx-curve-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    dir
}

/// pyzmq's `zmq.auth.create_certificates(dir, name)`.
const CREATE_CERTS: &str = r#"
import sys, zmq.auth
zmq.auth.create_certificates(sys.argv[1], sys.argv[2])
"#;

/// A pyzmq DEALER with the CURVE certificate `argv[1]` (its `.key_secret`), to a server whose
/// public certificate is `argv[2]`, at `argv[3]`: sends one request and prints the reply, or
/// `no reply` after 3 s.
const PYZMQ_DEALER: &str = r#"
import sys, zmq, zmq.auth
public, secret = zmq.auth.load_certificate(sys.argv[1])
server, _ = zmq.auth.load_certificate(sys.argv[2])
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.curve_publickey, s.curve_secretkey, s.curve_serverkey = public, secret, server
s.identity = b"py-dealer"
s.linger = 0
s.connect(sys.argv[3])
s.send_multipart([b"", b"hello from libzmq"])
if s.poll(3000):
    print("reply", s.recv_multipart()[-1].decode(), flush=True)
else:
    print("no reply", flush=True)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_dealers_against_a_kvx_router() {
    if !pyzmq_ready() {
        return;
    }
    let dir = temp_dir("router");
    let server_keys = CurveKeyPair::generate();
    let (server_public, _) = server_keys
        .write_certificates(&dir, "server")
        .expect("written");
    let clients = dir.join("clients");
    let strangers = dir.join("strangers");
    for (d, name) in [(&clients, "client"), (&strangers, "stranger")] {
        std::fs::create_dir_all(d).expect("mkdir");
        let out = python(CREATE_CERTS, &[d, Path::new(name)]).await;
        assert!(out.status.success(), "pyzmq wrote certificates");
    }
    // kvx reads pyzmq's certificates: the allow-list, and the client key to compare.
    let allowed = AllowList::load_dir(&clients).expect("pyzmq's certificates read");
    let client_public =
        kvx_transport::zmq::load_public_key(&clients.join("client.key")).expect("read");
    assert!(allowed.contains(&client_public));

    let ts = transport(Some(CurveConfig {
        keys: server_keys,
        allowed_clients: Some(allowed),
        server_key: None,
    }));
    let server = ts.serve("tcp://127.0.0.1:0").await.expect("bind");
    let endpoint = server.local_endpoint().to_owned();
    let mut keys = echo(&ts, server);

    let out = python(
        PYZMQ_DEALER,
        &[
            &clients.join("client.key_secret"),
            &server_public,
            Path::new(&endpoint),
        ],
    )
    .await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "reply re:hello from libzmq"
    );
    assert_eq!(step("key", keys.recv()).await, Some(client_public));

    // A pyzmq client whose key is not on the allow-list never gets a request through.
    let out = python(
        PYZMQ_DEALER,
        &[
            &strangers.join("stranger.key_secret"),
            &server_public,
            Path::new(&endpoint),
        ],
    )
    .await;
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "no reply");
    assert!(keys.try_recv().is_err(), "no request reached the server");
    assert!(ts.stats().curve_refused >= 1, "{:?}", ts.stats());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A pyzmq ROUTER and PULL as CURVE servers (certificate `argv[1]`), admitting the clients
/// whose certificates are in `argv[2]` (pyzmq's `ThreadAuthenticator`): prints their ports,
/// answers one request with `re:<payload>:<identity>`, prints the one notice.
const PYZMQ_SERVERS: &str = r#"
import sys, zmq, zmq.auth
from zmq.auth.thread import ThreadAuthenticator
public, secret = zmq.auth.load_certificate(sys.argv[1])
ctx = zmq.Context()
auth = ThreadAuthenticator(ctx)
auth.start()
auth.configure_curve(domain="*", location=sys.argv[2])
router = ctx.socket(zmq.ROUTER)
pull = ctx.socket(zmq.PULL)
for s in (router, pull):
    s.curve_secretkey, s.curve_publickey, s.curve_server = secret, public, True
    s.linger = 0
rport = router.bind_to_random_port("tcp://127.0.0.1")
pport = pull.bind_to_random_port("tcp://127.0.0.1")
print(rport, pport, flush=True)
router.RCVTIMEO = pull.RCVTIMEO = 15000
ident, delim, payload = router.recv_multipart()
router.send_multipart([ident, b"", b"re:" + payload + b":" + ident + b"x" * 300])
print("notice", pull.recv().decode(), flush=True)
auth.stop()
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvx_dealer_and_push_against_pyzmq_curve_servers() {
    use std::io::{BufRead, BufReader};
    if !pyzmq_ready() {
        return;
    }
    let dir = temp_dir("dealer");
    let server = dir.join("server");
    let clients = dir.join("clients");
    std::fs::create_dir_all(&server).expect("mkdir");
    let out = python(CREATE_CERTS, &[&server, Path::new("server")]).await;
    assert!(out.status.success(), "pyzmq wrote certificates");
    // kvx's own certificate, read by pyzmq's authenticator.
    std::fs::create_dir_all(&clients).expect("mkdir");
    let client_keys = CurveKeyPair::generate();
    let (_, client_secret) = client_keys
        .write_certificates(&clients, "kvx-sender")
        .expect("written");
    let server_public =
        kvx_transport::zmq::load_public_key(&server.join("server.key")).expect("read");
    assert_eq!(
        CurveKeyPair::load(&client_secret).expect("reads its own"),
        client_keys
    );

    let mut peer = Command::new("python3")
        .arg("-c")
        .arg(format!("import signal; signal.alarm(30)\n{PYZMQ_SERVERS}"))
        .arg(server.join("server.key_secret"))
        .arg(&clients)
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let mut lines = BufReader::new(peer.stdout.take().expect("stdout")).lines();
    let ports = lines.next().expect("ports line").expect("read");
    let (rport, pport) = ports.split_once(' ').expect("two ports");

    let t = transport(Some(CurveConfig {
        keys: client_keys,
        allowed_clients: None,
        server_key: Some(server_public),
    }));
    let run = async {
        let mut client = t
            .connect(&format!("tcp://127.0.0.1:{rport}"), "s0-to-r0")
            .await
            .expect("connect");
        client
            .send(Bytes::from_static(b"request"))
            .await
            .expect("send");
        let want = format!("re:request:s0-to-r0{}", "x".repeat(300));
        assert_eq!(
            client.recv().await,
            Some(ClientEvent::Message(Bytes::from(want)))
        );
        let sink = t
            .notify_sink(&format!("tcp://127.0.0.1:{pport}"))
            .await
            .expect("connect");
        sink.send(Bytes::from_static(b"ready")).await.expect("send");
    };
    step("kvx against pyzmq", run).await;
    let notice = tokio::time::timeout(STEP, tokio::task::spawn_blocking(move || lines.next()))
        .await
        .expect("bounded")
        .expect("reader");
    let _ = peer.kill();
    let _ = peer.wait();
    assert_eq!(
        notice.map(|l| l.expect("read")).as_deref(),
        Some("notice ready")
    );
    assert_eq!(t.stats().curve_refused, 0);
    let _ = std::fs::remove_dir_all(&dir);
}
