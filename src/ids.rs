//! Random identifiers and keys: one helper, from the operating system's
//! generator (`rand`'s thread RNG, seeded from it).

/// `bytes` random bytes as lowercase hex (`2 × bytes` characters).
pub fn random_hex(bytes: usize) -> String {
    hex::encode(random_bytes(bytes))
}

/// A random 256-bit token as 43 base64url characters (session ids, form
/// tokens, OIDC state, nonce and PKCE verifier).
pub fn random_token() -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(random_bytes(32))
}

/// `n` random bytes (keys, salts, nonces).
pub fn random_bytes(n: usize) -> Vec<u8> {
    (0..n).map(|_| rand::random::<u8>()).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn lengths_and_difference() {
        let a = super::random_hex(16);
        assert_eq!(a.len(), 32);
        assert!(
            a.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        assert_ne!(a, super::random_hex(16));
        assert_eq!(super::random_bytes(32).len(), 32);
    }
}
