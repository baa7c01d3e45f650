//! Receipts encrypted at rest (AES-256-GCM). A store wrapper seals the receipt inside each
//! record on the way in and opens it on the way out, so the claim header the stores fence on
//! (`state + token`) and the fingerprint stay in clear while provider responses do not.
//!
//! A sealed receipt is stored as a receipt with status 0 (no HTTP status is 0), one marker
//! header, and `nonce || ciphertext` as its body. The scope and fingerprint are the associated
//! data, so a sealed receipt copied under another key does not open.

use std::sync::Arc;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use async_trait::async_trait;
use base64::Engine as _;
use bytes::Bytes;

use super::{Expiry, SettleSink, Store, StoreError};
use crate::config::EncryptionConfig;
use crate::idempotency::record::{DecodeError, Fence, Receipt, Record, State};

const MARKER: &str = "idemproxy-sealed";
const ALGORITHM: &str = "aes-256-gcm/v1";
const NONCE_LEN: usize = 12;

/// Why the configured receipt key cannot be used, and which field says so.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct KeyError {
    pub field: &'static str,
    pub message: String,
}

/// The receipt key, when configured.
pub struct Sealer {
    cipher: Aes256Gcm,
}

impl Sealer {
    /// The key `[encryption]` names; `None` when it names none.
    pub fn load(enc: &EncryptionConfig) -> Result<Option<Sealer>, KeyError> {
        let bad = |field: &'static str, message: String| KeyError { field, message };
        let (field, raw) = match (&enc.key_env, &enc.key_file) {
            (None, None) => return Ok(None),
            (Some(_), Some(_)) => {
                return Err(bad(
                    "encryption",
                    "set key_env or key_file, not both".into(),
                ))
            }
            (Some(var), None) => match std::env::var(var) {
                Ok(v) if !v.trim().is_empty() => {
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
    pub(super) fn seal_bytes(&self, aad: &[u8], plain: &[u8]) -> Result<Vec<u8>, StoreError> {
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
    pub(super) fn open_bytes(&self, aad: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
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

    fn seal(&self, scope: &str, record: &Record) -> Result<Record, StoreError> {
        let Some(receipt) = &record.body.receipt else {
            return Ok(record.clone());
        };
        let plain = serde_json::to_vec(receipt)
            .map_err(|e| StoreError::Unavailable(format!("cannot serialise a receipt: {e}")))?;
        let nonce: [u8; NONCE_LEN] = rand::random();
        let aad = associated_data(scope, &record.body.fingerprint);
        let sealed = self
            .cipher
            .encrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: &plain,
                    aad: &aad,
                },
            )
            .map_err(|_| StoreError::Unavailable("cannot encrypt a receipt".into()))?;
        let mut body = Vec::with_capacity(NONCE_LEN + sealed.len());
        body.extend_from_slice(&nonce);
        body.extend_from_slice(&sealed);
        let mut out = record.clone();
        out.body.receipt = Some(Receipt {
            status: 0,
            headers: vec![(MARKER.into(), ALGORITHM.into())],
            body: Bytes::from(body),
        });
        Ok(out)
    }
}

fn is_sealed(receipt: &Receipt) -> bool {
    receipt.status == 0 && receipt.headers.first().is_some_and(|(k, _)| k == MARKER)
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

/// Wraps every store; without a key it only refuses to hand out sealed receipts it cannot open
/// (fail closed: 503, never a re-execution and never ciphertext sent to a client).
pub struct SealedStore {
    inner: Arc<dyn Store>,
    sealer: Option<Arc<Sealer>>,
}

impl SealedStore {
    pub fn wrap(inner: Arc<dyn Store>, sealer: Option<Arc<Sealer>>) -> Arc<dyn Store> {
        Arc::new(SealedStore { inner, sealer })
    }

    fn seal(&self, scope: &str, record: &Record) -> Result<Record, StoreError> {
        match &self.sealer {
            Some(s) => s.seal(scope, record),
            None => Ok(record.clone()),
        }
    }

    fn open(&self, scope: &str, mut record: Record) -> Result<Record, StoreError> {
        let Some(receipt) = record.body.receipt.as_ref().filter(|r| is_sealed(r)) else {
            // Plain receipts (written before encryption was turned on) still replay.
            return Ok(record);
        };
        let Some(sealer) = &self.sealer else {
            return Err(DecodeError(format!(
                "the receipt under {scope} is encrypted and no [encryption] key is configured"
            ))
            .into());
        };
        let body = &receipt.body;
        if body.len() < NONCE_LEN {
            return Err(
                DecodeError(format!("the sealed receipt under {scope} is truncated")).into(),
            );
        }
        let aad = associated_data(scope, &record.body.fingerprint);
        let plain = sealer
            .cipher
            .decrypt(
                Nonce::from_slice(&body[..NONCE_LEN]),
                Payload {
                    msg: &body[NONCE_LEN..],
                    aad: &aad,
                },
            )
            .map_err(|_| {
                DecodeError(format!(
                    "the receipt under {scope} does not open with the configured key (wrong key, or tampered)"
                ))
            })?;
        let receipt: Receipt = serde_json::from_slice(&plain)
            .map_err(|e| DecodeError(format!("sealed receipt under {scope}: {e}")))?;
        record.body.receipt = Some(receipt);
        Ok(record)
    }
}

#[async_trait]
impl Store for SealedStore {
    async fn insert_if_absent(
        &self,
        scope: &str,
        record: &Record,
        expiry: Expiry,
    ) -> Result<Option<Record>, StoreError> {
        let sealed = self.seal(scope, record)?;
        match self.inner.insert_if_absent(scope, &sealed, expiry).await? {
            Some(found) => self.open(scope, found).map(Some),
            None => Ok(None),
        }
    }

    async fn get(&self, scope: &str) -> Result<Option<Record>, StoreError> {
        match self.inner.get(scope).await? {
            Some(found) => self.open(scope, found).map(Some),
            None => Ok(None),
        }
    }

    async fn replace(
        &self,
        scope: &str,
        fence: &Fence,
        record: &Record,
        expiry: Expiry,
    ) -> Result<bool, StoreError> {
        let sealed = self.seal(scope, record)?;
        self.inner.replace(scope, fence, &sealed, expiry).await
    }

    async fn remove(&self, scope: &str, fence: &Fence) -> Result<bool, StoreError> {
        self.inner.remove(scope, fence).await
    }

    async fn list(&self, state: State, limit: usize) -> Result<Vec<(String, Record)>, StoreError> {
        self.inner
            .list(state, limit)
            .await?
            .into_iter()
            .map(|(scope, r)| self.open(&scope, r).map(|r| (scope, r)))
            .collect()
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }

    async fn durability_warning(&self) -> Option<String> {
        self.inner.durability_warning().await
    }

    // Wait-mode wake-ups across proxies must pass through this wrapper untouched.
    async fn announce_settled(&self, scope: &str) -> Result<(), StoreError> {
        self.inner.announce_settled(scope).await
    }

    fn listen_settled(&self, sink: Arc<dyn SettleSink>) {
        self.inner.listen_settled(sink)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::record::Token;

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

    fn store(sealer: Option<Sealer>) -> SealedStore {
        let sealer = sealer.map(Arc::new);
        SealedStore {
            inner: Arc::new(NoStore),
            sealer,
        }
    }

    struct NoStore;
    #[async_trait]
    impl Store for NoStore {
        async fn insert_if_absent(
            &self,
            _: &str,
            _: &Record,
            _: Expiry,
        ) -> Result<Option<Record>, StoreError> {
            Ok(None)
        }
        async fn get(&self, _: &str) -> Result<Option<Record>, StoreError> {
            Ok(None)
        }
        async fn replace(
            &self,
            _: &str,
            _: &Fence,
            _: &Record,
            _: Expiry,
        ) -> Result<bool, StoreError> {
            Ok(false)
        }
        async fn remove(&self, _: &str, _: &Fence) -> Result<bool, StoreError> {
            Ok(false)
        }
        async fn list(&self, _: State, _: usize) -> Result<Vec<(String, Record)>, StoreError> {
            Ok(vec![])
        }
        async fn ping(&self) -> Result<(), StoreError> {
            Ok(())
        }
    }

    #[test]
    fn seals_opens_and_binds_to_the_scope() {
        let s = store(Some(Sealer::new(&[7; 32])));
        let r = record(Some(receipt()));
        let sealed = s.seal("idem:t:aa", &r).expect("seal");
        assert_eq!(
            &sealed.encode()[..33],
            &r.encode()[..33],
            "the fenced header stays clear"
        );
        let raw = sealed.encode();
        assert!(!raw.windows(9).any(|w| w == b"ch_secret"));
        assert!(!String::from_utf8_lossy(&raw).contains("application/json"));
        assert_eq!(s.open("idem:t:aa", sealed.clone()).expect("open"), r);
        assert!(
            s.open("idem:t:bb", sealed.clone()).is_err(),
            "moved to another scope"
        );
        assert!(store(Some(Sealer::new(&[8; 32])))
            .open("idem:t:aa", sealed.clone())
            .is_err());
        assert!(
            store(None).open("idem:t:aa", sealed).is_err(),
            "no key: refused, not replayed"
        );
        // Plain receipts from before encryption was turned on still open.
        assert_eq!(s.open("idem:t:aa", r.clone()).expect("plain"), r);
        let no_receipt = record(None);
        assert_eq!(s.seal("x", &no_receipt).expect("seal"), no_receipt);
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
