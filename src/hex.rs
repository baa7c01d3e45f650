//! Lower-case hex for the digests and tokens on every request's path. (`hex::encode` builds
//! its string one `char` at a time, which showed in profiles.)

const DIGITS: &[u8; 16] = b"0123456789abcdef";

pub fn lower(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 0x0f)] as char);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn matches_the_hex_crate() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(super::lower(&bytes), hex::encode(&bytes));
        assert_eq!(super::lower(&[]), "");
    }
}
