//! How a secret appears in logs, metrics and error texts: never as itself. A sender's routing
//! identity carries 128 random bits (`docs/spec/zmq.md` §3), and whoever reads a log line
//! holding them could claim that identity while its sender is away; a fabric credential is
//! what binds a connection to a control peer. `SecretLabel` shows either as a short hash
//! keyed with a random key of this process: the same bytes show the same label throughout a
//! process (so a log still tells one peer from another and follows one across lines), and
//! nothing outside the process can go from a label back to the bytes, or tell whether two
//! processes' labels name the same secret.

use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::OnceLock;

/// The process's key: `RandomState` draws a fresh random SipHash key for each instance, so
/// one instance, kept, is one key for the process.
fn key() -> &'static RandomState {
    static KEY: OnceLock<RandomState> = OnceLock::new();
    KEY.get_or_init(RandomState::new)
}

/// A secret's label: `#` and 8 hex digits of its keyed hash, and its length.
#[derive(Clone, Copy)]
pub struct SecretLabel<'a>(pub &'a [u8]);

impl SecretLabel<'_> {
    /// The keyed hash, cut to 32 bits: enough to tell a process's peers apart in a log, too
    /// few to be worth a search for the secret even with the key.
    pub fn hash32(&self) -> u32 {
        (key().hash_one(self.0) >> 32) as u32
    }
}

impl fmt::Display for SecretLabel<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{:08x} ({} bytes)", self.hash32(), self.0.len())
    }
}

impl fmt::Debug for SecretLabel<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::SecretLabel;

    #[test]
    fn a_label_is_stable_in_a_process_and_hides_the_bytes() {
        let secret = b"sender-4242-7-0123456789abcdef0123456789abcdef";
        let shown = SecretLabel(secret).to_string();
        assert_eq!(
            shown,
            SecretLabel(secret).to_string(),
            "the same label each time"
        );
        assert_ne!(shown, SecretLabel(b"another").to_string());
        // Not even a piece of the secret: no run of 4 of its bytes appears.
        let text = String::from_utf8_lossy(secret);
        for start in 0..secret.len() - 4 {
            assert!(
                !shown.contains(&text[start..start + 4]),
                "{shown} shows {}",
                &text[start..start + 4]
            );
        }
        assert!(shown.starts_with('#') && shown.ends_with(&format!("({} bytes)", secret.len())));
    }
}
