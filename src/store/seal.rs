//! Encryption at rest (`[encryption]`, AES-256-GCM) of what stores keep that the provider or
//! the tool wrote: receipts, and the request bodies approvers read. The store's guard seals
//! on the way in and opens on the way out, so the claim header the stores fence on (`state +
//! token`) and the fingerprint stay in clear while provider responses do not.
//!
//! A sealed receipt is a [`SealedReceipt`] in the record, in place of the receipt, bound to
//! the scope and fingerprint: copied under another key it does not open. Stores written
//! before it had a type of its own hold it as a receipt with status 0 and an
//! `idemproxy-sealed` header ([`legacy`]); those still open.

use std::borrow::Cow;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use base64::Engine as _;
use bytes::Bytes;

use crate::config::{EncryptionConfig, Environment};
use crate::idempotency::record::{Cipher, DecodeError, Receipt, Record, SealedReceipt};
use crate::idempotency::store::StoreError;
use crate::spend::port::Approval;

const NONCE_LEN: usize = 12;

/// Why the configured receipt key cannot be used, and which field says so.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct SealKeyError {
    pub field: &'static str,
    pub message: String,
}

/// The receipt key, when configured.
pub struct Sealer {
    cipher: Aes256Gcm,
}

impl Sealer {
    /// The key `[encryption]` names; `None` when it names none.
    pub fn load(enc: &EncryptionConfig, env: &Environment) -> Result<Option<Sealer>, SealKeyError> {
        let bad = |field: &'static str, message: String| SealKeyError { field, message };
        let (field, raw) = match (&enc.key_env, &enc.key_file) {
            (None, None) => return Ok(None),
            (Some(_), Some(_)) => {
                return Err(bad(
                    "encryption",
                    "set key_env or key_file, not both".into(),
                ))
            }
            (Some(var), None) => match env.var(var) {
                Some(v) if !v.trim().is_empty() => {
                    ("encryption.key_env", v.trim().as_bytes().to_vec())
                }
                _ => {
                    return Err(bad(
                        "encryption.key_env",
                        format!("the environment variable `{var}` is not set or empty"),
                    ))
                }
            },
            (None, Some(path)) => match std::fs::read(path) {
                Ok(bytes) => ("encryption.key_file", bytes),
                Err(e) => {
                    return Err(bad(
                        "encryption.key_file",
                        format!("cannot read {}: {e}", path.display()),
                    ))
                }
            },
        };
        let key = parse_key(&raw).ok_or_else(|| {
            bad(
                field,
                "the key must be 32 bytes: 64 hex digits, base64, or a 32-byte file (e.g. `openssl rand -hex 32`)".into(),
            )
        })?;
        Ok(Some(Sealer::new(&key)))
    }

    pub fn new(key: &[u8; 32]) -> Sealer {
        Sealer {
            cipher: Aes256Gcm::new(key.into()),
        }
    }

    /// `nonce || ciphertext` of `plain`, bound to `aad`.
    fn seal_bytes(&self, aad: &[u8], plain: &[u8]) -> Result<Vec<u8>, StoreError> {
        let nonce: [u8; NONCE_LEN] = rand::random();
        let sealed = self
            .cipher
            .encrypt(Nonce::from_slice(&nonce), Payload { msg: plain, aad })
            .map_err(|_| StoreError::Unavailable("cannot encrypt".into()))?;
        let mut out = Vec::with_capacity(NONCE_LEN + sealed.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        Ok(out)
    }

    /// The plain bytes of `seal_bytes`' output; `None` when it does not open (wrong key,
    /// tampered, truncated).
    fn open_bytes(&self, aad: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
        if sealed.len() < NONCE_LEN {
            return None;
        }
        self.cipher
            .decrypt(
                Nonce::from_slice(&sealed[..NONCE_LEN]),
                Payload {
                    msg: &sealed[NONCE_LEN..],
                    aad,
                },
            )
            .ok()
    }
}

/// `record` as the store keeps it: its receipt sealed when a key is configured. Borrowed
/// when there is nothing to seal.
pub(super) fn seal_record<'r>(
    sealer: Option<&Sealer>,
    scope: &str,
    record: &'r Record,
) -> Result<Cow<'r, Record>, StoreError> {
    let (Some(sealer), Some(receipt)) = (sealer, &record.body.receipt) else {
        return Ok(Cow::Borrowed(record));
    };
    let plain = serde_json::to_vec(receipt)
        .map_err(|e| StoreError::Unavailable(format!("cannot serialise a receipt: {e}")))?;
    let data = sealer.seal_bytes(&associated_data(scope, &record.body.fingerprint), &plain)?;
    let mut out = record.clone();
    out.body.receipt = None;
    out.body.sealed_receipt = Some(Box::new(SealedReceipt {
        cipher: Cipher::Aes256Gcm,
        data: Bytes::from(data),
    }));
    Ok(Cow::Owned(out))
}

/// `record` as a store found it, its receipt opened. Without a key a sealed receipt is
/// refused (fail closed: a 503, never a re-execution and never ciphertext sent to a client);
/// plain receipts, written before encryption was turned on, come back as they are.
pub(super) fn open_record(
    sealer: Option<&Sealer>,
    scope: &str,
    mut record: Record,
) -> Result<Record, StoreError> {
    let sealed = match (record.body.sealed_receipt.take(), &record.body.receipt) {
        (None, Some(receipt)) => match legacy::sealed(receipt) {
            Some(sealed) => sealed,
            None => return Ok(record),
        },
        (None, None) => return Ok(record),
        (Some(sealed), None) => *sealed,
        (Some(_), Some(_)) => {
            return Err(corrupt(format!(
                "the record under {scope} holds a receipt both sealed and plain"
            )))
        }
    };
    let Some(sealer) = sealer else {
        return Err(corrupt(format!(
            "the receipt under {scope} is encrypted and no [encryption] key is configured"
        )));
    };
    let Cipher::Aes256Gcm = sealed.cipher;
    let aad = associated_data(scope, &record.body.fingerprint);
    let plain = sealer.open_bytes(&aad, &sealed.data).ok_or_else(|| {
        corrupt(format!(
            "the receipt under {scope} does not open with the configured key (wrong key, tampered, or truncated)"
        ))
    })?;
    let receipt: Receipt = serde_json::from_slice(&plain)
        .map_err(|e| corrupt(format!("sealed receipt under {scope}: {e}")))?;
    record.body.receipt = Some(receipt);
    Ok(record)
}

/// `a` as the store keeps it: its body sealed when a key is configured, bound to its id so a
/// sealed body copied under another approval does not open.
pub(super) fn seal_approval<'a>(
    sealer: Option<&Sealer>,
    a: &'a Approval,
) -> Result<Cow<'a, Approval>, StoreError> {
    match sealer {
        Some(sealer) if !a.body_sealed => Ok(Cow::Owned(Approval {
            body: sealer.seal_bytes(a.id.as_bytes(), &a.body)?,
            body_sealed: true,
            ..a.clone()
        })),
        _ => Ok(Cow::Borrowed(a)),
    }
}

/// `a` as a store found it, its body opened; without the key a sealed body is refused,
/// never shown as ciphertext.
pub(super) fn open_approval(
    sealer: Option<&Sealer>,
    mut a: Approval,
) -> Result<Approval, StoreError> {
    if !a.body_sealed {
        return Ok(a);
    }
    let Some(sealer) = sealer else {
        return Err(corrupt(format!(
            "the body of approval {} is encrypted and no [encryption] key is configured",
            a.id
        )));
    };
    a.body = sealer.open_bytes(a.id.as_bytes(), &a.body).ok_or_else(|| {
        corrupt(format!(
            "the body of approval {} does not open with the configured key",
            a.id
        ))
    })?;
    a.body_sealed = false;
    Ok(a)
}

fn corrupt(message: String) -> StoreError {
    DecodeError(message).into()
}

fn associated_data(scope: &str, fingerprint: &str) -> Vec<u8> {
    let mut aad = Vec::with_capacity(scope.len() + fingerprint.len() + 1);
    aad.extend_from_slice(scope.as_bytes());
    aad.push(0);
    aad.extend_from_slice(fingerprint.as_bytes());
    aad
}

fn parse_key(raw: &[u8]) -> Option<[u8; 32]> {
    let text = std::str::from_utf8(raw).ok().map(str::trim);
    let decoded = match text {
        Some(t) if t.len() == 64 => hex::decode(t).ok(),
        Some(t) if !t.is_empty() => base64::engine::general_purpose::STANDARD.decode(t).ok(),
        _ => None,
    }
    .or_else(|| (raw.len() == 32).then(|| raw.to_vec()))?;
    decoded.try_into().ok()
}

/// How stores written before sealed receipts had a type of their own hold one: a receipt
/// with status 0 (no HTTP status is 0), its first header `idemproxy-sealed`, and the
/// sealed bytes as its body. Read, never written.
mod legacy {
    use super::{Cipher, Receipt, SealedReceipt};

    const MARKER: &str = "idemproxy-sealed";

    pub(super) fn sealed(receipt: &Receipt) -> Option<SealedReceipt> {
        let sealed = receipt.status == 0
            && receipt
                .headers
                .first()
                .is_some_and(|(name, _)| name == MARKER);
        sealed.then(|| SealedReceipt {
            cipher: Cipher::Aes256Gcm,
            data: receipt.body.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::record::{State, Token};

    fn record(receipt: Option<Receipt>) -> Record {
        let mut r = Record::decode(
            format!(
                "C{}{{\"fingerprint\":\"fp\",\"route\":\"pay\",\"created_ms\":1}}",
                Token::random().as_str()
            )
            .as_bytes(),
        )
        .expect("record");
        r.body.receipt = receipt;
        r
    }

    fn receipt() -> Receipt {
        Receipt {
            status: 201,
            headers: vec![("content-type".into(), "application/json".into())],
            body: Bytes::from_static(b"{\"id\":\"ch_secret_receipt\"}"),
        }
    }

    #[test]
    fn seals_opens_and_binds_to_the_scope() {
        let key = Sealer::new(&[7; 32]);
        let r = record(Some(receipt()));
        let sealed = seal_record(Some(&key), "idem:t:aa", &r)
            .expect("seal")
            .into_owned();
        assert_eq!(
            &sealed.encode()[..33],
            &r.encode()[..33],
            "the fenced header stays clear"
        );
        let raw = sealed.encode();
        assert!(!raw.windows(9).any(|w| w == b"ch_secret"));
        assert!(!String::from_utf8_lossy(&raw).contains("application/json"));
        let open =
            |sealer: Option<&Sealer>, scope: &str| open_record(sealer, scope, sealed.clone());
        assert_eq!(open(Some(&key), "idem:t:aa").expect("open"), r);
        assert!(
            open(Some(&key), "idem:t:bb").is_err(),
            "moved to another scope"
        );
        assert!(open(Some(&Sealer::new(&[8; 32])), "idem:t:aa").is_err());
        assert!(
            open(None, "idem:t:aa").is_err(),
            "no key: refused, not replayed"
        );
        // Plain receipts from before encryption was turned on still open.
        assert_eq!(
            open_record(Some(&key), "idem:t:aa", r.clone()).expect("plain"),
            r
        );
        let no_receipt = record(None);
        assert!(matches!(
            seal_record(Some(&key), "x", &no_receipt).expect("seal"),
            Cow::Borrowed(_)
        ));
        assert!(matches!(
            seal_record(None, "x", &r).expect("no key"),
            Cow::Borrowed(_)
        ));
    }

    /// A sealed receipt is its own field of the stored record, not a receipt with a made-up
    /// status: the stored JSON has no `receipt` at all, and a record holding both is refused.
    #[test]
    fn a_sealed_receipt_is_stored_as_one_and_never_as_a_receipt() {
        let key = Sealer::new(&[7; 32]);
        let r = record(Some(receipt()));
        let stored = seal_record(Some(&key), "idem:t:aa", &r)
            .expect("seal")
            .encode();
        let json: serde_json::Value =
            serde_json::from_slice(&stored[33..]).expect("the body is JSON");
        assert!(json.get("receipt").is_none(), "{json}");
        assert_eq!(json["sealed_receipt"]["cipher"], "aes-256-gcm", "{json}");
        let mut both = Record::decode(&stored).expect("decodes");
        assert_eq!(both.state, State::Committed);
        both.body.receipt = Some(receipt());
        assert!(open_record(Some(&key), "idem:t:aa", both).is_err());
    }

    #[test]
    fn approval_bodies_are_sealed_at_rest_and_open_with_the_key_only() {
        let key = Sealer::new(&[3; 32]);
        let a = crate::spend::testing::approval("apr_1", 1);
        let at_rest = seal_approval(Some(&key), &a).expect("seal").into_owned();
        assert!(at_rest.body_sealed);
        assert!(
            !at_rest.body.windows(6).any(|w| w == b"amount"),
            "no plain body at rest"
        );
        assert_eq!(open_approval(Some(&key), at_rest.clone()).expect("open"), a);
        assert!(open_approval(Some(&Sealer::new(&[4; 32])), at_rest.clone()).is_err());
        assert!(
            open_approval(None, at_rest.clone()).is_err(),
            "no key: refused, not ciphertext"
        );
        let mut moved = at_rest;
        moved.id = "apr_2".into();
        assert!(open_approval(Some(&key), moved).is_err(), "bound to its id");
    }

    #[test]
    fn keys_parse_from_hex_base64_and_raw() {
        assert_eq!(parse_key(hex::encode([1u8; 32]).as_bytes()), Some([1; 32]));
        let b64 = base64::engine::general_purpose::STANDARD.encode([2u8; 32]);
        assert_eq!(parse_key(format!("{b64}\n").as_bytes()), Some([2; 32]));
        assert_eq!(parse_key(&[3u8; 32]), Some([3; 32]));
        assert_eq!(parse_key(b"short"), None);
        assert_eq!(parse_key(hex::encode([1u8; 16]).as_bytes()), None);
    }
}
