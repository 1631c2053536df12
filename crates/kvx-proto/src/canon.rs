//! A canonical, structural encoding of an `OpWorld` state, hashed to a 128-bit fingerprint,
//! so that the explorer stores 16 bytes per state and treats as one state every pair of
//! states that differ only in what cannot change what happens next.
//!
//! Each component writes its own fields (`SenderFlow::canon`, `ReceiverLedger::canon`, …,
//! all under the `testing` feature) into a [`Canon`], which abstracts as it goes:
//!
//! - **times** are written relative to `now`: every handler compares instants only with
//!   each other or adds a constant to `now`, so shifting every instant alike changes nothing;
//! - **tickets, seqs and write ids** (counters that only ever hand out a fresh, larger value)
//!   are renamed to their rank among the values present in the state. An order-preserving
//!   renaming keeps every comparison the code makes (equality, and the order of `BTreeMap`
//!   keys), and the next value handed out is larger than all of them in either state;
//! - **receiver buffer slots** and **staging slots** are renamed in order of first appearance
//!   in a traversal that never looks at their numbers: slots are interchangeable (no code
//!   orders them or treats one specially), so states that are equal up to a permutation of
//!   slots encode alike;
//! - a **write tag's generation** is written only as "is the slot's current grant or not":
//!   generations are only ever compared for equality with the slot's current one
//!   (`SlotTable::land`, the quarantine, the checker), and a new grant takes a generation
//!   larger than every tag in existence, so a stale tag stays stale forever. (Generations wrap
//!   at 2^12 in the immediate; no explored path grants one slot that often.)
//!
//! Whatever the components leave out (statistics, failure texts, arrival times) is argued
//! where they leave it out.

use crate::ids::{SlotIndex, StagingSlot, Ticket, WriteId, WriteTag};
use crate::time::Instant;
use crate::wire::{AllocRequest, Message};

/// Names handed out in order of first appearance.
#[derive(Default)]
struct Names {
    /// raw value → name + 1 (0: not named yet).
    by_raw: Vec<u32>,
    /// name → raw value.
    raws: Vec<u32>,
}

impl Names {
    fn name(&mut self, raw: u32) -> u32 {
        let i = raw as usize;
        if i >= self.by_raw.len() {
            self.by_raw.resize(i + 1, 0);
        }
        if self.by_raw[i] == 0 {
            self.raws.push(raw);
            self.by_raw[i] = self.raws.len() as u32;
        }
        self.by_raw[i] - 1
    }

    fn clear(&mut self) {
        self.by_raw.clear();
        self.raws.clear();
    }
}

/// Counter namespaces renamed by rank.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Counter {
    Ticket,
    Seq(usize),
    Write(usize),
}

/// Marks in the word stream, so that a list's end or an `Option`'s absence can never be
/// mistaken for a value that follows.
const NONE: u64 = u64::MAX;
const STALE_TAG: u64 = u64::MAX - 1;

/// The encoder. `sender` selects the per-sender namespaces (seqs, write ids, staging slots).
pub(crate) struct Canon {
    words: Vec<u64>,
    now: Instant,
    sender: usize,
    slots: Names,
    staging: Vec<Names>,
    /// Current generation of each non-free receiver slot, by raw index (None: free).
    current: Vec<Option<u32>>,
    /// (namespace, raw value, position in `words`), fixed up in `finish`.
    ranked: Vec<(Counter, u64, usize)>,
}

impl Canon {
    pub fn new() -> Self {
        Self {
            words: Vec::with_capacity(512),
            now: Instant::ZERO,
            sender: 0,
            slots: Names::default(),
            staging: Vec::new(),
            current: Vec::new(),
            ranked: Vec::with_capacity(64),
        }
    }

    /// Starts a new state at `now` (the buffers are reused: no allocation per state).
    pub fn reset(&mut self, now: Instant) {
        self.words.clear();
        self.now = now;
        self.sender = 0;
        self.slots.clear();
        self.staging.iter_mut().for_each(Names::clear);
        self.current.clear();
        self.ranked.clear();
    }

    /// Selects sender `s`'s namespaces for what follows.
    pub fn set_sender(&mut self, s: usize) {
        self.sender = s;
        if self.staging.len() <= s {
            self.staging.resize_with(s + 1, Names::default);
        }
    }

    /// Tells the encoder each receiver slot's current generation (None: the slot is free),
    /// before any write tag is encoded.
    pub fn set_generations(&mut self, current: impl Iterator<Item = Option<u32>>) {
        self.current.clear();
        self.current.extend(current);
    }

    pub fn u(&mut self, v: u64) {
        self.words.push(v);
    }

    pub fn flag(&mut self, b: bool) {
        self.words.push(u64::from(b));
    }

    /// A length (or an enum discriminant).
    pub fn len(&mut self, n: usize) {
        self.words.push(n as u64);
    }

    pub fn str(&mut self, s: &str) {
        self.words.push(s.len() as u64);
        for chunk in s.as_bytes().chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.words.push(u64::from_le_bytes(w));
        }
    }

    pub fn strs(&mut self, v: &[String]) {
        self.len(v.len());
        for s in v {
            self.str(s);
        }
    }

    /// An instant, as its signed distance from `now` in nanoseconds.
    pub fn time(&mut self, t: Instant) {
        let d = t.since_epoch().as_nanos() as i128 - self.now.since_epoch().as_nanos() as i128;
        self.words.push(d as i64 as u64);
    }

    fn ranked(&mut self, counter: Counter, raw: u64) {
        self.ranked.push((counter, raw, self.words.len()));
        self.words.push(0);
    }

    pub fn ticket(&mut self, t: Ticket) {
        self.ranked(Counter::Ticket, t.0);
    }

    /// A `seq` of the current sender's channel.
    pub fn seq(&mut self, seq: Option<u64>) {
        match seq {
            Some(s) => self.ranked(Counter::Seq(self.sender), s),
            None => self.u(NONE),
        }
    }

    pub fn write_id(&mut self, id: WriteId) {
        self.ranked(Counter::Write(self.sender), id.0);
    }

    pub fn slot(&mut self, slot: SlotIndex) {
        let name = self.slots.name(slot.0);
        self.u(u64::from(name));
    }

    /// A slot named in a reply (`remote_indexes`): negative entries mean refusal.
    pub fn remote_index(&mut self, index: i64) {
        match u32::try_from(index) {
            Ok(i) => self.slot(SlotIndex(i)),
            Err(_) => self.u(NONE),
        }
    }

    /// A write tag: its slot, and whether it names the slot's current grant.
    pub fn tag(&mut self, tag: WriteTag) {
        self.slot(tag.slot);
        self.generation(tag.slot, tag.generation);
    }

    /// Whether `generation` is `slot`'s current grant (see the module comment).
    pub fn generation(&mut self, slot: SlotIndex, generation: u32) {
        let current = self.current.get(slot.0 as usize).copied().flatten();
        self.u(if current == Some(generation) {
            1
        } else {
            STALE_TAG
        });
    }

    /// Receiver slots in order of their names; `capacity` slots never reached get the next
    /// names, by index, so that every slot is written.
    pub fn named_slots(&mut self, capacity: u32) -> Vec<SlotIndex> {
        for raw in 0..capacity {
            self.slots.name(raw);
        }
        self.slots.raws.iter().map(|&r| SlotIndex(r)).collect()
    }

    pub fn staging(&mut self, slot: StagingSlot) {
        let s = self.sender;
        let name = self.staging[s].name(slot.0);
        self.u(u64::from(name));
    }

    /// The current sender's staging slots in order of their names (see `named_slots`).
    pub fn named_staging(&mut self, capacity: u32) -> Vec<StagingSlot> {
        let names = &mut self.staging[self.sender];
        for raw in 0..capacity {
            names.name(raw);
        }
        names.raws.iter().map(|&r| StagingSlot(r)).collect()
    }

    /// A wire message, with the current sender's seqs and the receiver's slots renamed. A
    /// refusal's text is left out: a sender reads it only to word its failure
    /// (`SendFailure::Refused`), which nothing in the world acts on.
    pub fn message(&mut self, msg: &Message) {
        match msg {
            Message::AllocRequest(m) => {
                self.len(0);
                self.alloc_request(m);
            }
            Message::AllocResponse(m) => {
                self.len(1);
                self.len(m.remote_indexes.len());
                m.remote_indexes.iter().for_each(|&i| self.remote_index(i));
                self.len(m.already_sent_indexes.len());
                m.already_sent_indexes
                    .iter()
                    .for_each(|&i| self.u(i as u64));
                self.seq(m.seq);
                self.flag(m.error.is_some());
                match &m.generations {
                    None => self.u(NONE),
                    Some(g) => {
                        self.len(g.len());
                        for (k, &generation) in g.iter().enumerate() {
                            // Parallel to remote_indexes (a mismatch is the sender's BadReply).
                            match m.remote_indexes.get(k).map(|&i| u32::try_from(i)) {
                                Some(Ok(i)) => self.generation(SlotIndex(i), generation),
                                _ => self.u(u64::from(generation)),
                            }
                        }
                    }
                }
            }
            Message::CancelNotif(m) => {
                self.len(2);
                self.str(&m.req_id);
                self.strs(&m.keys);
                self.seq(m.seq);
                self.u(m.drained.map_or(NONE, u64::from));
            }
            Message::ProxyNotif(m) => {
                self.len(3);
                self.str(&m.req_id);
            }
            Message::FailNotif(m) => {
                self.len(4);
                self.str(&m.req_id);
            }
        }
    }

    pub fn alloc_request(&mut self, m: &AllocRequest) {
        self.strs(&m.keys);
        self.u(u64::from(m.fmt));
        self.len(m.shape.len());
        m.shape.iter().for_each(|&d| self.u(d));
        self.str(&m.dtype);
        self.u(m.last_chunk_toks);
        self.str(&m.req_id);
        self.flag(m.is_last_batch);
        self.u(u64::from(m.total_chunks));
        self.seq(m.seq);
        match &m.chunk_bytes {
            None => self.u(0),
            Some(bytes) => {
                self.len(bytes.len() + 1);
                bytes.iter().for_each(|&b| self.u(b));
            }
        }
    }

    /// Renames the ranked counters and hashes the words.
    pub fn finish(&mut self) -> u128 {
        self.ranked.sort_unstable_by_key(|&(c, raw, _)| (c, raw));
        let mut rank = 0u64;
        let mut prev = None;
        for &(counter, raw, pos) in &self.ranked {
            match prev {
                Some((c, r)) if c == counter && r == raw => {}
                Some((c, _)) if c == counter => rank += 1,
                _ => rank = 0,
            }
            prev = Some((counter, raw));
            self.words[pos] = rank;
        }
        hash128(&self.words)
    }
}

/// Two independent 64-bit lanes (xxHash64's round and avalanche), each over every word.
fn hash128(words: &[u64]) -> u128 {
    const P1: u64 = 0x9E37_79B1_85EB_CA87;
    const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
    const P3: u64 = 0x1656_67B1_9E37_79F9;
    let round = |acc: u64, w: u64| {
        acc.wrapping_add(w.wrapping_mul(P2))
            .rotate_left(31)
            .wrapping_mul(P1)
    };
    let avalanche = |mut h: u64| {
        h ^= h >> 33;
        h = h.wrapping_mul(P2);
        h ^= h >> 29;
        h = h.wrapping_mul(P3);
        h ^ (h >> 32)
    };
    let (mut a, mut b) = (P1 ^ words.len() as u64, P3.rotate_left(17));
    for &w in words {
        a = round(a, w);
        b = round(b ^ 0x5555_5555_5555_5555, w.rotate_left(29));
    }
    (u128::from(avalanche(a)) << 64) | u128::from(avalanche(b))
}
