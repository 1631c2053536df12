//! XXH3-64's long-input path (inputs over 240 bytes, default secret, seed 0), written so that
//! it can run *while copying* and *in place as bytes arrive*, which no XXH3 library offers.
//!
//! Why kvx carries it and not only the `twox-hash` crate: a receiver that copies a chunk out
//! of a sender's shared-memory staging and then checksums the copy passes over the chunk
//! twice; the copy is bound by memory and the checksum waits on it. Here every 64-byte stripe
//! is loaded once, stored to the destination and folded into the accumulators from the same
//! registers, so the checksum rides along with the copy (docs/PERFORMANCE.md, "Integrity").
//! A TCP receive, whose bytes the kernel copies into the slot, folds in whole stripes as they
//! land, without the per-stripe buffering of a general streaming hasher.
//!
//! The algorithm is XXH3's (Yann Collet's xxHash specification, `doc/xxhash_spec.md`):
//! accumulate 64-byte stripes into eight 64-bit lanes, scramble after every 16 stripes (a
//! 1,024-byte block of the 192-byte default secret), fold in the input's last 64 bytes with
//! the secret at offset 121, merge the lanes and avalanche. `twox-hash` stays the reference:
//! the tests compare every path here with its one-shot result, over many lengths and cuts.
//!
//! Two kernels compute the same thing: AVX2 (x86-64, picked at run time) and portable
//! scalar code (every other CPU, and the check of the first).

#![allow(unsafe_code)] // the AVX2 kernel: unaligned vector loads and stores through raw pointers

/// Inputs longer than this take the long path; shorter ones are hashed by `twox-hash`.
pub const LONG_MIN: usize = 241;

const STRIPE: usize = 64;
const SECRET_LEN: usize = 192;
const STRIPES_PER_BLOCK: usize = (SECRET_LEN - STRIPE) / 8;
/// Where the secret's scramble key and the last stripe's key start.
const SCRAMBLE_KEY: usize = SECRET_LEN - STRIPE;
const LAST_STRIPE_KEY: usize = SECRET_LEN - STRIPE - 7;
const MERGE_KEY: usize = 11;

const PRIME32_1: u64 = 0x9E37_79B1;
const PRIME32_2: u64 = 0x85EB_CA77;
const PRIME32_3: u64 = 0xC2B2_AE3D;
const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const PRIME64_3: u64 = 0x1656_67B1_9E37_79F9;
const PRIME64_4: u64 = 0x85EB_CA77_C2B2_AE63;
const PRIME64_5: u64 = 0x27D4_EB2F_1656_67C5;
const PRIME_MX1: u64 = 0x1656_6791_9E37_79F9;

/// XXH3's default secret (the specification's `kSecret`).
const SECRET: [u8; SECRET_LEN] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
];

fn secret_u64(at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&SECRET[at..at + 8]);
    u64::from_le_bytes(b)
}

/// Which kernel runs the stripes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Portable 64-bit arithmetic.
    Scalar,
    /// AVX2 (x86-64 only; `Kernel::best` picks it when the CPU has it).
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Kernel {
    /// The fastest kernel this CPU runs.
    pub fn best() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            return Kernel::Avx2;
        }
        Kernel::Scalar
    }
}

/// XXH3's state over a long input of a length known from the start: the eight lanes and how
/// many of the input's normal stripes they hold.
#[derive(Clone)]
pub struct LongState {
    acc: [u64; 8],
    len: usize,
    /// Normal stripes folded in so far (the input's first `stripes_done * 64` bytes).
    stripes_done: usize,
    kernel: Kernel,
}

impl std::fmt::Debug for LongState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LongState")
            .field("len", &self.len)
            .field("stripes_done", &self.stripes_done)
            .finish_non_exhaustive()
    }
}

impl LongState {
    /// The state for an input of `len` bytes; `len` must be at least `LONG_MIN`.
    pub fn new(len: usize, kernel: Kernel) -> LongState {
        assert!(
            len >= LONG_MIN,
            "invariant: the long path takes over {} bytes",
            LONG_MIN - 1
        );
        LongState {
            acc: [
                PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5,
                PRIME32_1,
            ],
            len,
            stripes_done: 0,
            kernel,
        }
    }

    /// How many stripes are accumulated as normal stripes: every full stripe that ends
    /// before the input's last byte (the last 64 bytes are folded in apart, by `finish`).
    fn normal_stripes(&self) -> usize {
        (self.len - 1) / STRIPE
    }

    /// Folds in every normal stripe that lies wholly within `landed`, the input's first
    /// `landed.len()` bytes, and that is not folded in yet.
    pub fn advance(&mut self, landed: &[u8]) {
        debug_assert!(landed.len() <= self.len);
        let upto = (landed.len() / STRIPE).min(self.normal_stripes());
        if upto > self.stripes_done {
            // SAFETY: stripes `stripes_done..upto` end within `landed` (`upto * 64 <=
            // landed.len()`); nothing is written (`dst` is null).
            unsafe { self.run(landed.as_ptr(), std::ptr::null_mut(), upto) };
        }
    }

    /// Copies `src` to `dst` (`len` bytes each) while folding in all of its normal stripes;
    /// the state must be fresh. `finish(dst)` then gives the checksum of the bytes `dst`
    /// holds.
    ///
    /// # Safety
    /// `src` must be valid for reads of `len` bytes, `dst` for writes of `len` bytes, and the
    /// two ranges must not overlap. `src` may change under the copy (another process's
    /// shared memory): the checksum is of what was stored into `dst`.
    pub unsafe fn copy(&mut self, src: *const u8, dst: *mut u8) {
        debug_assert_eq!(self.stripes_done, 0);
        let stripes = self.normal_stripes();
        // SAFETY: the caller's contract; stripes end at `stripes * 64 < len`.
        unsafe { self.run(src, dst, stripes) };
        let done = stripes * STRIPE;
        // SAFETY: `done < len`, within both ranges, which do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), self.len - done) };
    }

    /// Folds stripes `stripes_done..upto` from `src` (copying each to `dst` unless null).
    ///
    /// # Safety
    /// `src` must be valid for reads of `upto * 64` bytes and, unless null, `dst` for
    /// writes of as many, the two not overlapping; `upto <= normal_stripes()`.
    unsafe fn run(&mut self, src: *const u8, dst: *mut u8, upto: usize) {
        match self.kernel {
            // SAFETY: `Kernel::Avx2` exists only where `Kernel::best` found AVX2 (or a
            // test asked for it on such a CPU); the rest is the caller's contract.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { avx2::run(&mut self.acc, src, dst, self.stripes_done, upto) },
            // SAFETY: the caller's contract.
            Kernel::Scalar => unsafe {
                scalar_run(&mut self.acc, src, dst, self.stripes_done, upto)
            },
        }
        self.stripes_done = upto;
    }

    /// The hash of the whole input, `whole` (its `len` bytes, the stripes folded in so far
    /// among them): folds in the normal stripes not yet folded, then the last stripe, and
    /// merges the lanes.
    pub fn finish(&self, whole: &[u8]) -> u64 {
        assert_eq!(
            whole.len(),
            self.len,
            "invariant: finish sees the whole input"
        );
        let mut s = self.clone();
        s.advance(whole);
        let mut acc = s.acc;
        let last: &[u8; STRIPE] = whole[self.len - STRIPE..]
            .try_into()
            .expect("invariant: a long input holds a stripe");
        scalar_stripe(&mut acc, last, LAST_STRIPE_KEY);
        let mut h = (self.len as u64).wrapping_mul(PRIME64_1);
        for i in 0..4 {
            let a = acc[2 * i] ^ secret_u64(MERGE_KEY + 16 * i);
            let b = acc[2 * i + 1] ^ secret_u64(MERGE_KEY + 16 * i + 8);
            let m = u128::from(a) * u128::from(b);
            h = h.wrapping_add((m as u64) ^ ((m >> 64) as u64));
        }
        h ^= h >> 37;
        h = h.wrapping_mul(PRIME_MX1);
        h ^ (h >> 32)
    }
}

fn scalar_stripe(acc: &mut [u64; 8], stripe: &[u8; STRIPE], key_at: usize) {
    for i in 0..8 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&stripe[8 * i..8 * i + 8]);
        let data = u64::from_le_bytes(b);
        let key = data ^ secret_u64(key_at + 8 * i);
        acc[i ^ 1] = acc[i ^ 1].wrapping_add(data);
        acc[i] = acc[i].wrapping_add((key & 0xFFFF_FFFF).wrapping_mul(key >> 32));
    }
}

fn scalar_scramble(acc: &mut [u64; 8]) {
    for (i, a) in acc.iter_mut().enumerate() {
        let x = *a ^ (*a >> 47) ^ secret_u64(SCRAMBLE_KEY + 8 * i);
        *a = x.wrapping_mul(PRIME32_1);
    }
}

/// # Safety
/// As `LongState::run`.
unsafe fn scalar_run(acc: &mut [u64; 8], src: *const u8, dst: *mut u8, from: usize, upto: usize) {
    for s in from..upto {
        let mut stripe = [0u8; STRIPE];
        // SAFETY: stripe `s < upto` is within `src`'s readable range (and `dst`'s).
        unsafe {
            std::ptr::copy_nonoverlapping(src.add(s * STRIPE), stripe.as_mut_ptr(), STRIPE);
            if !dst.is_null() {
                std::ptr::copy_nonoverlapping(stripe.as_ptr(), dst.add(s * STRIPE), STRIPE);
            }
        }
        scalar_stripe(acc, &stripe, (s % STRIPES_PER_BLOCK) * 8);
        if s % STRIPES_PER_BLOCK == STRIPES_PER_BLOCK - 1 {
            scalar_scramble(acc);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::{
        __m256i, _mm256_add_epi64, _mm256_loadu_si256, _mm256_mul_epu32, _mm256_set1_epi32,
        _mm256_shuffle_epi32, _mm256_slli_epi64, _mm256_srli_epi64, _mm256_storeu_si256,
        _mm256_xor_si256,
    };

    use super::{PRIME32_1, SCRAMBLE_KEY, SECRET, STRIPE, STRIPES_PER_BLOCK};

    /// # Safety
    /// The CPU has AVX2; otherwise as `LongState::run`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn run(
        acc: &mut [u64; 8],
        src: *const u8,
        dst: *mut u8,
        from: usize,
        upto: usize,
    ) {
        // Two copies of the loop, so that neither tests `dst` per stripe.
        if dst.is_null() {
            // SAFETY: the caller's contract.
            unsafe { run_lanes::<false>(acc, src, dst, from, upto) }
        } else {
            // SAFETY: the caller's contract.
            unsafe { run_lanes::<true>(acc, src, dst, from, upto) }
        }
    }

    /// # Safety
    /// As `run`; with `COPY`, `dst` is writable for the stripes.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn run_lanes<const COPY: bool>(
        acc: &mut [u64; 8],
        src: *const u8,
        dst: *mut u8,
        from: usize,
        upto: usize,
    ) {
        // SAFETY (every load and store below): `acc` holds 8 u64 = two 32-byte vectors; the
        // secret's keys at `8 * (s % 16) + 32 * i` and at `SCRAMBLE_KEY + 32 * i` end within
        // its 192 bytes; stripe `s < upto` is within `src` (and `dst`) by the caller.
        let mut lanes = unsafe {
            [
                _mm256_loadu_si256(acc.as_ptr().cast::<__m256i>()),
                _mm256_loadu_si256(acc.as_ptr().add(4).cast::<__m256i>()),
            ]
        };
        let mut s = from;
        while s < upto {
            // The stripes up to the end of this block (or `upto`), then the block's scramble
            // when it is whole: the inner loop's key offsets repeat every block.
            let block_end = (s / STRIPES_PER_BLOCK + 1) * STRIPES_PER_BLOCK;
            let end = block_end.min(upto);
            if end - s == STRIPES_PER_BLOCK {
                // A whole block: a loop of known length, which the compiler unrolls.
                let block = s * STRIPE;
                for j in 0..STRIPES_PER_BLOCK {
                    let at = block + j * STRIPE;
                    unsafe {
                        accumulate::<COPY>(&mut lanes, src.add(at), dst.wrapping_add(at), j * 8)
                    };
                }
            } else {
                for stripe in s..end {
                    let at = stripe * STRIPE;
                    let key_at = (stripe % STRIPES_PER_BLOCK) * 8;
                    unsafe {
                        accumulate::<COPY>(&mut lanes, src.add(at), dst.wrapping_add(at), key_at)
                    };
                }
            }
            if end == block_end {
                scramble(&mut lanes);
            }
            s = end;
        }
        unsafe {
            _mm256_storeu_si256(acc.as_mut_ptr().cast::<__m256i>(), lanes[0]);
            _mm256_storeu_si256(acc.as_mut_ptr().add(4).cast::<__m256i>(), lanes[1]);
        }
    }

    /// One stripe into the lanes (and, with `COPY`, into `dst`).
    ///
    /// # Safety
    /// `src` readable and, with `COPY`, `dst` writable for 64 bytes; `key_at <= 128`.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn accumulate<const COPY: bool>(
        lanes: &mut [__m256i; 2],
        src: *const u8,
        dst: *mut u8,
        key_at: usize,
    ) {
        for (i, lane) in lanes.iter_mut().enumerate() {
            // SAFETY: the contract above; the key ends within the secret's 192 bytes.
            let (data, k) = unsafe {
                let data = _mm256_loadu_si256(src.add(32 * i).cast::<__m256i>());
                if COPY {
                    _mm256_storeu_si256(dst.add(32 * i).cast::<__m256i>(), data);
                }
                let k = _mm256_loadu_si256(SECRET.as_ptr().add(key_at + 32 * i).cast::<__m256i>());
                (data, k)
            };
            let data_key = _mm256_xor_si256(data, k);
            let product = _mm256_mul_epu32(data_key, _mm256_srli_epi64::<32>(data_key));
            // Each 64-bit lane gets its neighbour's data: swap the halves of every 128 bits.
            let swapped = _mm256_shuffle_epi32::<0b01_00_11_10>(data);
            *lane = _mm256_add_epi64(product, _mm256_add_epi64(*lane, swapped));
        }
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    fn scramble(lanes: &mut [__m256i; 2]) {
        let prime = _mm256_set1_epi32(PRIME32_1 as i32);
        for (i, lane) in lanes.iter_mut().enumerate() {
            let a = _mm256_xor_si256(*lane, _mm256_srli_epi64::<47>(*lane));
            // SAFETY: `SCRAMBLE_KEY + 32 * i + 32 <= 192`.
            let k = unsafe {
                _mm256_loadu_si256(SECRET.as_ptr().add(SCRAMBLE_KEY + 32 * i).cast::<__m256i>())
            };
            let x = _mm256_xor_si256(a, k);
            // x * PRIME32_1 in 64 bits, from two 32 × 32 → 64 products.
            let lo = _mm256_mul_epu32(x, prime);
            let hi = _mm256_mul_epu32(_mm256_srli_epi64::<32>(x), prime);
            *lane = _mm256_add_epi64(lo, _mm256_slli_epi64::<32>(hi));
        }
    }
}

#[cfg(test)]
mod tests {
    use twox_hash::XxHash3_64;

    use super::*;

    /// 16 stripes: the bytes between two scrambles.
    const BLOCK: usize = STRIPE * STRIPES_PER_BLOCK;

    fn kernels() -> Vec<Kernel> {
        let mut k = vec![Kernel::Scalar];
        if Kernel::best() != Kernel::Scalar {
            k.push(Kernel::best());
        }
        k
    }

    fn data(len: usize, seed: u32) -> Vec<u8> {
        (0..len as u32)
            .map(|i| (i.wrapping_add(seed).wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect()
    }

    fn lengths() -> impl Iterator<Item = usize> {
        (LONG_MIN..2200).chain([
            4095,
            4096,
            4097,
            BLOCK * 7,
            BLOCK * 7 + 1,
            BLOCK * 7 + 64,
            BLOCK * 7 + 65,
            65_536,
            100_003,
            1 << 20,
        ])
    }

    #[test]
    fn copying_gives_xxh3_and_the_bytes() {
        for kernel in kernels() {
            for len in lengths() {
                let src = data(len, len as u32);
                let mut dst = vec![0xAAu8; len];
                let mut s = LongState::new(len, kernel);
                // SAFETY: two distinct vectors of `len` bytes.
                unsafe { s.copy(src.as_ptr(), dst.as_mut_ptr()) };
                assert_eq!(dst, src, "{kernel:?} len {len}");
                assert_eq!(
                    s.finish(&dst),
                    XxHash3_64::oneshot(&src),
                    "{kernel:?} len {len}"
                );
            }
        }
    }

    #[test]
    fn landing_in_pieces_gives_xxh3_however_cut() {
        for kernel in kernels() {
            for (n, len) in lengths().enumerate() {
                let src = data(len, 7);
                let want = XxHash3_64::oneshot(&src);
                // Cuts of 1 byte, odd sizes, stripe and block multiples, and one piece.
                for piece in [1, 63, 64, 65, 1000, BLOCK, 3 * BLOCK + 5, len] {
                    if piece == 1 && len > 5000 {
                        continue;
                    }
                    // The slot holds a previous chunk's bytes until each piece lands on
                    // them, as a TCP receive into a reused slot does.
                    let mut slot = vec![0x5Au8; len];
                    let mut s = LongState::new(len, kernel);
                    let mut landed = 0;
                    while landed < len {
                        let end = (landed + piece + n % 3).min(len);
                        slot[landed..end].copy_from_slice(&src[landed..end]);
                        landed = end;
                        s.advance(&slot[..landed]);
                    }
                    assert_eq!(s.finish(&slot), want, "{kernel:?} len {len} piece {piece}");
                }
                // Nothing advanced at all: `finish` folds everything.
                assert_eq!(LongState::new(len, kernel).finish(&src), want);
            }
        }
    }

    #[test]
    fn a_changed_byte_changes_the_hash_in_every_position_class() {
        let len = BLOCK * 3 + 100;
        let src = data(len, 3);
        let want = LongState::new(len, Kernel::best()).finish(&src);
        // First byte, a block's last byte (before a scramble), the byte after it, a byte
        // only the last stripe covers, and the very last byte.
        for at in [0, BLOCK - 1, BLOCK, len - 30, len - 1] {
            let mut changed = src.clone();
            changed[at] ^= 0x01;
            assert_ne!(
                LongState::new(len, Kernel::best()).finish(&changed),
                want,
                "at {at}"
            );
        }
    }
}
