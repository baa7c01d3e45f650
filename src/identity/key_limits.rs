//! Which keys a provider accepts (a length range and a set of ASCII characters), and the one
//! way a key that does not fit is made to: its hex digest, cut to length. Provider profiles
//! and a route's `forward_key_*` fields set them; every key passed down goes through `fit`
//! (`passed_down`).

use sha2::{Digest, Sha256};

/// Which keys a provider accepts: a length range and a set of ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyLimits {
    pub min_len: usize,
    pub max_len: usize,
    pub charset: Charset,
}

/// A set of ASCII characters, written like a regex class body: `A-Za-z0-9 _-`.
#[derive(Clone, PartialEq, Eq)]
pub struct Charset {
    spec: String,
    allowed: [bool; 128],
}

impl std::fmt::Debug for Charset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{}]", self.spec)
    }
}

/// Visible ASCII, 0x21-0x7E: what the proxy itself accepts as a key.
pub const VISIBLE_ASCII: &str = "!-~";

impl Charset {
    /// Parses `A-Za-z0-9 _-`: single characters and `a-z` ranges; a `-` first or last is literal.
    pub fn parse(spec: &str) -> Result<Charset, String> {
        let chars: Vec<char> = spec.chars().collect();
        if chars.is_empty() {
            return Err("is empty".into());
        }
        if let Some(c) = chars.iter().find(|c| !c.is_ascii() || c.is_ascii_control()) {
            return Err(format!("`{c}` is not a printable ASCII character"));
        }
        let mut allowed = [false; 128];
        let mut i = 0;
        while i < chars.len() {
            let lo = chars[i];
            if i + 2 < chars.len() && chars[i + 1] == '-' {
                let hi = chars[i + 2];
                if hi < lo {
                    return Err(format!("range `{lo}-{hi}` is backwards"));
                }
                for c in lo..=hi {
                    allowed[c as usize] = true;
                }
                i += 3;
            } else {
                allowed[lo as usize] = true;
                i += 1;
            }
        }
        Ok(Charset {
            spec: spec.to_string(),
            allowed,
        })
    }

    pub fn allows(&self, b: u8) -> bool {
        self.allowed.get(b as usize).copied().unwrap_or(false)
    }

    pub fn spec(&self) -> &str {
        &self.spec
    }
}

/// Why a set of key limits cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitsError {
    #[error("charset {0}")]
    Charset(String),
    #[error("{0}")]
    Length(String),
}

impl KeyLimits {
    pub fn new(min_len: usize, max_len: usize, charset: &str) -> Result<KeyLimits, LimitsError> {
        let charset = Charset::parse(charset).map_err(LimitsError::Charset)?;
        let limits = KeyLimits {
            min_len,
            max_len,
            charset,
        };
        limits.check()?;
        Ok(limits)
    }

    /// The derived form must always fit: hex digits allowed, 16..=64 of them possible.
    fn check(&self) -> Result<(), LimitsError> {
        if self.min_len > self.max_len {
            return Err(LimitsError::Length(format!(
                "min length {} is above max length {}",
                self.min_len, self.max_len
            )));
        }
        if self.max_len < DERIVED_MIN_LEN {
            return Err(LimitsError::Length(format!(
                "max length {} is below {DERIVED_MIN_LEN}: a derived key keeps at least 64 bits",
                self.max_len
            )));
        }
        if self.min_len > DERIVED_MAX_LEN {
            return Err(LimitsError::Length(format!(
                "min length {} is above {DERIVED_MAX_LEN}, the length of a derived key",
                self.min_len
            )));
        }
        if !b"0123456789abcdef".iter().all(|b| self.charset.allows(*b)) {
            return Err(LimitsError::Charset(format!(
                "[{}] must allow 0-9 and a-f: derived keys are lowercase hex",
                self.charset.spec
            )));
        }
        Ok(())
    }

    pub fn fits(&self, key: &str) -> bool {
        (self.min_len..=self.max_len).contains(&key.len())
            && key.bytes().all(|b| self.charset.allows(b))
    }

    /// The key as the provider gets it: unchanged when it fits the limits; otherwise its
    /// derived form, the lowercase hex SHA-256 of the key's bytes cut to
    /// `min(64, max_len)` characters. Deterministic, so every retry passes down the same key.
    pub fn fit(&self, key: &str) -> String {
        if self.fits(key) {
            return key.to_string();
        }
        let mut hex = hex::encode(Sha256::digest(key.as_bytes()));
        hex.truncate(self.max_len.min(DERIVED_MAX_LEN));
        hex
    }
}

const DERIVED_MAX_LEN: usize = 64;
const DERIVED_MIN_LEN: usize = 16;

/// The proxy's own key rules: 1–255 visible ASCII bytes.
pub fn default_limits() -> KeyLimits {
    let mut allowed = [false; 128];
    for slot in &mut allowed[0x21..=0x7e] {
        *slot = true;
    }
    KeyLimits {
        min_len: 1,
        max_len: 255,
        charset: Charset {
            spec: VISIBLE_ASCII.into(),
            allowed,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charset_parses_ranges_and_literal_dashes() {
        let c = Charset::parse("A-Za-z0-9 _-").expect("parses");
        for b in b"azAZ09 _-" {
            assert!(c.allows(*b), "{}", *b as char);
        }
        for b in b".:/!~\x7f" {
            assert!(!c.allows(*b), "{}", *b as char);
        }
        assert!(Charset::parse("z-a").is_err());
        assert!(Charset::parse("").is_err());
        assert!(Charset::parse("é").is_err());
    }

    #[test]
    fn limits_that_could_not_hold_a_derived_key_are_refused() {
        assert!(KeyLimits::new(1, 8, VISIBLE_ASCII).is_err());
        assert!(KeyLimits::new(70, 80, VISIBLE_ASCII).is_err());
        assert!(KeyLimits::new(5, 4, VISIBLE_ASCII).is_err());
        assert!(matches!(
            KeyLimits::new(1, 40, "A-Z"),
            Err(LimitsError::Charset(_))
        ));
        assert!(KeyLimits::new(1, 40, "a-z0-9").is_ok());
    }
}
