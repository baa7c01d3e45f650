//! What the store keeps under a scope: a claim in one of three states, and the receipt.
//!
//! Encoded as `<state><token>` (33 bytes) followed by JSON, or by the JSON and the receipt's
//! body deflated (what the embedded store may write; `compact` writes that form and reads
//! both). The fixed header lets the Redis scripts and the SQL stores fence a transition by
//! comparing a prefix, without decoding.

use std::borrow::Cow;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

pub const TOKEN_LEN: usize = 32;
pub const HEADER_LEN: usize = 1 + TOKEN_LEN;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum State {
    /// A holder is executing the request; `lease_until_ms` says until when it answers for it.
    Pending,
    /// The provider's response is the receipt.
    Committed,
    /// The request may or may not have taken effect at the provider.
    Unknown,
}

impl State {
    pub fn code(self) -> u8 {
        match self {
            State::Pending => b'P',
            State::Committed => b'C',
            State::Unknown => b'U',
        }
    }

    pub fn from_code(c: u8) -> Option<State> {
        match c {
            b'P' => Some(State::Pending),
            b'C' => Some(State::Committed),
            b'U' => Some(State::Unknown),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            State::Pending => "PENDING",
            State::Committed => "COMMITTED",
            State::Unknown => "UNKNOWN",
        }
    }
}

/// A random 128-bit claim token in hex; the fence every transition checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    /// A token read back from a stored header: 32 hex digits, or nothing.
    pub(super) fn parse(hex: &str) -> Option<Token> {
        (hex.len() == TOKEN_LEN && hex.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| Token(hex.to_string()))
    }

    pub fn random() -> Token {
        Token(crate::hex::lower(&rand::random::<[u8; 16]>()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Which records a transition may overwrite: the same token, in one of these states.
#[derive(Debug, Clone)]
pub struct Fence {
    pub token: Token,
    pub states: Vec<State>,
}

impl Fence {
    /// `"PU"`-style list of state codes, as the store scripts take it.
    pub fn state_codes(&self) -> String {
        self.states.iter().map(|s| s.code() as char).collect()
    }

    pub fn admits(&self, record: &Record) -> bool {
        record.token == self.token && self.states.contains(&record.state)
    }

    /// `admits` on an encoded record, reading only its 33-byte header (as the Redis scripts do).
    pub fn admits_encoded(&self, raw: &[u8]) -> bool {
        raw.len() >= HEADER_LEN
            && self.states.iter().any(|s| s.code() == raw[0])
            && &raw[1..HEADER_LEN] == self.token.as_str().as_bytes()
    }
}

/// A provider response kept to replay: status, end-to-end headers, body exactly as received.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    pub status: u16,
    /// Header values as Latin-1 strings, so any byte survives JSON unchanged.
    pub headers: Vec<(String, String)>,
    #[serde(with = "b64")]
    pub body: Bytes,
}

impl Receipt {
    /// Borrowed in the usual case, ASCII, where Latin-1 and UTF-8 agree byte for byte.
    pub fn header_value_bytes(v: &str) -> Cow<'_, [u8]> {
        if v.is_ascii() {
            Cow::Borrowed(v.as_bytes())
        } else {
            Cow::Owned(v.chars().map(|c| c as u32 as u8).collect())
        }
    }

    pub fn header_value_string(v: &[u8]) -> String {
        if v.is_ascii() {
            String::from_utf8_lossy(v).into_owned()
        } else {
            v.iter().map(|&b| b as char).collect()
        }
    }
}

/// A receipt encrypted at rest: the cipher, and `nonce || ciphertext` of the receipt's JSON,
/// bound to the record's scope and fingerprint (`crate::store` seals and opens it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SealedReceipt {
    pub cipher: Cipher,
    #[serde(with = "b64")]
    pub data: Bytes,
}

/// How a sealed receipt was sealed; a store holding one this build does not know is corrupt
/// to it, never replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Cipher {
    #[serde(rename = "aes-256-gcm")]
    Aes256Gcm,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub state: State,
    pub token: Token,
    pub body: RecordBody,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordBody {
    pub fingerprint: String,
    /// Route name, for operators.
    pub route: String,
    pub created_ms: u64,
    /// PENDING: the holder answers for the claim until then.
    #[serde(default)]
    pub lease_until_ms: u64,
    /// UNKNOWN: since when; the hold period counts from here.
    #[serde(default)]
    pub unknown_since_ms: u64,
    /// Why the outcome is unknown, or who resolved it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt: Option<Receipt>,
    /// The receipt as a store keeps it under `[encryption]`, in place of `receipt`: only the
    /// store's guard seals and opens it, so the claim machine never sees one. (Boxed: rare,
    /// and every record carries the field.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sealed_receipt: Option<Box<SealedReceipt>>,
    /// COMMITTED: the receipt says nothing happened (a decline), so a corrected request for
    /// the same derived operation may execute as a new attempt.
    #[serde(default, skip_serializing_if = "is_false")]
    pub declined: bool,
    /// New attempts after declined ones; part of the key passed down, so the provider does not
    /// answer a corrected attempt with the decline it keeps.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub attempt: u32,
    /// COMMITTED by asking the provider (a lookup), not by the call's own answer.
    #[serde(default, skip_serializing_if = "is_false")]
    pub reconciled: bool,
    /// When the outcome was written (COMMITTED), for the operator's history.
    #[serde(default, skip_serializing_if = "is_zero_ms")]
    pub settled_ms: u64,
    /// Who resolved a held outcome, when, how and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved: Option<Box<ResolvedBy>>,
    /// On a capped operation: the canonical fingerprint of what was priced (and approved)
    /// for the first attempt. A takeover or a lookup's "not found" executes a retry only if
    /// its own is the same: what executes is what was priced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priced: Option<String>,
    /// On a route with a lookup: its target as the attempt that executes rendered it, with
    /// `{key}` left for the key that attempt passed down. A retry never steers where the
    /// proxy asks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lookup_target: Option<String>,
    /// On a route with a lookup: a hash of the credentials that attempt carried (never the
    /// credentials). A lookup runs with a retry's credentials only when they hash the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lookup_credentials: Option<String>,
    /// SHA-256 (hex) of the key the attempt passed down, never the key: what an operator's
    /// `passed_down` in `keys reconcile` is checked against, so a typo never releases an
    /// operation that happened. Written with the attempt's first lease renewal or its
    /// outcome; a claim whose holder died before either keeps none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passed_down_sha256: Option<String>,
    /// PENDING between two rounds of one call: the last round asked the client for input (an
    /// MCP `input_required` result) and executed nothing. Until then the claim waits for the
    /// same call's continuation, which takes it over; a lapsed wait counts as a release.
    #[serde(default, skip_serializing_if = "is_zero_ms")]
    pub awaiting_until_ms: u64,
    /// A purchase (x402): the payment credential its first attempt presented, kept while the
    /// outcome is open so that a retry presents it again rather than a new one (a signed
    /// authorization settles at most once), and dropped when the purchase is committed.
    /// Taken over with the claim; never shown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presented: Option<Box<Presented>>,
    /// How the scope and fingerprint were derived from the request (`identity::derivation`);
    /// records written before versions were kept are version 1.
    #[serde(default = "first_derivation")]
    pub derivation: u8,
}

/// A payment credential as the attempt that executed presented it (see
/// `RecordBody::presented`).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Presented {
    /// The header it went down in.
    pub header: String,
    pub value: String,
    /// When it can no longer settle (unix ms): a re-presentation after it is pointless.
    pub until_ms: u64,
}

/// Never printed: a record's debug output must not carry a credential.
impl std::fmt::Debug for Presented {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Presented")
            .field("header", &self.header)
            .field("value", &"[redacted]")
            .field("until_ms", &self.until_ms)
            .finish()
    }
}

fn first_derivation() -> u8 {
    1
}

/// A person's (or a lookup's) resolution of a held outcome, kept with the receipt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolvedBy {
    pub by: String,
    pub at_ms: u64,
    /// `committed` (a receipt the operator gave), `attested` (a response pasted by the
    /// operator, marked so on every replay), `reconciled` (the provider was asked).
    pub how: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
    /// The provider's id of the object the operation made, when the operator gave it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<String>,
}

fn is_zero_ms(n: &u64) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[derive(Debug, thiserror::Error)]
#[error("stored record is corrupt: {0}")]
pub struct DecodeError(pub String);

impl Record {
    pub fn fence(&self) -> Fence {
        Fence {
            token: self.token.clone(),
            states: vec![self.state],
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        // Sized for the receipt (its body grows by a third as base64) so the JSON is written
        // in place without regrowing: a committed record's encoding was copied four times.
        let receipt = self.body.receipt.as_ref().map_or(0, |r| {
            r.body.len() / 3 * 4
                + r.headers
                    .iter()
                    .map(|(n, v)| n.len() + v.len() + 8)
                    .sum::<usize>()
        });
        let mut out = Vec::with_capacity(HEADER_LEN + 384 + receipt);
        out.push(self.state.code());
        out.extend_from_slice(self.token.as_str().as_bytes());
        // Serializing plain structs of strings and numbers into a Vec cannot fail; a failure
        // would leave a record that does not decode, never a wrong one.
        let _ = serde_json::to_writer(&mut out, &self.body);
        out
    }
}

/// Bytes as base64 inside a JSON record (receipt bodies; approvals' request bodies).
pub(crate) mod b64 {
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer, B: AsRef<[u8]>>(b: &B, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(b))
    }

    pub fn deserialize<'de, D: Deserializer<'de>, B: From<Vec<u8>>>(d: D) -> Result<B, D::Error> {
        let s = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(s)
            .map(B::from)
            .map_err(serde::de::Error::custom)
    }
}

impl Record {
    /// A COMMITTED record that no request claimed: what the proxy keeps about an object a
    /// route made (a counted object's marker, a recorded price), under a scope no client key
    /// can name. `note` says what it is; `receipt` carries what a later request reads.
    pub fn marker(route: &str, now_ms: u64, note: String, receipt: Option<Receipt>) -> Record {
        Record {
            state: State::Committed,
            token: Token::random(),
            body: RecordBody {
                fingerprint: String::new(),
                route: route.to_string(),
                created_ms: now_ms,
                lease_until_ms: 0,
                unknown_since_ms: 0,
                note: Some(note),
                receipt,
                sealed_receipt: None,
                declined: false,
                attempt: 0,
                reconciled: false,
                settled_ms: now_ms,
                resolved: None,
                priced: None,
                lookup_target: None,
                lookup_credentials: None,
                passed_down_sha256: None,
                awaiting_until_ms: 0,
                presented: None,
                derivation: 2,
            },
        }
    }
}

/// A record for tests: fingerprint `fp`, route `r`, and a small receipt when COMMITTED.
#[cfg(test)]
impl Record {
    pub(crate) fn for_test(state: State) -> Record {
        Record {
            state,
            token: Token::random(),
            body: RecordBody {
                fingerprint: "fp".into(),
                route: "r".into(),
                created_ms: 0,
                lease_until_ms: 0,
                unknown_since_ms: 0,
                note: None,
                receipt: (state == State::Committed).then(|| Receipt {
                    status: 200,
                    headers: vec![],
                    body: Bytes::from_static(b"ok"),
                }),
                sealed_receipt: None,
                declined: false,
                attempt: 0,
                reconciled: false,
                derivation: 2,
                settled_ms: 0,
                resolved: None,
                priced: None,
                lookup_target: None,
                lookup_credentials: None,
                passed_down_sha256: None,
                awaiting_until_ms: 0,
                presented: None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_values_keep_every_byte_on_the_ascii_path_and_off_it() {
        let every: Vec<u8> = (0..=255).collect();
        for value in [
            &b"application/json"[..],
            &every[..],
            &every[..128],
            &every[128..],
        ] {
            let stored = Receipt::header_value_string(value);
            assert_eq!(&*Receipt::header_value_bytes(&stored), value);
        }
        // Stored as Latin-1: a byte above 0x7f is one char, never a UTF-8 sequence.
        assert_eq!(
            Receipt::header_value_string(&[0xc3, 0xa9]).chars().count(),
            2
        );
    }

    #[test]
    fn round_trips_every_byte_of_a_receipt() {
        let r = Record {
            state: State::Committed,
            token: Token::random(),
            body: RecordBody {
                fingerprint: "ab".into(),
                route: "stripe".into(),
                created_ms: 1,
                lease_until_ms: 2,
                unknown_since_ms: 0,
                note: None,
                receipt: Some(Receipt {
                    status: 201,
                    headers: vec![(
                        "x-odd".into(),
                        Receipt::header_value_string(&[0xff, b'a', 0x80]),
                    )],
                    body: Bytes::from_static(&[0, 1, 2, 255]),
                }),
                sealed_receipt: None,
                declined: true,
                attempt: 3,
                reconciled: true,
                derivation: 2,
                settled_ms: 5,
                resolved: Some(Box::new(ResolvedBy {
                    by: "ana".into(),
                    at_ms: 6,
                    how: "attested".into(),
                    why: Some("seen in the dashboard".into()),
                    object: Some("ch_1".into()),
                })),
                priced: Some("p".into()),
                lookup_target: Some("/v1/x/{key}".into()),
                lookup_credentials: Some("c".into()),
                passed_down_sha256: None,
                awaiting_until_ms: 0,
                presented: None,
            },
        };
        let enc = r.encode();
        assert_eq!(enc[0], b'C');
        assert_eq!(&enc[1..HEADER_LEN], r.token.as_str().as_bytes());
        // Byte for byte what every version wrote: the header, then `to_vec` of the body.
        let json = serde_json::to_vec(&r.body).expect("serializes");
        assert_eq!(&enc[HEADER_LEN..], &json[..]);
        let back = Record::decode(&enc).expect("decodes");
        assert_eq!(back, r);
        let receipt = back.body.receipt.expect("receipt");
        assert_eq!(
            &*Receipt::header_value_bytes(&receipt.headers[0].1),
            [0xff, b'a', 0x80]
        );
    }

    #[test]
    fn records_from_before_derivations_were_kept_are_version_1() {
        let old = b"C0123456789abcdef0123456789abcdef{\"fingerprint\":\"f\",\"route\":\"r\",\"created_ms\":1}";
        assert_eq!(Record::decode(old).expect("decodes").body.derivation, 1);
        let new = Record::for_test(State::Pending).encode();
        assert!(String::from_utf8_lossy(&new).contains("\"derivation\":2"));
    }

    #[test]
    fn corrupt_records_are_errors_not_panics() {
        assert!(Record::decode(b"").is_err());
        assert!(Record::decode(b"X0123456789abcdef0123456789abcdef{}").is_err());
        assert!(Record::decode(b"P0123456789abcdef0123456789abcdef{").is_err());
        assert!(Record::decode(b"Pzz23456789abcdef0123456789abcdef{}").is_err());
    }
}
