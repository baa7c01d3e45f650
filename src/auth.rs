//! Who may use the proxy: `Proxy-Authorization` (Basic or Bearer) checked against the tenants
//! in config. One function, [`Tenants::authorize`], serves every way in (plain requests and
//! CONNECT), so they can never disagree.

use base64::Engine as _;
use http::{header, HeaderMap, HeaderValue, Response, StatusCode};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

pub use crate::config::TenantConfig;
use crate::config::{Config, ConfigError};
use crate::http::body::Body;
use crate::http::problem::Problem;

pub use crate::config::DEFAULT_TENANT;

const REALM: &str = "Basic realm=\"idemproxy\", Bearer realm=\"idemproxy\"";

struct Tenant {
    name: String,
    secret_hash: [u8; 32],
}

/// The tenants allowed in. Empty: authentication is off and everyone is [`DEFAULT_TENANT`].
pub struct Tenants {
    tenants: Vec<Tenant>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthError {
    #[error("proxy authentication required: send Proxy-Authorization (Basic tenant:secret or Bearer secret)")]
    Missing,
    #[error("the Proxy-Authorization credentials are not valid")]
    Invalid,
}

// Names only: the secret hashes stay out of any debug output.
impl std::fmt::Debug for Tenants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.tenants.iter().map(|t| &t.name))
            .finish()
    }
}

impl Tenants {
    /// The tenants' names; `[DEFAULT_TENANT]` when authentication is off.
    pub fn names(&self) -> Vec<String> {
        if self.tenants.is_empty() {
            return vec![DEFAULT_TENANT.to_string()];
        }
        self.tenants.iter().map(|t| t.name.clone()).collect()
    }

    pub fn build(config: &Config) -> Result<Tenants, ConfigError> {
        Self::build_with_env(config, |name| config.env.var(name))
    }

    pub fn build_with_env(
        config: &Config,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Tenants, ConfigError> {
        let mut tenants = Vec::new();
        for (i, t) in config.tenants.iter().enumerate() {
            let field = |f: &str| format!("tenants[{i}].{f}");
            if t.name.is_empty()
                || !t
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(
                    config.invalid(field("name"), "must be non-empty letters, digits, - or _")
                );
            }
            if tenants.iter().any(|x: &Tenant| x.name == t.name) {
                return Err(config.invalid(field("name"), format!("`{}` is used twice", t.name)));
            }
            let secret_hash = match (&t.secret_sha256, &t.secret_env) {
                (Some(hex_hash), None) => {
                    let bytes = hex::decode(hex_hash.trim()).ok().filter(|b| b.len() == 32);
                    let Some(bytes) = bytes else {
                        return Err(config
                            .invalid(field("secret_sha256"), "must be 64 hex digits (a SHA-256)"));
                    };
                    let mut out = [0u8; 32];
                    out.copy_from_slice(&bytes);
                    out
                }
                (None, Some(var)) => match env(var) {
                    Some(secret) if !secret.is_empty() => sha256(secret.as_bytes()),
                    _ => {
                        return Err(config.invalid(
                            field("secret_env"),
                            format!("the environment variable `{var}` is not set or empty"),
                        ))
                    }
                },
                _ => {
                    return Err(config.invalid(
                        field("secret_sha256"),
                        "set exactly one of secret_sha256 and secret_env",
                    ))
                }
            };
            tenants.push(Tenant {
                name: t.name.clone(),
                secret_hash,
            });
        }
        Ok(Tenants { tenants })
    }

    pub fn enabled(&self) -> bool {
        !self.tenants.is_empty()
    }

    /// The tenant a request (or CONNECT) belongs to, from its `Proxy-Authorization`.
    pub fn authorize(&self, headers: &HeaderMap) -> Result<String, AuthError> {
        if self.tenants.is_empty() {
            return Ok(DEFAULT_TENANT.to_string());
        }
        let value = headers
            .get(header::PROXY_AUTHORIZATION)
            .ok_or(AuthError::Missing)?
            .to_str()
            .map_err(|_| AuthError::Invalid)?
            .trim();
        let (scheme, rest) = value.split_once(' ').ok_or(AuthError::Invalid)?;
        let rest = rest.trim();
        if scheme.eq_ignore_ascii_case("basic") {
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(rest)
                .map_err(|_| AuthError::Invalid)?;
            let decoded = String::from_utf8(decoded).map_err(|_| AuthError::Invalid)?;
            let (user, secret) = decoded.split_once(':').ok_or(AuthError::Invalid)?;
            // `tenant.run`: the part after the first dot names the agent run (spend budgets).
            let user = user.split_once('.').map_or(user, |(tenant, _)| tenant);
            let given = sha256(secret.as_bytes());
            // Compare against every tenant so the time taken does not tell which names exist.
            let mut found = None;
            for t in &self.tenants {
                let ok = t.secret_hash.ct_eq(&given).unwrap_u8() == 1;
                if ok && t.name == user {
                    found = Some(t.name.clone());
                }
            }
            found.ok_or(AuthError::Invalid)
        } else if scheme.eq_ignore_ascii_case("bearer") {
            let given = sha256(rest.as_bytes());
            let mut found = None;
            for t in &self.tenants {
                if t.secret_hash.ct_eq(&given).unwrap_u8() == 1 && found.is_none() {
                    found = Some(t.name.clone());
                }
            }
            found.ok_or(AuthError::Invalid)
        } else {
            Err(AuthError::Invalid)
        }
    }
}

/// The agent run a `Proxy-Authorization: Basic` user names after its tenant
/// (`acme.run-42` → `run-42`), so a worker whose proxy URL carries one credential per run
/// needs no code change for per-run budgets. Read with or without tenants configured.
pub fn run_of_proxy_user(headers: &HeaderMap) -> Option<String> {
    let value = headers
        .get(header::PROXY_AUTHORIZATION)?
        .to_str()
        .ok()?
        .trim();
    let (scheme, rest) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(rest.trim())
        .ok()?;
    let decoded = String::from_utf8(decoded).ok()?;
    let (user, _) = decoded.split_once(':')?;
    let (_, run) = user.split_once('.')?;
    Some(run.to_string())
}

/// 407 with `Proxy-Authenticate`, as problem+json.
pub fn challenge(error: &AuthError) -> Response<Body> {
    let slug = match error {
        AuthError::Missing => "proxy-auth-required",
        AuthError::Invalid => "proxy-auth-invalid",
    };
    let mut resp = Problem::new(
        StatusCode::PROXY_AUTHENTICATION_REQUIRED,
        slug,
        format!("{error}. Nothing was forwarded or claimed."),
    )
    .titled("Proxy authentication required")
    .into_response();
    resp.headers_mut()
        .insert(header::PROXY_AUTHENTICATE, HeaderValue::from_static(REALM));
    resp
}

pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn tenants(toml: &str) -> Tenants {
        let config = Config::parse(toml, Path::new("t.toml")).expect("config");
        Tenants::build_with_env(&config, |v| {
            (v == "B_SECRET").then(|| "s3cret-b".to_string())
        })
        .expect("tenants")
    }

    fn with(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::PROXY_AUTHORIZATION,
            HeaderValue::from_str(value).expect("value"),
        );
        h
    }

    fn basic(user: &str, pass: &str) -> String {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"))
        )
    }

    #[test]
    fn basic_and_bearer_pick_the_tenant() {
        let a_hash = hex::encode(sha256(b"s3cret-a"));
        let t = tenants(&format!(
            "[[tenants]]\nname = \"a\"\nsecret_sha256 = \"{a_hash}\"\n[[tenants]]\nname = \"b\"\nsecret_env = \"B_SECRET\"\n"
        ));
        assert_eq!(t.authorize(&with(&basic("a", "s3cret-a"))), Ok("a".into()));
        assert_eq!(t.authorize(&with(&basic("b", "s3cret-b"))), Ok("b".into()));
        assert_eq!(t.authorize(&with("Bearer s3cret-b")), Ok("b".into()));
        // a's secret under b's name, wrong secrets, junk: refused.
        assert_eq!(
            t.authorize(&with(&basic("b", "s3cret-a"))),
            Err(AuthError::Invalid)
        );
        assert_eq!(t.authorize(&with("Bearer nope")), Err(AuthError::Invalid));
        assert_eq!(t.authorize(&with("Basic !!!")), Err(AuthError::Invalid));
        assert_eq!(t.authorize(&with("Digest x")), Err(AuthError::Invalid));
        assert_eq!(t.authorize(&HeaderMap::new()), Err(AuthError::Missing));
    }

    #[test]
    fn a_run_rides_after_the_tenant_in_the_proxy_user() {
        let a_hash = hex::encode(sha256(b"s3cret-a"));
        let t = tenants(&format!(
            "[[tenants]]\nname = \"a\"\nsecret_sha256 = \"{a_hash}\"\n"
        ));
        let h = with(&basic("a.run-42", "s3cret-a"));
        assert_eq!(t.authorize(&h), Ok("a".into()));
        assert_eq!(run_of_proxy_user(&h), Some("run-42".into()));
        assert_eq!(run_of_proxy_user(&with(&basic("a", "s3cret-a"))), None);
        assert_eq!(run_of_proxy_user(&with("Bearer s3cret-a")), None);
        assert_eq!(
            t.authorize(&with(&basic("b.run-1", "s3cret-a"))),
            Err(AuthError::Invalid)
        );
    }

    #[test]
    fn no_tenants_means_everyone_is_default() {
        let t = tenants("");
        assert!(!t.enabled());
        assert_eq!(t.authorize(&HeaderMap::new()), Ok(DEFAULT_TENANT.into()));
    }

    #[test]
    fn config_errors_name_the_field() {
        let config = Config::parse(
            "[[tenants]]\nname = \"a\"\nsecret_env = \"UNSET_VAR_X\"\n",
            Path::new("t.toml"),
        )
        .expect("parses");
        let e = Tenants::build_with_env(&config, |_| None)
            .expect_err("error")
            .to_string();
        assert!(
            e.contains("t.toml") && e.contains("tenants[0].secret_env"),
            "{e}"
        );
        let config = Config::parse(
            "[[tenants]]\nname = \"a\"\nsecret_sha256 = \"zz\"\n",
            Path::new("t.toml"),
        )
        .expect("parses");
        let e = Tenants::build(&config).expect_err("error").to_string();
        assert!(e.contains("tenants[0].secret_sha256"), "{e}");
    }
}
