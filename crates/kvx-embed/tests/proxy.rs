//! `kvx_embed::Proxy` over ZeroMQ on loopback: notices from a real PUSH socket, awaited
//! through `expect` with bounded blocking waits, or reported as events when standalone.

use std::time::Duration;

use bytes::Bytes;
use kvx_embed::{Proxy, Runtime, TransportChoice};
use kvx_io::Transport;
use kvx_proto::proxy::{ProxyEvent, ProxyFailure};
use kvx_proto::wire::{self, FailNotif, Message, ProxyNotif};
use kvx_proto::ProxyConfig;
use kvx_transport::zmq::{ZmqConfig, ZmqTransport};

const WAIT: Duration = Duration::from_secs(5);

fn notice(msg: Message) -> Bytes {
    Bytes::from(wire::encode(&msg))
}

#[test]
fn an_expected_request_is_ready_after_every_rank_and_a_failure_says_why() {
    let rt = Runtime::new(2).expect("runtime");
    let zmq = TransportChoice::Zmq(ZmqConfig::default());
    let proxy = Proxy::start(
        &rt,
        zmq,
        "tcp://127.0.0.1:0",
        ProxyConfig::default().validate().expect("valid"),
    )
    .expect("proxy");
    let mut ready = proxy.expect("r1", 2).expect("awaited");
    let mut failed = proxy.expect("r2", 1).expect("awaited");
    assert!(
        ready.wait(&rt, Duration::from_millis(50)).is_none(),
        "nothing yet"
    );
    let endpoint = proxy.endpoint().to_owned();
    rt.block_on(async {
        // One PUSH per TP rank, as each rank's sender process has its own: a connection
        // speaks for one rank of a request.
        let t = ZmqTransport::default();
        let mut ranks = Vec::new();
        for _ in 0..2 {
            ranks.push(t.notify_sink(&endpoint).await.expect("push connects"));
        }
        for sink in &ranks {
            let n = ProxyNotif {
                req_id: "r1".into(),
            };
            sink.send(notice(Message::ProxyNotif(n)))
                .await
                .expect("sent");
        }
        let sink = &ranks[0];
        let f = FailNotif {
            req_id: "r2".into(),
            reason: "refused by the receiver".into(),
        };
        sink.send(notice(Message::FailNotif(f)))
            .await
            .expect("sent");
    });
    assert_eq!(ready.wait(&rt, WAIT), Some(Ok(())));
    assert_eq!(
        failed.wait(&rt, WAIT),
        Some(Err(ProxyFailure::Reported(
            "refused by the receiver".into()
        )))
    );
}

#[test]
fn a_standalone_proxy_reports_each_request_as_an_event() {
    let rt = Runtime::new(1).expect("runtime");
    let cfg = ProxyConfig {
        await_on_first_notice: Some(1),
        ..ProxyConfig::default()
    };
    let zmq = TransportChoice::Zmq(ZmqConfig::default());
    let proxy = Proxy::start(
        &rt,
        zmq,
        "tcp://127.0.0.1:0",
        cfg.validate().expect("valid"),
    )
    .expect("proxy");
    assert_eq!(proxy.next_event(Duration::from_millis(50)), None);
    let endpoint = proxy.endpoint().to_owned();
    rt.block_on(async {
        let sink = ZmqTransport::default()
            .notify_sink(&endpoint)
            .await
            .expect("push connects");
        let n = ProxyNotif {
            req_id: "s1".into(),
        };
        sink.send(notice(Message::ProxyNotif(n)))
            .await
            .expect("sent");
    });
    assert_eq!(
        proxy.next_event(WAIT),
        Some(ProxyEvent::Ready {
            req_id: "s1".into()
        })
    );
}
