//! `kvx_embed::Sender` and `Receiver` over ZeroMQ and the TCP fabric on loopback, with
//! staging and receive buffer in memory the test owns: the worked example (one sender
//! interleaving two 8-chunk requests into a 10-slot buffer) delivered byte for byte, request
//! ends polled in batches, guards that hand back what they hold when dropped, and a `ready`
//! future dropped mid-lease that leaves its request to the next call.

// A test bounds and measures its own waits with the wall clock; the crate's rule against
// clock reads (`clippy.toml`) is for the library.
#![allow(clippy::disallowed_methods)]
#![allow(unsafe_code)] // the test lends its own memory (`ExternalRegion::new`)

mod waits;
use waits::Waits;

use std::cell::UnsafeCell;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use kvx_embed::{EnvChoice, Memory, Receiver, ReceiverSettings, Runtime, Sender, SenderSettings};
use kvx_io::ExternalRegion;
use kvx_node::ReceiverAddr;
use kvx_proto::sender::RequestSpec;
use kvx_proto::{PeerId, ReceiverConfig, ReqId, SenderConfig};

const SLOT: usize = 4096;
const WAIT: Duration = Duration::from_secs(10);

/// Bytes the test lends kvx; it reads them only once kvx is done with a slot.
struct Lent(Vec<UnsafeCell<u8>>);
// SAFETY: reached through kvx's region (its locks) and, for reads of a leased slot, by the
// test thread while nothing writes it.
unsafe impl Send for Lent {}
// SAFETY: as above.
unsafe impl Sync for Lent {}

fn lend(slots: u32) -> (ExternalRegion, Arc<Lent>) {
    let bytes = Arc::new(Lent(
        (0..slots as usize * SLOT)
            .map(|_| UnsafeCell::new(0))
            .collect(),
    ));
    let ptr = UnsafeCell::raw_get(bytes.0.as_ptr());
    // SAFETY: valid for the vector's length while the owner (a clone of the Arc) lives.
    let region = unsafe { ExternalRegion::new(ptr, bytes.0.len(), SLOT, Box::new(bytes.clone())) }
        .expect("a valid region");
    (region, bytes)
}

fn pattern(req: &str, chunk: usize) -> Vec<u8> {
    let seed = req
        .bytes()
        .fold(chunk as u8, |a, b| a.wrapping_mul(31).wrapping_add(b));
    (0..SLOT)
        .map(|i| seed.wrapping_add((i % 251) as u8))
        .collect()
}

struct Pair {
    rt: Runtime,
    sender: Sender,
    receiver: Receiver,
    peer: PeerId,
    buffer: Arc<Lent>,
}

fn pair(buffer_slots: u32, staging_slots: u32) -> Pair {
    let rt = Runtime::new(2).expect("runtime");
    let (buffer_region, buffer) = lend(buffer_slots);
    let receiver = Receiver::start(
        &rt,
        ReceiverSettings {
            env: EnvChoice::zmq_tcp(),
            config: ReceiverConfig {
                buffer_slots,
                peer_share_percent: 100,
                ..ReceiverConfig::default()
            }
            .validate()
            .expect("valid"),
            buffer: Memory::External(buffer_region),
            alloc_endpoint: "tcp://127.0.0.1:0".into(),
            fabric_endpoint: "tcp://127.0.0.1:0".into(),
        },
    )
    .expect("receiver starts");
    let (staging_region, _) = lend(staging_slots);
    let sender = Sender::start(
        &rt,
        SenderSettings {
            env: EnvChoice::zmq_tcp(),
            config: SenderConfig {
                staging_slots,
                ..SenderConfig::default()
            }
            .validate()
            .expect("valid"),
            staging: Memory::External(staging_region),
            local_id: "embed-test".into(),
            proxy: None,
        },
    )
    .expect("sender starts");
    let addr = ReceiverAddr {
        alloc: receiver.alloc_endpoint().to_owned(),
        fabric: receiver.fabric_endpoint().to_owned(),
    };
    let peer = sender.add_receiver(addr, WAIT).expect("connects");
    Pair {
        rt,
        sender,
        receiver,
        peer,
        buffer,
    }
}

fn spec(id: &str, receiver: PeerId, chunks: u32) -> RequestSpec {
    RequestSpec {
        req_id: ReqId(id.into()),
        receiver,
        total_chunks: chunks,
        fmt: 1,
        shape: vec![1],
        dtype: "bfloat16".into(),
        claim: None,
    }
}

#[test]
fn two_interleaved_requests_arrive_byte_exact_in_a_buffer_smaller_than_both() {
    let p = pair(10, 4);
    let ids = ["a", "b"];
    // The second request waits for admission until the first is consumed: 8 + 8 > 10.
    for id in ids {
        p.sender
            .handle()
            .begin(spec(id, p.peer, 8))
            .expect("begins");
    }
    let decoder = std::thread::scope(|scope| {
        let decoder = scope.spawn(|| {
            let mut seen = Vec::new();
            for _ in 0..100 {
                for lease in p
                    .receiver
                    .next_ready(4, Duration::from_millis(200))
                    .expect("the receiver runs")
                {
                    let id = lease.key().req_id.0.clone();
                    for chunk in 0..lease.slots().len() {
                        let slot = lease.slots()[chunk].0 as usize;
                        // The test's own view of its buffer, as a framework reads its tensor.
                        // SAFETY: the lease pins the slot; nothing writes it until consumed.
                        let got: Vec<u8> = (0..SLOT)
                            .map(|i| unsafe { *p.buffer.0[slot * SLOT + i].get() })
                            .collect();
                        assert!(got == pattern(&id, chunk), "{id} chunk {chunk} byte-exact");
                        let mut through_kvx = Vec::new();
                        lease.with_chunk(chunk, &mut |b| through_kvx = b.to_vec());
                        assert!(through_kvx == got, "the same bytes through the lease");
                    }
                    lease.consume(WAIT).expect("consumed");
                    seen.push(id);
                }
                if seen.len() == 2 {
                    break;
                }
            }
            seen
        });
        // One prefill thread interleaving the two requests chunk by chunk, batches of two.
        let mut next = [0usize; 2];
        let mut admitted = [false; 2];
        for _ in 0..10_000 {
            if next == [8, 8] {
                break;
            }
            for (r, id) in ids.iter().enumerate() {
                let req_id = ReqId((*id).into());
                if next[r] == 8 {
                    continue;
                }
                if !admitted[r] {
                    admitted[r] = p
                        .sender
                        .wait_admitted(&req_id, Duration::from_millis(20))
                        .expect("not failed");
                    if !admitted[r] {
                        continue;
                    }
                }
                let guard = p.sender.allocate(&req_id, Some(WAIT)).expect("staging");
                let bytes = pattern(id, next[r]);
                guard.with_slot(&mut |slot| slot.copy_from_slice(&bytes));
                p.sender
                    .add(guard, format!("{id}@{}", next[r]), SLOT, 256)
                    .expect("added");
                next[r] += 1;
                if next[r] % 2 == 0 {
                    p.sender
                        .handle()
                        .submit_added(&req_id, next[r] == 8)
                        .expect("submitted");
                }
            }
        }
        assert_eq!(next, [8, 8], "every chunk staged");
        decoder.join().expect("decoder")
    });
    assert_eq!(decoder.len(), 2, "both requests read: {decoder:?}");
    let mut ends = Vec::new();
    for _ in 0..50 {
        ends.extend(p.sender.next_ends(8, Duration::from_millis(200)));
        if ends.len() == 2 {
            break;
        }
    }
    ends.sort_by(|x, y| x.req_id.cmp(&y.req_id));
    assert_eq!(
        ends.iter()
            .map(|e| (e.req_id.0.as_str(), e.outcome.clone()))
            .collect::<Vec<_>>(),
        vec![("a", Ok(())), ("b", Ok(()))],
        "each request's end, once"
    );
    let snap = p.receiver.snapshot(WAIT).expect("snapshot");
    assert_eq!(
        (snap.free, snap.tracked_requests),
        (10, 0),
        "nothing held: {snap:?}"
    );
    assert_eq!(p.sender.handle().staging_free(), 4, "all staging back");
    drop(p.rt);
}

#[test]
fn a_dropped_guard_hands_its_slot_back_and_a_cancel_ends_the_request() {
    let p = pair(4, 2);
    let id = ReqId("c".into());
    p.sender
        .handle()
        .begin(spec("c", p.peer, 2))
        .expect("begins");
    assert!(p.sender.wait_admitted(&id, WAIT).expect("admitted"));
    let guard = p.sender.allocate(&id, Some(WAIT)).expect("staging");
    assert_eq!(p.sender.handle().staging_free(), 1);
    drop(guard);
    assert_eq!(
        p.sender.handle().staging_free(),
        2,
        "the unused slot came back"
    );
    let guard = p.sender.allocate(&id, Some(WAIT)).expect("staging again");
    assert!(
        p.sender.add(guard, "c@0".into(), SLOT + 1, 1).is_err(),
        "a chunk larger than its slot is refused"
    );
    p.sender.handle().cancel(&id).expect("cancelled");
    let ends = p.sender.next_ends(8, WAIT);
    assert_eq!(ends.len(), 1);
    assert!(ends[0].outcome.is_err(), "{ends:?}");
    let snap = (0..50)
        .filter_map(|_| {
            let s = p.receiver.snapshot(WAIT).ok()?;
            (s.free == 4).then_some(s).or_else(|| {
                std::thread::sleep(Duration::from_millis(20));
                None
            })
        })
        .next();
    assert!(
        snap.is_some(),
        "the receiver released the cancelled request"
    );
}

/// One thread interleaving five requests chunk by chunk, batches of four, over four staging
/// slots: the first four requests' first chunks take every slot, unsubmitted, and the fifth,
/// holding none, asks for one. The core submits the pending batches itself, at once, since
/// only they hold staging (S11), rather than letting the call wait out its timeout for
/// staging only its own caller can free.
#[test]
fn one_thread_interleaving_more_requests_than_staging_never_waits_on_itself() {
    let p = pair(40, 4);
    let ids = ["v", "w", "x", "y", "z"];
    for id in ids {
        p.sender
            .handle()
            .begin(spec(id, p.peer, 8))
            .expect("begins");
    }
    for id in ids {
        assert!(p
            .sender
            .wait_admitted(&ReqId(id.into()), WAIT)
            .expect("admitted"));
    }
    let started = std::time::Instant::now();
    for chunk in 0..8 {
        for id in ids {
            let req_id = ReqId(id.into());
            let guard = p
                .sender
                .allocate(&req_id, Some(Duration::from_secs(3)))
                .expect("staging without waiting on ourselves");
            let bytes = pattern(id, chunk);
            guard.with_slot(&mut |slot| slot.copy_from_slice(&bytes));
            p.sender
                .add(guard, format!("{id}@{chunk}"), SLOT, 256)
                .expect("added");
            if (chunk + 1) % 4 == 0 {
                p.sender
                    .handle()
                    .submit_added(&req_id, chunk == 7)
                    .expect("submitted");
            }
        }
    }
    for id in ids {
        assert_eq!(
            p.sender.wait_outcome(&ReqId(id.into()), WAIT),
            Some(Ok(())),
            "{id} delivered"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "no allocate waited out its timeout"
    );
    let mut read = 0;
    for _ in 0..50 {
        for lease in p
            .receiver
            .next_ready(8, Duration::from_millis(100))
            .expect("the receiver runs")
        {
            lease.consume(WAIT).expect("consumed");
            read += 1;
        }
        if read == ids.len() {
            break;
        }
    }
    assert_eq!(read, ids.len());
}

/// A call waits for staging while another thread holds every slot; that thread then adds
/// its chunks and never submits them. The add submits them (S11): the waiting call gets a
/// slot once their writes complete, not after its timeout.
#[test]
fn a_waiting_allocate_gets_staging_when_another_thread_adds_and_never_submits() {
    let p = pair(40, 4);
    for id in ["holder", "waiter"] {
        p.sender
            .handle()
            .begin(spec(id, p.peer, 8))
            .expect("begins");
        assert!(p
            .sender
            .wait_admitted(&ReqId(id.into()), WAIT)
            .expect("admitted"));
    }
    let holder = ReqId("holder".into());
    let guards: Vec<_> = (0..4)
        .map(|_| p.sender.allocate(&holder, None).expect("a free slot"))
        .collect();
    let timeout = Duration::from_secs(5);
    std::thread::scope(|scope| {
        let waiter = scope.spawn(|| {
            let started = Instant::now();
            let got = p.sender.allocate(&ReqId("waiter".into()), Some(timeout));
            (got.map(|g| g.index()), started.elapsed())
        });
        // Time for the waiter to wait: the add must find it waiting to matter.
        std::thread::sleep(Duration::from_millis(300));
        for (chunk, guard) in guards.into_iter().enumerate() {
            let bytes = pattern("holder", chunk);
            guard.with_slot(&mut |slot| slot.copy_from_slice(&bytes));
            p.sender
                .add(guard, format!("holder@{chunk}"), SLOT, 256)
                .expect("added");
        }
        let (got, waited) = waiter.join().expect("the waiter ends");
        assert!(got.is_ok(), "the waiting allocate got staging: {got:?}");
        assert!(
            waited < timeout,
            "the waiting allocate did not wait out its timeout ({waited:?})"
        );
    });
}

#[test]
fn concurrent_first_connects_to_one_receiver_all_wait_for_its_channel() {
    // Several threads reach a receiver for the first time at once (an LMCache worker's
    // first stores): every one must get the receiver's id only once its channel exists, or
    // a request begun at once would have its admission probe dropped.
    let p = pair(4, 2);
    let (region, _buffer) = lend(8);
    let second = Receiver::start(
        &p.rt,
        ReceiverSettings {
            env: EnvChoice::zmq_tcp(),
            config: ReceiverConfig {
                buffer_slots: 8,
                peer_share_percent: 100,
                ..ReceiverConfig::default()
            }
            .validate()
            .expect("valid"),
            buffer: Memory::External(region),
            alloc_endpoint: "tcp://127.0.0.1:0".into(),
            fabric_endpoint: "tcp://127.0.0.1:0".into(),
        },
    )
    .expect("receiver starts");
    let addr = ReceiverAddr {
        alloc: second.alloc_endpoint().to_owned(),
        fabric: second.fabric_endpoint().to_owned(),
    };
    std::thread::scope(|scope| {
        let joins: Vec<_> = (0..4)
            .map(|t| {
                let (sender, addr) = (&p.sender, addr.clone());
                scope.spawn(move || {
                    let peer = sender.add_receiver(addr, WAIT).expect("connects");
                    let id = format!("first-{t}");
                    sender.handle().begin(spec(&id, peer, 1)).expect("begins");
                    sender
                        .wait_admitted(&ReqId(id.clone()), WAIT)
                        .map_err(|f| format!("{id}: {f}"))
                })
            })
            .collect();
        for j in joins {
            assert_eq!(j.join().expect("no panic"), Ok(true), "admitted in time");
        }
    });
}

/// A `ready()` future dropped while its requests are being leased (by a task it cannot
/// cancel) loses none of them: the next call gets them, unread bytes intact. Dropped before
/// the leases reached it (the leasing task gives them back) and after (the dropped future
/// does).
#[test]
fn a_ready_future_dropped_while_leasing_hands_its_requests_to_the_next_call() {
    dropped_while_leasing(false);
}

#[test]
fn a_ready_future_dropped_after_its_leases_arrived_hands_them_to_the_next_call() {
    dropped_while_leasing(true);
}

fn dropped_while_leasing(let_them_arrive: bool) {
    let p = pair(4, 2);
    // The leasing runs on the runtime while this thread polls: a poll that finds it already
    // done delivers the lease the usual way, so the case is tried again (bounded).
    for attempt in 0..20 {
        let id = format!("r{attempt}");
        let req = ReqId(id.clone());
        p.sender
            .handle()
            .begin(spec(&id, p.peer, 1))
            .expect("begins");
        assert!(p.sender.wait_admitted(&req, WAIT).expect("admitted"));
        let guard = p.sender.allocate(&req, Some(WAIT)).expect("staging");
        guard.with_slot(&mut |slot| slot.copy_from_slice(&pattern(&id, 0)));
        p.sender
            .add(guard, format!("{id}@0"), SLOT, 1)
            .expect("added");
        p.sender
            .handle()
            .submit_added(&req, true)
            .expect("submitted");
        p.sender
            .wait_outcome(&req, WAIT)
            .expect("ended")
            .expect("delivered");
        let mut ready = Box::pin(p.receiver.ready(4));
        let mut cx = Context::from_waker(Waker::noop());
        if let Poll::Ready(leases) = ready.as_mut().poll(&mut cx) {
            let leases = leases.expect("the receiver runs");
            assert_eq!(leases.len(), 1);
            leases
                .into_iter()
                .for_each(|l| l.consume(WAIT).expect("consumed"));
            continue;
        }
        if let_them_arrive {
            // The leasing task finishes and hands its leases over; nobody polls for them.
            std::thread::sleep(Duration::from_millis(200));
        }
        drop(ready);
        let leases = p.receiver.next_ready(4, WAIT).expect("the receiver runs");
        assert_eq!(leases.len(), 1, "the dropped call's request is lost");
        assert_eq!(leases[0].key().req_id, req);
        let mut bytes = Vec::new();
        leases[0].with_chunk(0, &mut |b| bytes = b.to_vec());
        assert!(bytes == pattern(&id, 0), "the request's bytes changed");
        return;
    }
    panic!("every poll found the leasing already done: the case was never tried");
}

/// A lease dropped unconsumed (what Python's `consume(wait=False)` does) is released before
/// anything the dropping thread asks the driver next: a snapshot taken right after sees the
/// slots free, every time.
#[test]
fn a_dropped_lease_is_released_before_the_next_call_reaches_the_driver() {
    let p = pair(4, 2);
    for round in 0..20 {
        let id = format!("d{round}");
        let req = ReqId(id.clone());
        p.sender
            .handle()
            .begin(spec(&id, p.peer, 2))
            .expect("begins");
        assert!(p.sender.wait_admitted(&req, WAIT).expect("admitted"));
        for chunk in 0..2 {
            let guard = p.sender.allocate(&req, Some(WAIT)).expect("staging");
            p.sender
                .add(guard, format!("{id}@{chunk}"), SLOT, 1)
                .expect("added");
        }
        p.sender
            .handle()
            .submit_added(&req, true)
            .expect("submitted");
        let leases = p.receiver.next_ready(4, WAIT).expect("the receiver runs");
        assert_eq!(leases.len(), 1, "round {round}");
        drop(leases);
        let snap = p.receiver.snapshot(WAIT).expect("a snapshot");
        assert_eq!(
            snap.free, 4,
            "round {round}: the release came after the snapshot"
        );
        p.sender
            .wait_outcome(&req, WAIT)
            .expect("ended")
            .expect("delivered");
    }
}

/// Every request's end is noticed, a consumed one's too. Such a notice leases nothing, so a
/// wait for ready requests goes on past it until its timeout.
#[test]
fn an_ended_requests_notice_does_not_end_a_wait_early() {
    let p = pair(4, 2);
    let req = ReqId("e".into());
    p.sender
        .handle()
        .begin(spec("e", p.peer, 1))
        .expect("begins");
    assert!(p.sender.wait_admitted(&req, WAIT).expect("admitted"));
    let guard = p.sender.allocate(&req, Some(WAIT)).expect("staging");
    p.sender.add(guard, "e@0".into(), SLOT, 1).expect("added");
    p.sender
        .handle()
        .submit_added(&req, true)
        .expect("submitted");
    let leases = p.receiver.next_ready(4, WAIT).expect("the receiver runs");
    assert_eq!(leases.len(), 1);
    leases
        .into_iter()
        .for_each(|l| l.consume(WAIT).expect("consumed"));
    // The consumed request's end notice is queued now; nothing else will come.
    let wait = Duration::from_millis(400);
    let started = Instant::now();
    assert!(p
        .receiver
        .next_ready(4, wait)
        .expect("the receiver runs")
        .is_empty());
    assert!(
        started.elapsed() >= wait,
        "returned after {:?}, before its timeout",
        started.elapsed()
    );
}

/// A stopped receiver's `next_ready` answers `Stopped` at once, not an empty list again and
/// again (a decoder polling it would spin) or after its timeout; `ready` too.
#[test]
fn a_stopped_receivers_next_ready_answers_stopped_at_once() {
    let p = pair(4, 2);
    p.receiver.shutdown(WAIT);
    let started = std::time::Instant::now();
    let e = p.receiver.next_ready(4, WAIT).expect_err("stopped");
    assert!(e.is_stopped(), "{e}");
    assert!(
        started.elapsed() < WAIT / 2,
        "answered only after {:?}",
        started.elapsed()
    );
    let mut ready = Box::pin(p.receiver.ready(4));
    let mut cx = Context::from_waker(Waker::noop());
    match ready.as_mut().poll(&mut cx) {
        Poll::Ready(Err(e)) => assert!(e.is_stopped(), "{e}"),
        other => panic!(
            "ready on a stopped receiver: {:?}",
            other.map(|r| r.map(|l| l.len()))
        ),
    }
}
