//! x402's three messages as they travel over HTTP, read and nothing more: the challenge a
//! seller answers `402` with (v2: base64 JSON in `PAYMENT-REQUIRED`; v1: the same object as
//! the body), the payment a client repeats the request with (v2 `PAYMENT-SIGNATURE`, v1
//! `X-PAYMENT`), and the settlement the seller answers with (`PAYMENT-RESPONSE`, v1
//! `X-PAYMENT-RESPONSE`). No decision is made here; `x402::check` makes them.

use base64::Engine;
use http::HeaderMap;
use serde_json::Value;

/// v2: the seller's challenge.
pub const PAYMENT_REQUIRED: &str = "payment-required";
/// v2: the client's payment.
pub const PAYMENT_SIGNATURE: &str = "payment-signature";
/// v2: the seller's settlement.
pub const PAYMENT_RESPONSE: &str = "payment-response";
/// v1: the client's payment.
pub const X_PAYMENT: &str = "x-payment";
/// v1: the seller's settlement.
pub const X_PAYMENT_RESPONSE: &str = "x-payment-response";

/// Every header that carries a payment credential: never part of a request's identity,
/// never logged.
pub use crate::request::PAYMENT_CREDENTIAL_HEADERS as CREDENTIAL_HEADERS;

/// Longest payment header read (a signed EIP-3009 payment is under 2 KiB).
const MAX_HEADER: usize = 16 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("the {0} header is sent more than once")]
    Repeated(&'static str),
    #[error("the {0} header is longer than {MAX_HEADER} bytes")]
    TooLong(&'static str),
    #[error("the {0} header is not base64")]
    NotBase64(&'static str),
    #[error("the {0} header is not a JSON object: {1}")]
    NotJson(&'static str, String),
    #[error("the {what} has no `{field}`")]
    Missing {
        what: &'static str,
        field: &'static str,
    },
    #[error("`{field}` in the {what} is not a whole number of atomic units: `{value}`")]
    NotAnAmount {
        what: &'static str,
        field: &'static str,
        value: String,
    },
}

/// One way a seller accepts payment (an entry of a challenge's `accepts`; the `accepted`
/// a v2 payment echoes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requirement {
    pub scheme: String,
    pub network: String,
    /// In the asset's atomic units (v1's `maxAmountRequired`).
    pub amount: u128,
    pub asset: String,
    pub pay_to: String,
}

/// A seller's `402` that asks for an x402 payment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    pub version: u64,
    pub accepts: Vec<Requirement>,
}

/// The signed part of an `exact` EVM payment (EIP-3009 `transferWithAuthorization`): what
/// the payer's key signed, and so the only fields a price may be read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authorization {
    pub from: String,
    pub to: String,
    pub value: u128,
    pub valid_after: u64,
    pub valid_before: u64,
    pub nonce: String,
}

/// A payment a client presents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payment {
    pub version: u64,
    /// The header it came in.
    pub header: &'static str,
    /// v2: the requirement the client says it pays (unsigned).
    pub accepted: Option<Requirement>,
    /// v2 names them in `accepted`, v1 at the top.
    pub scheme: String,
    pub network: String,
    /// `None`: a payload this proxy cannot read the signed amount of (Permit2, SVM, a
    /// scheme of its own).
    pub authorization: Option<Authorization>,
}

/// What a seller says of the settlement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settlement {
    pub success: bool,
    pub error_reason: Option<String>,
    /// What was settled, when the seller says (an `upto` payment settles up to its ceiling).
    pub amount: Option<u128>,
}

/// The payment credential a request carries, if any: its header and value.
pub fn credential(headers: &HeaderMap) -> Result<Option<(&'static str, &str)>, WireError> {
    for name in CREDENTIAL_HEADERS {
        let mut values = headers.get_all(name).iter();
        let Some(value) = values.next() else {
            continue;
        };
        if values.next().is_some() {
            return Err(WireError::Repeated(name));
        }
        let text = value.to_str().map_err(|_| WireError::NotBase64(name))?;
        return Ok(Some((name, text)));
    }
    Ok(None)
}

/// Whether a request carries an x402 payment credential, readable or not.
pub fn carries_credential(headers: &HeaderMap) -> bool {
    CREDENTIAL_HEADERS.iter().any(|h| headers.contains_key(*h))
}

/// Reads a payment header's value.
pub fn payment(header: &'static str, value: &str) -> Result<Payment, WireError> {
    let json = decode(header, value)?;
    let version = json.get("x402Version").and_then(Value::as_u64).unwrap_or(1);
    let what = "payment";
    let accepted = match json.get("accepted") {
        Some(a) => Some(requirement(a, what)?),
        None => None,
    };
    let (scheme, network) = match &accepted {
        Some(a) => (a.scheme.clone(), a.network.clone()),
        None => (
            text(&json, "scheme", what)?.to_string(),
            text(&json, "network", what)?.to_string(),
        ),
    };
    let authorization = match json.pointer("/payload/authorization") {
        Some(a) if a.is_object() && json.pointer("/payload/permit2Authorization").is_none() => {
            Some(authorization(a)?)
        }
        _ => None,
    };
    Ok(Payment {
        version,
        header,
        accepted,
        scheme,
        network,
        authorization,
    })
}

/// The challenge in a seller's answer, if it is one: a `402` with `PAYMENT-REQUIRED` (v2), or
/// whose JSON body names an `x402Version` and what it `accepts` (v1). Any other `402` (a
/// card decline) is not.
pub fn challenge(status: u16, headers: &HeaderMap, body: &[u8]) -> Option<Challenge> {
    if status != 402 {
        return None;
    }
    if let Some(v) = headers.get(PAYMENT_REQUIRED) {
        let json = decode(PAYMENT_REQUIRED, v.to_str().ok()?).ok()?;
        return challenge_of(&json);
    }
    let json: Value = serde_json::from_slice(body).ok()?;
    json.get("x402Version")?;
    challenge_of(&json)
}

/// Whether a `402` is an x402 challenge, even one this proxy cannot read whole.
pub fn is_challenge(status: u16, headers: &HeaderMap, body: &[u8]) -> bool {
    status == 402
        && (headers.contains_key(PAYMENT_REQUIRED) || challenge(status, headers, body).is_some())
}

/// The seller's settlement header on an answer, if any (unreadable: `Err`).
pub fn settlement(headers: &HeaderMap) -> Option<Result<Settlement, WireError>> {
    let (name, value) = [PAYMENT_RESPONSE, X_PAYMENT_RESPONSE]
        .into_iter()
        .find_map(|n| headers.get(n).map(|v| (n, v)))?;
    let read = || {
        let json = decode(
            name,
            value.to_str().map_err(|_| WireError::NotBase64(name))?,
        )?;
        let amount = match json.get("amount") {
            Some(v) => Some(atomic(v, "settlement", "amount")?),
            None => None,
        };
        Ok(Settlement {
            success: json.get("success").and_then(Value::as_bool) == Some(true),
            error_reason: json
                .get("errorReason")
                .and_then(Value::as_str)
                .map(str::to_string),
            amount,
        })
    };
    Some(read())
}

fn challenge_of(json: &Value) -> Option<Challenge> {
    let version = json.get("x402Version")?.as_u64()?;
    let accepts = json
        .get("accepts")?
        .as_array()?
        .iter()
        .filter_map(|a| requirement(a, "challenge").ok())
        .collect::<Vec<_>>();
    (!accepts.is_empty()).then_some(Challenge { version, accepts })
}

fn requirement(json: &Value, what: &'static str) -> Result<Requirement, WireError> {
    let amount = match (json.get("amount"), json.get("maxAmountRequired")) {
        (Some(v), _) => atomic(v, what, "amount")?,
        (None, Some(v)) => atomic(v, what, "maxAmountRequired")?,
        (None, None) => {
            return Err(WireError::Missing {
                what,
                field: "amount",
            })
        }
    };
    Ok(Requirement {
        scheme: text(json, "scheme", what)?.to_string(),
        network: text(json, "network", what)?.to_string(),
        amount,
        asset: text(json, "asset", what)?.to_string(),
        pay_to: text(json, "payTo", what)?.to_string(),
    })
}

fn authorization(json: &Value) -> Result<Authorization, WireError> {
    let what = "signed authorization";
    let seconds = |field: &'static str| -> Result<u64, WireError> {
        let v = atomic(field_of(json, field, what)?, what, field)?;
        u64::try_from(v).map_err(|_| WireError::NotAnAmount {
            what,
            field,
            value: v.to_string(),
        })
    };
    Ok(Authorization {
        from: text(json, "from", what)?.to_string(),
        to: text(json, "to", what)?.to_string(),
        value: atomic(field_of(json, "value", what)?, what, "value")?,
        valid_after: seconds("validAfter")?,
        valid_before: seconds("validBefore")?,
        nonce: text(json, "nonce", what)?.to_string(),
    })
}

fn field_of<'j>(
    json: &'j Value,
    field: &'static str,
    what: &'static str,
) -> Result<&'j Value, WireError> {
    json.get(field).ok_or(WireError::Missing { what, field })
}

fn text<'j>(
    json: &'j Value,
    field: &'static str,
    what: &'static str,
) -> Result<&'j str, WireError> {
    field_of(json, field, what)?
        .as_str()
        .ok_or(WireError::Missing { what, field })
}

/// A whole number of atomic units, written as a decimal string (or a JSON integer): never a
/// float, never signed, never hex.
fn atomic(v: &Value, what: &'static str, field: &'static str) -> Result<u128, WireError> {
    let bad = || WireError::NotAnAmount {
        what,
        field,
        value: v.to_string(),
    };
    match v {
        Value::String(s)
            if !s.is_empty() && s.len() <= 39 && s.bytes().all(|b| b.is_ascii_digit()) =>
        {
            s.parse().map_err(|_| bad())
        }
        Value::Number(n) => n.as_u64().map(u128::from).ok_or_else(bad),
        _ => Err(bad()),
    }
}

fn decode(header: &'static str, value: &str) -> Result<Value, WireError> {
    if value.len() > MAX_HEADER {
        return Err(WireError::TooLong(header));
    }
    let value = value.trim();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(value)
        .or_else(|_| base64::engine::general_purpose::URL_SAFE.decode(value))
        .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(value))
        .or_else(|_| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(value))
        .map_err(|_| WireError::NotBase64(header))?;
    let json: Value =
        serde_json::from_slice(&bytes).map_err(|e| WireError::NotJson(header, e.to_string()))?;
    if !json.is_object() {
        return Err(WireError::NotJson(header, "not an object".into()));
    }
    Ok(json)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn b64(v: &Value) -> String {
        base64::engine::general_purpose::STANDARD.encode(v.to_string())
    }

    pub(crate) fn v2_payment(value: &str, to: &str) -> Value {
        serde_json::json!({
            "x402Version": 2,
            "resource": {"url": "http://seller/weather"},
            "accepted": {"scheme": "exact", "network": "eip155:84532", "amount": value,
                "asset": "0x036CbD53842c5426634e7929541eC2318f3dCF7e", "payTo": to,
                "maxTimeoutSeconds": 60, "extra": {"name": "USDC", "version": "2"}},
            "payload": {"signature": "0xabc", "authorization": {"from": "0x857b", "to": to,
                "value": value, "validAfter": "1740672089", "validBefore": "1740672154",
                "nonce": "0xf374"}}
        })
    }

    #[test]
    fn a_v2_payment_is_read_with_its_signed_authorization() {
        let p =
            payment(PAYMENT_SIGNATURE, &b64(&v2_payment("10000", "0x2096"))).expect("test input");
        let a = p.authorization.expect("test input");
        assert_eq!(
            (a.value, a.to.as_str(), a.valid_before),
            (10000, "0x2096", 1740672154)
        );
        assert_eq!(p.accepted.expect("test input").amount, 10000);
        assert_eq!(p.network, "eip155:84532");
    }

    #[test]
    fn amounts_are_integers_never_floats_or_negatives() {
        for bad in ["1.5", "-1", "1e6", "0x10", ""] {
            let p = payment(PAYMENT_SIGNATURE, &b64(&v2_payment(bad, "0x2096")));
            assert!(matches!(p, Err(WireError::NotAnAmount { .. })), "{bad}");
        }
    }

    #[test]
    fn a_card_decline_402_is_not_a_challenge() {
        let decline = br#"{"error":{"type":"card_error","code":"card_declined"}}"#;
        assert!(!is_challenge(402, &HeaderMap::new(), decline));
        let v1 = serde_json::json!({"x402Version": 1, "error": "X-PAYMENT header is required",
            "accepts": [{"scheme": "exact", "network": "base-sepolia", "maxAmountRequired": "1000",
            "asset": "0xa", "payTo": "0xb", "resource": "http://s/x"}]});
        let c = challenge(402, &HeaderMap::new(), v1.to_string().as_bytes()).expect("test input");
        assert_eq!(c.accepts[0].amount, 1000);
        let mut h = HeaderMap::new();
        let v2 = serde_json::json!({"x402Version": 2, "accepts": [{"scheme": "exact",
            "network": "eip155:84532", "amount": "10000", "asset": "0xa", "payTo": "0xb"}]});
        h.insert(
            PAYMENT_REQUIRED,
            HeaderValue::from_str(&b64(&v2)).expect("test input"),
        );
        assert!(is_challenge(402, &h, b"{}"));
        assert!(!is_challenge(200, &h, b"{}"));
    }

    #[test]
    fn a_repeated_payment_header_is_refused() {
        let mut h = HeaderMap::new();
        h.append(PAYMENT_SIGNATURE, HeaderValue::from_static("a"));
        h.append(PAYMENT_SIGNATURE, HeaderValue::from_static("b"));
        assert_eq!(credential(&h), Err(WireError::Repeated(PAYMENT_SIGNATURE)));
    }
}
