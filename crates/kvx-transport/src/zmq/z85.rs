//! Z85 (ZeroMQ RFC 32), the text form of CURVE keys: 4 bytes as 5 characters of an
//! 85-character alphabet, big-endian. Written here rather than taken from a crate: the codec
//! is a few lines, kvx needs it only for 32-byte keys (40 characters), and the `z85` crate
//! pads input to a multiple of 4 where RFC 32 refuses it, which would let a truncated key file
//! read back as a different key instead of failing.

const ALPHABET: &[u8; 85] =
    b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";

/// `bytes` (a multiple of 4 long) as Z85 text.
pub(crate) fn encode(bytes: &[u8]) -> Option<String> {
    if !bytes.len().is_multiple_of(4) {
        return None;
    }
    let mut out = String::with_capacity(bytes.len() / 4 * 5);
    for chunk in bytes.chunks_exact(4) {
        let mut value = u32::from_be_bytes(chunk.try_into().expect("invariant: 4 bytes"));
        let mut digits = [0u8; 5];
        for d in digits.iter_mut().rev() {
            *d = ALPHABET[(value % 85) as usize];
            value /= 85;
        }
        out.extend(digits.iter().map(|&b| char::from(b)));
    }
    Some(out)
}

/// The bytes of Z85 `text` (a multiple of 5 characters long, every one in the alphabet, no
/// group over 2^32 - 1).
pub(crate) fn decode(text: &str) -> Result<Vec<u8>, String> {
    let text = text.as_bytes();
    if !text.len().is_multiple_of(5) {
        return Err(format!(
            "{} characters is not a multiple of 5 (Z85)",
            text.len()
        ));
    }
    let mut out = Vec::with_capacity(text.len() / 5 * 4);
    for group in text.chunks_exact(5) {
        let mut value = 0u64;
        for &c in group {
            // The character is not named: the text may be a secret key.
            let digit = ALPHABET
                .iter()
                .position(|&a| a == c)
                .ok_or_else(|| "a character outside the Z85 alphabet".to_owned())?;
            value = value * 85 + digit as u64;
        }
        let value = u32::try_from(value).map_err(|_| "a Z85 group over 2^32 - 1".to_owned())?;
        out.extend_from_slice(&value.to_be_bytes());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 32's own example, and a round trip of every byte value.
    #[test]
    fn rfc_32_example_and_round_trip() {
        let bytes = [0x86, 0x4F, 0xD2, 0x6F, 0xB5, 0x59, 0xF7, 0x5B];
        assert_eq!(encode(&bytes).as_deref(), Some("HelloWorld"));
        assert_eq!(decode("HelloWorld").expect("decodes"), bytes);
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(
            decode(&encode(&all).expect("encodes")).expect("decodes"),
            all
        );
    }

    #[test]
    fn bad_text_is_refused() {
        assert!(encode(&[1, 2, 3]).is_none());
        assert!(decode("Hello").is_ok());
        assert!(decode("Hell").is_err(), "not a multiple of 5");
        assert!(decode("Hell\"").is_err(), "not in the alphabet");
        assert!(decode("#####").is_err(), "over 2^32 - 1");
    }
}
