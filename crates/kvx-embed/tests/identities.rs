//! Sender identities on one receiver: several senders in one process, each with an identity
//! of its own from `unique_local_id`, all deliver; a sender whose identity another sender's
//! connection holds is refused at `add_receiver`, with the receiver's reason and as a
//! refusal (`EmbedError::is_refused`), not as a lost connection.

// A test bounds and measures its own waits with the wall clock; the crate's rule against
// clock reads (`clippy.toml`) is for the library.
#![allow(clippy::disallowed_methods)]

mod waits;
use waits::Waits;

use std::time::{Duration, Instant};

use kvx_embed::{
    unique_local_id, EnvChoice, Memory, Receiver, ReceiverSettings, Runtime, Sender, SenderSettings,
};
use kvx_node::ReceiverAddr;
use kvx_proto::sender::RequestSpec;
use kvx_proto::{ReceiverConfig, ReqId, SenderConfig};

const SLOT: usize = 1024;
const WAIT: Duration = Duration::from_secs(10);

fn receiver(rt: &Runtime) -> Receiver {
    Receiver::start(
        rt,
        ReceiverSettings {
            env: EnvChoice::zmq_tcp(),
            config: ReceiverConfig {
                buffer_slots: 16,
                peer_share_percent: 100,
                ..ReceiverConfig::default()
            }
            .validate()
            .expect("valid"),
            buffer: Memory::Allocate { slot_bytes: SLOT },
            alloc_endpoint: "tcp://127.0.0.1:0".into(),
            fabric_endpoint: "tcp://127.0.0.1:0".into(),
        },
    )
    .expect("receiver starts")
}

fn sender(rt: &Runtime, local_id: String) -> Sender {
    Sender::start(
        rt,
        SenderSettings {
            env: EnvChoice::zmq_tcp(),
            config: SenderConfig {
                staging_slots: 2,
                ..SenderConfig::default()
            }
            .validate()
            .expect("valid"),
            staging: Memory::Allocate { slot_bytes: SLOT },
            local_id,
            proxy: None,
        },
    )
    .expect("sender starts")
}

fn addr(r: &Receiver) -> ReceiverAddr {
    ReceiverAddr {
        alloc: r.alloc_endpoint().to_owned(),
        fabric: r.fabric_endpoint().to_owned(),
    }
}

#[test]
fn four_senders_in_one_process_with_default_identities_all_deliver() {
    let rt = Runtime::new(2).expect("runtime");
    let rx = receiver(&rt);
    let senders: Vec<Sender> = (0..4)
        .map(|_| sender(&rt, unique_local_id("kvx-embed-test").expect("an identity")))
        .collect();
    let mut ids = Vec::new();
    for (s, sender) in senders.iter().enumerate() {
        let peer = sender
            .add_receiver(addr(&rx), WAIT)
            .unwrap_or_else(|e| panic!("sender {s} connects: {e}"));
        let id = ReqId(format!("req-{s}"));
        sender
            .handle()
            .begin(RequestSpec {
                req_id: id.clone(),
                receiver: peer,
                total_chunks: 1,
                fmt: 1,
                shape: vec![1],
                dtype: "bfloat16".into(),
                claim: None,
            })
            .expect("begins");
        assert!(
            sender.wait_admitted(&id, WAIT).expect("admitted"),
            "sender {s}"
        );
        let guard = sender.allocate(&id, Some(WAIT)).expect("staging");
        guard.with_slot(&mut |bytes| bytes.fill(s as u8));
        sender
            .add(guard, format!("req-{s}@0"), SLOT, 1)
            .expect("added");
        sender.handle().submit_added(&id, true).expect("submitted");
        ids.push(id);
    }
    // The decoder's side: every request ready, then consumed (bounded in count and time).
    let mut consumed = 0;
    let deadline = Instant::now() + WAIT;
    while consumed < 4 && Instant::now() < deadline {
        for lease in rx
            .next_ready(4, Duration::from_millis(200))
            .expect("the receiver runs")
        {
            lease.consume(WAIT).expect("consumed");
            consumed += 1;
        }
    }
    assert_eq!(consumed, 4, "every sender's request reached the receiver");
    for (s, (sender, id)) in senders.iter().zip(&ids).enumerate() {
        let outcome = sender
            .wait_outcome(id, WAIT)
            .expect("an outcome within 10 s");
        assert_eq!(outcome, Ok(()), "sender {s}");
    }
}

#[test]
fn a_second_sender_under_a_held_identity_is_refused_and_told_why() {
    let rt = Runtime::new(2).expect("runtime");
    let rx = receiver(&rt);
    let first = sender(&rt, "the-same-id".into());
    first
        .add_receiver(addr(&rx), WAIT)
        .expect("the first connects");
    let second = sender(&rt, "the-same-id".into());
    let err = second
        .add_receiver(addr(&rx), WAIT)
        .expect_err("the second is refused");
    assert!(err.is_refused(), "a refusal, not {err:?}");
    let text = err.to_string();
    assert!(text.contains("another connection holds it"), "{text}");
    // The first keeps its connection.
    first
        .add_receiver(addr(&rx), WAIT)
        .expect("the first is still connected");
}
