//! Console sessions: a token logs in once, then a signed cookie carries who it is. The
//! cookie is an HMAC-SHA256-signed statement (name, role, which token, until when, a random
//! session id), so any replica holding the same session key can check it; the CSRF token of
//! every form is derived from the session the same way. The signature says the cookie was
//! made here; whether the session is still open (not logged out, not ended by an operator)
//! is the store's to say (`live_sessions`).

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use ring::hmac;
use serde::{Deserialize, Serialize};

use super::access::{Access, Principal, Role};
use crate::config::{Config, ConfigError};
use crate::spend::port::OperatorSession;

pub const COOKIE: &str = "idemproxy_session";

/// Signs and checks sessions.
pub struct Sessions {
    key: hmac::Key,
    ttl_ms: u64,
    /// Cookies carry `Secure`.
    secure: bool,
    /// The key was made up at start-up (no `session_key_env`/`session_key_file`).
    pub ephemeral: bool,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions")
            .field("ttl_ms", &self.ttl_ms)
            .field("secure", &self.secure)
            .field("ephemeral", &self.ephemeral)
            .finish_non_exhaustive()
    }
}

/// What a cookie says, once its signature checked out.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Claims {
    /// Token name, role, token tag.
    n: String,
    r: String,
    t: String,
    /// Expires (ms since the epoch).
    e: u64,
    /// A random id: the CSRF token is derived from it.
    s: String,
}

/// A session whose cookie checked out.
#[derive(Debug, Clone)]
pub struct Session {
    pub who: Principal,
    pub csrf: String,
    /// The session's random id: what the store keeps it under.
    pub id: String,
}

impl Sessions {
    pub fn from_config(config: &Config) -> Result<Sessions, ConfigError> {
        let admin = &config.admin;
        let raw = match (&admin.session_key_env, &admin.session_key_file) {
            (Some(_), Some(_)) => {
                return Err(config.invalid(
                    "admin.session_key_env",
                    "give session_key_env or session_key_file, not both",
                ))
            }
            (Some(var), None) => match config.env.var(var) {
                Some(v) if !v.trim().is_empty() => Some((v, "admin.session_key_env")),
                _ => {
                    return Err(config.invalid(
                        "admin.session_key_env",
                        format!("the environment variable {var} is unset or empty"),
                    ))
                }
            },
            (None, Some(path)) => Some((
                std::fs::read_to_string(path).map_err(|e| {
                    config.invalid(
                        "admin.session_key_file",
                        format!("cannot read {}: {e}", path.display()),
                    )
                })?,
                "admin.session_key_file",
            )),
            (None, None) => None,
        };
        let (bytes, ephemeral) = match raw {
            Some((text, field)) => (
                decode_key(&text).map_err(|m| config.invalid(field, m))?,
                false,
            ),
            None => (rand::random::<[u8; 32]>().to_vec(), true),
        };
        if admin.session_ttl.0.is_zero() {
            return Err(config.invalid("admin.session_ttl", "must be greater than 0"));
        }
        Ok(Sessions {
            key: hmac::Key::new(hmac::HMAC_SHA256, &bytes),
            ttl_ms: admin.session_ttl.0.as_millis() as u64,
            secure: admin.tls_cert.is_some() || admin.behind_tls,
            ephemeral,
        })
    }

    pub fn ttl_ms(&self) -> u64 {
        self.ttl_ms
    }

    /// A session for `who`: the `Set-Cookie` value, and the record the store must keep for
    /// the cookie to be honoured.
    pub fn start(&self, who: &Principal, now_ms: u64) -> (String, OperatorSession) {
        let claims = Claims {
            n: who.name.clone(),
            r: who.role.as_str().into(),
            t: who.token_tag.clone(),
            e: now_ms.saturating_add(self.ttl_ms),
            s: URL_SAFE_NO_PAD.encode(rand::random::<[u8; 16]>()),
        };
        let record = OperatorSession {
            id: claims.s.clone(),
            name: claims.n.clone(),
            role: claims.r.clone(),
            token_tag: claims.t.clone(),
            started_ms: now_ms,
            expires_ms: claims.e,
        };
        // Serializing a struct of strings and numbers cannot fail.
        let payload = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims).unwrap_or_default());
        let tag = URL_SAFE_NO_PAD.encode(hmac::sign(&self.key, payload.as_bytes()).as_ref());
        (
            self.cookie(&format!("{payload}.{tag}"), self.ttl_ms / 1000),
            record,
        )
    }

    /// A `Set-Cookie` value ending the session in this browser.
    pub fn end(&self) -> String {
        self.cookie("", 0)
    }

    fn cookie(&self, value: &str, max_age_s: u64) -> String {
        format!(
            "{COOKIE}={value}; Path=/; Max-Age={max_age_s}; HttpOnly; SameSite=Strict{}",
            if self.secure { "; Secure" } else { "" }
        )
    }

    /// The session a `Cookie` header carries, if its signature, expiry and token still hold.
    pub fn check(&self, cookie_header: &str, access: &Access, now_ms: u64) -> Option<Session> {
        let value = cookie_header
            .split(';')
            .filter_map(|c| c.trim().split_once('='))
            .find(|(k, _)| *k == COOKIE)
            .map(|(_, v)| v)?;
        let (payload, tag) = value.split_once('.')?;
        let tag = URL_SAFE_NO_PAD.decode(tag).ok()?;
        hmac::verify(&self.key, payload.as_bytes(), &tag).ok()?;
        let claims: Claims = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(payload).ok()?).ok()?;
        if now_ms >= claims.e {
            return None;
        }
        let who = access.current(&claims.n, Role::parse(&claims.r)?, &claims.t)?;
        Some(Session {
            who,
            csrf: self.csrf(&claims.s),
            id: claims.s,
        })
    }

    fn csrf(&self, session_id: &str) -> String {
        let tag = hmac::sign(&self.key, format!("csrf\0{session_id}").as_bytes());
        URL_SAFE_NO_PAD.encode(tag.as_ref())
    }
}

/// A session key as configured: 64 hex digits, or base64 of at least 32 bytes.
fn decode_key(text: &str) -> Result<Vec<u8>, String> {
    let t = text.trim();
    let bytes = if t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit()) {
        hex::decode(t).map_err(|e| e.to_string())?
    } else {
        base64::engine::general_purpose::STANDARD
            .decode(t)
            .map_err(|_| "must be 64 hex digits or base64".to_string())?
    };
    if bytes.len() < 32 {
        return Err(format!(
            "must be at least 32 bytes (this is {}): `openssl rand -hex 32`",
            bytes.len()
        ));
    }
    Ok(bytes)
}

/// Constant-time comparison of a CSRF token a form sent with the session's.
pub fn csrf_matches(sent: &str, expected: &str) -> bool {
    use subtle::ConstantTimeEq;
    sent.len() == expected.len() && sent.as_bytes().ct_eq(expected.as_bytes()).unwrap_u8() == 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::Digest;
    use std::path::Path;

    fn setup(extra: &str) -> (Sessions, Access) {
        let hash = hex::encode(sha2::Sha256::digest(b"ana-secret"));
        let config = Config::parse(
            &format!(
                "[admin]\ntoken_env = \"IDEMPROXY_TEST_UNSET_TOKEN\"\n{extra}[[admin.tokens]]\nname = \"ana\"\nrole = \"approver\"\nsha256 = \"{hash}\"\n"
            ),
            Path::new("t.toml"),
        )
        .expect("config");
        (
            Sessions::from_config(&config).expect("sessions"),
            Access::from_config(&config).expect("access"),
        )
    }

    fn value(set_cookie: &str) -> String {
        set_cookie.split(';').next().unwrap_or_default().to_string()
    }

    #[test]
    fn a_session_holds_until_it_expires_and_only_with_its_signature() {
        let (s, a) = setup("session_ttl = \"1h\"\n");
        let ana = a.check("ana-secret").expect("ana");
        let (set, record) = s.start(&ana, 1_000);
        assert!(set.contains("HttpOnly") && set.contains("SameSite=Strict"));
        assert!(!set.contains("Secure"));
        let cookie = value(&set);
        let live = s.check(&cookie, &a, 2_000).expect("live");
        assert_eq!(live.who.name, "ana");
        assert_eq!(
            (live.id.as_str(), record.expires_ms),
            (record.id.as_str(), 3_601_000)
        );
        assert!(s.check(&cookie, &a, 1_000 + 3_600_000).is_none(), "expired");
        // Another role written into the payload breaks the signature.
        let (payload, tag) = cookie
            .trim_start_matches("idemproxy_session=")
            .split_once('.')
            .expect("two parts");
        let mut claims: Claims =
            serde_json::from_slice(&URL_SAFE_NO_PAD.decode(payload).expect("b64")).expect("json");
        claims.r = "operator".into();
        let forged = format!(
            "{COOKIE}={}.{tag}",
            URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims).expect("json"))
        );
        assert!(s.check(&forged, &a, 2_000).is_none());
        // Another process with its own made-up key does not take it.
        let (other, _) = setup("");
        assert!(other.check(&cookie, &a, 2_000).is_none());
    }

    #[test]
    fn the_csrf_token_belongs_to_the_session() {
        let (s, a) = setup("");
        let ana = a.check("ana-secret").expect("ana");
        let one = s.check(&value(&s.start(&ana, 0).0), &a, 1).expect("one");
        let two = s.check(&value(&s.start(&ana, 0).0), &a, 1).expect("two");
        assert_ne!(one.csrf, two.csrf);
        assert!(csrf_matches(&one.csrf, &one.csrf.clone()));
        assert!(!csrf_matches(&one.csrf, &two.csrf));
        assert!(!csrf_matches("", &one.csrf));
    }

    #[test]
    fn configured_keys_are_checked() {
        std::env::set_var("IDEMPROXY_TEST_SHORT_KEY", "abcd");
        let config = Config::parse(
            "[admin]\nsession_key_env = \"IDEMPROXY_TEST_SHORT_KEY\"\n",
            Path::new("t.toml"),
        )
        .expect("config");
        let e = Sessions::from_config(&config).expect_err("short");
        assert!(e.to_string().contains("admin.session_key_env"), "{e}");
    }
}
