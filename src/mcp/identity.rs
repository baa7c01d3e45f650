//! What one tool call is: the account it acts for and the operation it names. The operation
//! is the tool and its arguments (canonical: key order and spacing never matter) within the
//! route's window, or a per-tool template (`refund:{args.charge}`), or the client's own
//! `params.idempotencyKey` scoped by tool. Never the JSON-RPC id (ids restart in every
//! process), the session id (a re-run is a new session), a progress token, `inputResponses` or
//! `requestState`: none of them say which operation it is.
//!
//! The account is a stable subject: the route's `account` template; else a bearer JWT's
//! issuer, subject and client (read without verifying: a name, never a secret), so a token
//! refreshed between a call and its re-run is the same account; else the bearer token itself
//! (a static API key); else every credential-looking header but the session's.

use http::HeaderName;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::jsonrpc::Message;
use super::McpRules;
use crate::identity::account::{AccountError, AccountPart, AccountSpec};
use crate::identity::derivation::Derivation;
use crate::request::auth::{bearer, bearer_claims};
use crate::request::key::MAX_KEY_LEN;
use crate::request::template::{Rendered, Template};
use crate::request::Request;

/// How a call was identified (for logs and metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `params.idempotencyKey`.
    Client,
    /// The tool's template.
    Template,
    /// The tool and its arguments, within the window.
    Arguments,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Client => "client",
            Source::Template => "template",
            Source::Arguments => "arguments",
        }
    }
}

/// A tool call, identified.
#[derive(Debug, Clone)]
pub struct CallIdentity {
    pub tool: String,
    /// Hex hash of the account.
    pub account: String,
    /// The operation's part of the scope.
    pub key: String,
    /// The tool and its canonical arguments, hashed: a client key reused with other
    /// arguments is refused.
    pub fingerprint: String,
    /// Whether another fingerprint under the same key is refused (the 422 analogue).
    pub strict: bool,
    pub source: Source,
    /// The caller's 2026-07-28 envelope (`params._meta`'s protocol version, capabilities and
    /// client info): what a request the proxy makes alongside the call must carry too.
    /// Never part of the identity.
    pub envelope: Option<serde_json::Map<String, Value>>,
}

/// The `_meta` keys a 2026-07-28 request carries for the revision and the client.
pub const PROTOCOL_VERSION_META: &str = "io.modelcontextprotocol/protocolVersion";
const ENVELOPE_KEYS: [&str; 3] = [
    PROTOCOL_VERSION_META,
    "io.modelcontextprotocol/clientCapabilities",
    "io.modelcontextprotocol/clientInfo",
];

/// The caller's envelope, when its `_meta` names a protocol version.
fn envelope(params: &Value) -> Option<serde_json::Map<String, Value>> {
    let meta = params.get("_meta")?.as_object()?;
    meta.get(PROTOCOL_VERSION_META)?.as_str()?;
    Some(
        ENVELOPE_KEYS
            .iter()
            .filter_map(|k| meta.get(*k).map(|v| (k.to_string(), v.clone())))
            .collect(),
    )
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    #[error("a tools/call needs `params.name`, a string")]
    NoToolName,
    #[error("`params.arguments` must be an object")]
    Arguments,
    #[error(
        "`params.idempotencyKey` must be a string of 1 to {MAX_KEY_LEN} visible ASCII characters"
    )]
    BadKey,
    #[error("the tool {tool}'s key template needs {field}, which this call does not carry")]
    MissingField { tool: String, field: String },
    #[error("the tool {tool}'s key template cannot be read from this call: {why}")]
    Unreadable { tool: String, why: String },
    #[error("the account cannot be read: {0}")]
    Account(#[from] AccountError),
}

/// Headers that are never an account: they change between a call and its re-run.
static NOT_ACCOUNTS: [HeaderName; 2] = [
    HeaderName::from_static("mcp-session-id"),
    HeaderName::from_static("last-event-id"),
];

/// Identifies a `tools/call` message, read from `req` (the same body).
pub fn identify(
    rules: &McpRules,
    account_template: Option<&Template>,
    call: &Message,
    req: &Request<'_>,
) -> Result<CallIdentity, CallError> {
    let tool = call
        .params
        .get("name")
        .and_then(Value::as_str)
        .ok_or(CallError::NoToolName)?
        .to_string();
    let arguments = match call.params.get("arguments") {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => return Err(CallError::Arguments),
    };
    let mut canonical = String::new();
    write_canonical(&arguments, &mut canonical);
    let fingerprint = hash(&[tool.as_bytes(), canonical.as_bytes()]);
    let account = account(account_template, req)?;
    let envelope = envelope(&call.params);
    let tagged = |kind: &str, rest: &str| format!("mcp {kind} {}:{tool} {rest}", tool.len());
    if let Some(key) = call.params.get("idempotencyKey") {
        let key = key
            .as_str()
            .filter(|k| valid_key(k))
            .ok_or(CallError::BadKey)?;
        return Ok(CallIdentity {
            key: tagged("key", key),
            tool,
            account,
            fingerprint,
            strict: true,
            source: Source::Client,
            envelope,
        });
    }
    if let Some(template) = rules.templates.get(&tool) {
        let key = match template.render(req) {
            Ok(Rendered::Key(k)) => k,
            Ok(Rendered::Missing(field)) => {
                return Err(CallError::MissingField {
                    tool,
                    field: field.replace("body.params.arguments.", "args."),
                })
            }
            Err(e) => {
                return Err(CallError::Unreadable {
                    tool,
                    why: e.to_string(),
                })
            }
        };
        return Ok(CallIdentity {
            key: tagged("op", &key),
            tool,
            account,
            fingerprint,
            strict: false,
            source: Source::Template,
            envelope,
        });
    }
    Ok(CallIdentity {
        key: tagged("call", &fingerprint),
        tool,
        account,
        fingerprint,
        strict: true,
        source: Source::Arguments,
        envelope,
    })
}

fn valid_key(k: &str) -> bool {
    !k.is_empty() && k.len() <= MAX_KEY_LEN && k.bytes().all(|b| (0x21..=0x7e).contains(&b))
}

/// The account's hash, as the module's comment orders the ways of reading it.
pub fn account(template: Option<&Template>, req: &Request<'_>) -> Result<String, CallError> {
    if let Some(t) = template {
        let spec = AccountSpec::Template(t.clone());
        return Ok(spec.fingerprint(req, &[], Derivation::CURRENT)?);
    }
    if let Some(claims) = bearer_claims(req.headers) {
        let text = |k: &str| claims.get(k).and_then(Value::as_str).unwrap_or("");
        let client = [text("client_id"), text("azp")].concat();
        if !text("sub").is_empty() || !client.is_empty() {
            let (iss, sub) = (text("iss"), text("sub"));
            return Ok(hash(&[
                b"jwt",
                iss.as_bytes(),
                sub.as_bytes(),
                client.as_bytes(),
            ]));
        }
    }
    if let Some(token) = bearer(req.headers) {
        return Ok(hash(&[b"bearer", token.as_bytes()]));
    }
    let ignore: Vec<&HeaderName> = NOT_ACCOUNTS.iter().collect();
    let spec = AccountSpec::Parts(vec![AccountPart::CredentialLike]);
    Ok(spec.fingerprint(req, &ignore, Derivation::CURRENT)?)
}

/// Length-prefixed parts, hashed: moving bytes between parts changes the hash.
fn hash(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_be_bytes());
        h.update(p);
    }
    crate::hex::lower(&h.finalize())
}

/// JSON with object keys sorted and no spaces: one text for one value however it was sent.
fn write_canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(&map[k], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mcp::McpRules;
    use http::{HeaderMap, Method};
    use std::time::Duration;

    fn identify_body(rules: &McpRules, headers: &[(&str, &str)], body: &str) -> CallIdentity {
        let mut h = HeaderMap::new();
        h.insert("content-type", "application/json".parse().expect("value"));
        for (k, v) in headers {
            h.insert(
                HeaderName::from_bytes(k.as_bytes()).expect("name"),
                v.parse().expect("value"),
            );
        }
        let call = Message::read(&h, body.as_bytes()).expect("a message");
        let req = Request::new(
            &Method::POST,
            "/mcp",
            "/mcp",
            &h,
            body.as_bytes(),
            "default",
        );
        identify(rules, None, &call, &req).expect("identified")
    }

    fn rules() -> McpRules {
        McpRules::new(
            Duration::from_secs(60),
            vec![],
            false,
            vec![("refund".into(), "refund:{args.charge}".into())],
        )
        .expect("rules")
    }

    fn jwt(claims: &str) -> String {
        use base64::Engine as _;
        let enc = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        format!("Bearer {}.{}.sig", enc(r#"{"alg":"none"}"#), enc(claims))
    }

    #[test]
    fn the_call_is_the_tool_and_its_arguments_never_ids_or_sessions() {
        let r = rules();
        let a = identify_body(
            &r,
            &[("mcp-session-id", "s1")],
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"create_customer","arguments":{"email":"a@x","name":"A"},"_meta":{"progressToken":1}}}"#,
        );
        let b = identify_body(
            &r,
            &[("mcp-session-id", "s2")],
            r#"{"jsonrpc":"2.0","id":"x-9","method":"tools/call","params":{"arguments":{"name":"A", "email":"a@x"},"name":"create_customer","_meta":{"progressToken":"p"}}}"#,
        );
        assert_eq!((&a.key, &a.account), (&b.key, &b.account));
        assert_eq!(a.source, Source::Arguments);
        let c = identify_body(
            &r,
            &[],
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"create_customer","arguments":{"email":"b@x","name":"A"}}}"#,
        );
        assert_ne!(a.key, c.key);
    }

    #[test]
    fn templates_and_client_keys_name_the_operation() {
        let r = rules();
        let one = identify_body(
            &r,
            &[],
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"refund","arguments":{"charge":"ch_1","reason":"dup"}}}"#,
        );
        let reworded = identify_body(
            &r,
            &[],
            r#"{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"refund","arguments":{"charge":"ch_1","reason":"duplicate"}}}"#,
        );
        assert_eq!(one.key, reworded.key);
        assert_eq!(one.source, Source::Template);
        let keyed = |args: &str| {
            identify_body(
                &r,
                &[],
                &format!(
                    r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"send","idempotencyKey":"k1","arguments":{args}}}}}"#
                ),
            )
        };
        let (k1, k2) = (keyed(r#"{"to":"a"}"#), keyed(r#"{"to":"b"}"#));
        assert_eq!(k1.key, k2.key);
        assert_ne!(k1.fingerprint, k2.fingerprint);
        assert!(k1.strict);
    }

    #[test]
    fn a_refreshed_token_is_the_same_account_another_subject_is_not() {
        let r = rules();
        let body = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"t","arguments":{}}}"#;
        let today = jwt(r#"{"iss":"https://auth","sub":"u1","iat":1,"exp":3601}"#);
        let tomorrow = jwt(r#"{"iss":"https://auth","sub":"u1","iat":90000,"exp":93600}"#);
        let other = jwt(r#"{"iss":"https://auth","sub":"u2","iat":1,"exp":3601}"#);
        let acct = |auth: &str| identify_body(&r, &[("authorization", auth)], body).account;
        assert_eq!(acct(&today), acct(&tomorrow));
        assert_ne!(acct(&today), acct(&other));
        assert_ne!(acct("Bearer sk_a"), acct("Bearer sk_b"));
    }
}
