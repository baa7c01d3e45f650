//! Built-in provider profiles: where a provider takes an idempotency key, what keys it
//! accepts, whether it deduplicates on them, and which of its answers are final. A route's
//! own fields override every part of a profile.
//!
//! Facts come from `../shared/notes/idempotency-facts.md` §2; each profile cites its source.

use sha2::{Digest, Sha256};

/// Where the key is passed down to the provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    Header(String),
    /// A top-level string field of a JSON object body.
    BodyField(String),
    /// The provider takes no key.
    None,
}

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

impl KeyLimits {
    pub fn new(min_len: usize, max_len: usize, charset: &str) -> Result<KeyLimits, String> {
        let charset = Charset::parse(charset)?;
        let limits = KeyLimits {
            min_len,
            max_len,
            charset,
        };
        limits.check()?;
        Ok(limits)
    }

    /// The derived form must always fit: hex digits allowed, 16..=64 of them possible.
    fn check(&self) -> Result<(), String> {
        if self.min_len > self.max_len {
            return Err(format!(
                "min length {} is above max length {}",
                self.min_len, self.max_len
            ));
        }
        if self.max_len < DERIVED_MIN_LEN {
            return Err(format!(
                "max length {} is below {DERIVED_MIN_LEN}: a derived key keeps at least 64 bits",
                self.max_len
            ));
        }
        if self.min_len > DERIVED_MAX_LEN {
            return Err(format!(
                "min length {} is above {DERIVED_MAX_LEN}, the length of a derived key",
                self.min_len
            ));
        }
        if !b"0123456789abcdef".iter().all(|b| self.charset.allows(*b)) {
            return Err(format!(
                "charset [{}] must allow 0-9 and a-f: derived keys are lowercase hex",
                self.charset.spec
            ));
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

/// A provider answer that says "this key was already used" instead of replaying the first
/// answer. It is never a receipt: the operation exists, but this is not its response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DuplicateRejection {
    pub status: u16,
    /// The value of the top-level `code` field of the JSON body (number or string).
    pub code: String,
    /// Where an operator finds the original; `{key}` is replaced by the key passed down.
    pub lookup_hint: String,
}

impl DuplicateRejection {
    pub fn matches(&self, status: u16, body: &[u8]) -> bool {
        if status != self.status {
            return false;
        }
        let Ok(serde_json::Value::Object(map)) = serde_json::from_slice(body) else {
            return false;
        };
        match map.get("code") {
            Some(serde_json::Value::Number(n)) => n.to_string() == self.code,
            Some(serde_json::Value::String(s)) => *s == self.code,
            _ => false,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Profile {
    pub name: &'static str,
    /// The provider deduplicates requests carrying the same key, so an uncertain outcome
    /// may be retried with the same key.
    pub honours_key: bool,
    pub placement: Placement,
    pub limits: KeyLimits,
    /// Statuses kept as the receipt; `None`: the proxy's default.
    pub commit_statuses: Option<&'static [&'static str]>,
    pub duplicate: Option<DuplicateRejection>,
    /// Hold UNKNOWN outcomes until an operator resolves them (`hold = "forever"`).
    pub hold_forever: bool,
}

struct Spec {
    name: &'static str,
    honours_key: bool,
    header: Option<&'static str>,
    body_field: Option<&'static str>,
    min_len: usize,
    max_len: usize,
    charset: &'static str,
    commit_statuses: Option<&'static [&'static str]>,
    duplicate: Option<(u16, &'static str, &'static str)>,
    hold_forever: bool,
}

const HEADER: Spec = Spec {
    name: "",
    honours_key: true,
    header: Some("Idempotency-Key"),
    body_field: None,
    min_len: 1,
    max_len: 255,
    charset: VISIBLE_ASCII,
    commit_statuses: None,
    duplicate: None,
    hold_forever: false,
};

/// No provider-side deduplication: the proxy's claim is the only protection, and ambiguous
/// outcomes (timeouts, 500/502/504) are held as UNKNOWN.
const NO_KEY: Spec = Spec {
    honours_key: false,
    header: None,
    ..HEADER
};

const SPECS: &[Spec] = &[
    // Stripe v1: `Idempotency-Key`, ≤ 255 chars, kept ≥ 24 h, replays even 500s [SD][SLL].
    Spec {
        name: "stripe",
        ..HEADER
    },
    // Adyen: `Idempotency-Key`, ≤ 64 chars, kept ≥ 31 days [ADY].
    Spec {
        name: "adyen",
        max_len: 64,
        ..HEADER
    },
    // PayPal REST: `PayPal-Request-Id`; per-API limits not confirmed, so the proxy's own
    // 255 applies [PP][PPE].
    Spec {
        name: "paypal",
        header: Some("PayPal-Request-Id"),
        ..HEADER
    },
    // Checkout.com: `Cko-Idempotency-Key`; only 2xx are stored, 4xx/5xx are re-attempted
    // [CKO], so only 2xx become receipts here too (a retry after a decline re-executes at
    // Checkout.com anyway).
    Spec {
        name: "checkout",
        header: Some("Cko-Idempotency-Key"),
        commit_statuses: Some(&["2xx"]),
        ..HEADER
    },
    // GoCardless: `Idempotency-Key` on create endpoints; a reused key answers 409
    // `idempotent_creation_conflict` with `links.conflicting_resource_id` [GC]. 409 is never
    // committed by default, so that answer passes through and the claim is released.
    Spec {
        name: "gocardless",
        ..HEADER
    },
    // Resend: `Idempotency-Key`, ≤ 256 chars, kept 24 h [RS].
    Spec {
        name: "resend",
        max_len: 256,
        ..HEADER
    },
    // Razorpay X payouts: `X-Payout-Idempotency`, 4–36 of `[A-Za-z0-9 _-]` [RZP].
    Spec {
        name: "razorpay",
        header: Some("X-Payout-Idempotency"),
        min_len: 4,
        max_len: 36,
        charset: "A-Za-z0-9 _-",
        ..HEADER
    },
    // Square: body `idempotency_key`; CreatePayment allows 1–45 chars (Square SDK model
    // docs, `CreatePaymentRequest`: "Maximum Length: 45"), the tightest of its endpoints [SQ].
    Spec {
        name: "square",
        header: None,
        body_field: Some("idempotency_key"),
        max_len: 45,
        ..HEADER
    },
    // Plaid: body `idempotency_key`; /transfer/create documents "Maximum of 50 characters"
    // (128 on payment consents) [PL][PLT].
    Spec {
        name: "plaid",
        header: None,
        body_field: Some("idempotency_key"),
        max_len: 50,
        ..HEADER
    },
    // Alpaca orders: body `client_order_id`, ≤ 128 chars [ALP]. A duplicate is rejected
    // with 422 `{"code":40010001,"message":"client_order_id must be unique"}` rather than
    // replayed [ALP422], and uniqueness is reported only among *active* orders, so Alpaca
    // is not trusted to deduplicate: ambiguous outcomes are held until an operator looks
    // (GET /v2/orders:by_client_order_id) instead of being retried.
    Spec {
        name: "alpaca",
        honours_key: false,
        header: None,
        body_field: Some("client_order_id"),
        max_len: 128,
        duplicate: Some((
            422,
            "40010001",
            "GET /v2/orders:by_client_order_id?client_order_id={key}",
        )),
        hold_forever: true,
        ..HEADER
    },
    // No request idempotency documented [SG][MG][PM][EC2][TW17534].
    Spec {
        name: "sendgrid",
        ..NO_KEY
    },
    Spec {
        name: "postmark",
        ..NO_KEY
    },
    Spec {
        name: "mailgun",
        ..NO_KEY
    },
    Spec {
        name: "ses",
        ..NO_KEY
    },
    Spec {
        name: "twilio",
        ..NO_KEY
    },
];

fn build(spec: &Spec) -> Profile {
    let placement = match (spec.header, spec.body_field) {
        (Some(h), _) => Placement::Header(h.to_string()),
        (None, Some(f)) => Placement::BodyField(f.to_string()),
        (None, None) => Placement::None,
    };
    Profile {
        name: spec.name,
        honours_key: spec.honours_key,
        placement,
        // The table is constant and covered by a test; fall back to the proxy's own limits
        // rather than panic if an entry were ever wrong.
        limits: KeyLimits::new(spec.min_len, spec.max_len, spec.charset)
            .unwrap_or_else(|_| default_limits()),
        commit_statuses: spec.commit_statuses,
        duplicate: spec
            .duplicate
            .map(|(status, code, hint)| DuplicateRejection {
                status,
                code: code.to_string(),
                lookup_hint: hint.to_string(),
            }),
        hold_forever: spec.hold_forever,
    }
}

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

pub fn lookup(name: &str) -> Option<Profile> {
    SPECS
        .iter()
        .find(|p| p.name.eq_ignore_ascii_case(name))
        .map(build)
}

pub fn names() -> Vec<&'static str> {
    SPECS.iter().map(|p| p.name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_profile_table_entry_is_valid() {
        for spec in SPECS {
            KeyLimits::new(spec.min_len, spec.max_len, spec.charset)
                .unwrap_or_else(|e| panic!("{}: {e}", spec.name));
            assert!(lookup(spec.name).is_some());
        }
        assert_eq!(names().len(), 15);
    }

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
    fn keys_that_fit_pass_unchanged_others_get_a_stable_hex_form() {
        let rzp = lookup("razorpay").expect("profile").limits;
        assert_eq!(rzp.fit("order 42_a-b"), "order 42_a-b");
        // Too short, too long, and a character outside the set.
        for bad in ["abc", &"x".repeat(37), "pay:inv-1"] {
            let fitted = rzp.fit(bad);
            assert_eq!(fitted.len(), 36, "{bad}");
            assert!(rzp.fits(&fitted), "{fitted}");
            assert_eq!(fitted, rzp.fit(bad), "deterministic");
            assert_eq!(
                fitted,
                hex::encode(Sha256::digest(bad.as_bytes()))[..36],
                "documented transform"
            );
        }
        assert_ne!(rzp.fit("abc"), rzp.fit("abd"));
        let adyen = lookup("adyen").expect("profile").limits;
        assert_eq!(adyen.fit(&"k".repeat(65)).len(), 64);
        assert_eq!(adyen.fit(&"k".repeat(64)), "k".repeat(64));
    }

    #[test]
    fn limits_that_could_not_hold_a_derived_key_are_refused() {
        assert!(KeyLimits::new(1, 8, VISIBLE_ASCII).is_err());
        assert!(KeyLimits::new(70, 80, VISIBLE_ASCII).is_err());
        assert!(KeyLimits::new(5, 4, VISIBLE_ASCII).is_err());
        assert!(KeyLimits::new(1, 40, "A-Z").is_err());
        assert!(KeyLimits::new(1, 40, "a-z0-9").is_ok());
    }

    #[test]
    fn alpaca_duplicate_rejection_matches_its_code_only() {
        let alpaca = lookup("alpaca").expect("profile");
        let dup = alpaca.duplicate.expect("alpaca rejects duplicates");
        assert!(dup.matches(
            422,
            br#"{"code":40010001,"message":"client_order_id must be unique"}"#
        ));
        assert!(dup.matches(422, br#"{"code":"40010001"}"#));
        assert!(!dup.matches(422, br#"{"code":40010002,"message":"qty must be > 0"}"#));
        assert!(!dup.matches(200, br#"{"code":40010001}"#));
        assert!(!dup.matches(422, b"not json"));
        assert!(!alpaca.honours_key);
        assert_eq!(
            alpaca.placement,
            Placement::BodyField("client_order_id".into())
        );
    }
}
