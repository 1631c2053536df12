//! What a claim of a caller-placement reservation must prove (`docs/spec/protocol.md`
//! §Caller placement, "Claim secrets").
//!
//! A request id crosses HTTP, logs and (without CURVE) the control channel in clear, so it
//! names a reservation but proves nothing. The application that reserves also hands a
//! secret to the one sender it chose (the vLLM router: to the prefill engine it picked); the
//! sender's first batch carries it (`AllocRequest::claim`), and only a batch that carries it
//! claims the reservation. The secret is never printed (`Debug` hides it) and is compared in
//! constant time (`subtle`), so neither logs nor timing give it away.

use std::fmt;

use subtle::ConstantTimeEq;

/// A reservation's claim secret: 16..=128 bytes of printable ASCII, which the application
/// draws at random per reservation (e.g. Python's `secrets.token_urlsafe(24)`).
#[derive(Clone)]
pub struct ClaimSecret(String);

/// Why a string is not a claim secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClaimSecretError {
    /// Too short to be unguessable, or longer than the wire takes.
    #[error("a claim secret of {len} bytes: it must be {min}..={max} bytes", min = ClaimSecret::BYTES_MIN, max = ClaimSecret::BYTES_MAX)]
    Length {
        /// Its length.
        len: usize,
    },
    /// A byte outside printable ASCII (it travels in HTTP bodies and msgpack strings).
    #[error("a claim secret must be printable ASCII (e.g. secrets.token_urlsafe(24))")]
    NotPrintable,
}

impl ClaimSecret {
    /// The shortest secret taken: 128 bits of a random hex string.
    pub const BYTES_MIN: usize = 16;
    /// The longest secret taken.
    pub const BYTES_MAX: usize = 128;

    /// `secret`, if it is 16..=128 bytes of printable ASCII.
    pub fn new(secret: impl Into<String>) -> Result<Self, ClaimSecretError> {
        let secret = secret.into();
        let len = secret.len();
        if !(Self::BYTES_MIN..=Self::BYTES_MAX).contains(&len) {
            return Err(ClaimSecretError::Length { len });
        }
        if !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ClaimSecretError::NotPrintable);
        }
        Ok(Self(secret))
    }

    /// Whether `presented` is this secret; constant time in the secret's bytes.
    pub fn proven_by(&self, presented: Option<&ClaimSecret>) -> bool {
        presented.is_some_and(|p| bool::from(self.0.as_bytes().ct_eq(p.0.as_bytes())))
    }

    /// The secret's text, for the wire's encoder.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl PartialEq for ClaimSecret {
    fn eq(&self, other: &Self) -> bool {
        self.proven_by(Some(other))
    }
}

impl Eq for ClaimSecret {}

impl fmt::Debug for ClaimSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClaimSecret(..)")
    }
}

impl serde::Serialize for ClaimSecret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for ClaimSecret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::new(s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_and_printability_are_checked() {
        assert!(ClaimSecret::new("a".repeat(15)).is_err());
        assert!(ClaimSecret::new("a".repeat(16)).is_ok());
        assert!(ClaimSecret::new("a".repeat(128)).is_ok());
        assert!(ClaimSecret::new("a".repeat(129)).is_err());
        assert_eq!(
            ClaimSecret::new(format!("{}\n", "a".repeat(16))).expect_err("not printable"),
            ClaimSecretError::NotPrintable
        );
    }

    fn secret(s: &str) -> ClaimSecret {
        ClaimSecret::new(s).expect("a valid secret")
    }

    #[test]
    fn only_the_same_secret_proves_it_and_none_is_printed() {
        let s = secret("0123456789abcdef");
        assert!(s.proven_by(Some(&secret("0123456789abcdef"))));
        assert!(!s.proven_by(Some(&secret("0123456789abcdeF"))));
        assert!(!s.proven_by(Some(&secret("0123456789abcdef0"))));
        assert!(!s.proven_by(None));
        assert!(!format!("{s:?}").contains("0123"));
    }
}
