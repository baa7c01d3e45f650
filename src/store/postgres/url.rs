//! `postgres://` and `postgresql://` URLs: the driver's settings plus the TLS ones libpq
//! users expect in the URL (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`), which idemproxy
//! handles itself.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use tokio_postgres::Config as PgConfig;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::request::form;
use crate::store::tls::{self, TlsFiles, Verify};

/// `sslmode` as libpq spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// A `postgres://` URL, parsed: the driver's settings plus the TLS ones libpq users expect
/// in the URL (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`), which idemproxy handles itself.
#[derive(Clone)]
pub struct PostgresUrl {
    pub(super) config: PgConfig,
    sslmode: SslMode,
    rootcert: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
}

impl std::fmt::Debug for PostgresUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The driver's config redacts the password.
        f.debug_struct("PostgresUrl")
            .field("config", &self.config)
            .field("sslmode", &self.sslmode)
            .finish_non_exhaustive()
    }
}

const EXPECTED: &str = "postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE[?sslmode=…]";

impl PostgresUrl {
    /// `postgres://` or `postgresql://`; the error says what was expected.
    pub fn parse(url: &str) -> Result<PostgresUrl, String> {
        let (base, query) = match url.split_once('?') {
            Some((b, q)) => (b, q),
            None => (url, ""),
        };
        let mut kept = Vec::new();
        let (mut sslmode, mut rootcert, mut cert, mut key) = (SslMode::Prefer, None, None, None);
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let value = || {
                form::decode_url_component(v.as_bytes())
                    .map_err(|e| format!("`{}`: {k}: `{v}` {e}", redact(url)))
            };
            match k {
                "sslmode" => {
                    sslmode = match value()?.as_str() {
                        "disable" => SslMode::Disable,
                        "allow" | "prefer" => SslMode::Prefer,
                        "require" => SslMode::Require,
                        "verify-ca" => SslMode::VerifyCa,
                        "verify-full" => SslMode::VerifyFull,
                        other => {
                            return Err(format!(
                            "`{url}`: sslmode `{other}` is not one of disable, prefer, require, \
                                 verify-ca, verify-full"
                        ))
                        }
                    }
                }
                "sslrootcert" => rootcert = Some(PathBuf::from(value()?)),
                "sslcert" => cert = Some(PathBuf::from(value()?)),
                "sslkey" => key = Some(PathBuf::from(value()?)),
                _ => kept.push(pair),
            }
        }
        let rebuilt = if kept.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        let mut config = PgConfig::from_str(&rebuilt)
            .map_err(|e| format!("`{url}` is not a PostgreSQL URL ({e}): expected {EXPECTED}"))?;
        if config.get_user().is_none() {
            return Err(format!("`{url}` names no user: expected {EXPECTED}"));
        }
        if config.get_hosts().is_empty() {
            return Err(format!("`{url}` names no host: expected {EXPECTED}"));
        }
        if config.get_dbname().is_none() {
            return Err(format!("`{url}` names no database: expected {EXPECTED}"));
        }
        if cert.is_some() != key.is_some() {
            return Err(format!("`{url}`: sslcert and sslkey go together"));
        }
        if config.get_application_name().is_none() {
            config.application_name("idemproxy");
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(2));
        }
        // A peer that vanished without a FIN (a failed host) is noticed within a minute.
        config.keepalives_idle(Duration::from_secs(30));
        config.ssl_mode(match sslmode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        });
        Ok(PostgresUrl {
            config,
            sslmode,
            rootcert,
            cert,
            key,
        })
    }

    /// A CA given (`store.tls_ca`, or `sslrootcert`) with a mode that checks nothing would
    /// look like verified TLS and be none: `prefer` falls back to plain text and, over TLS,
    /// accepts any certificate. Refused, saying why and what to write.
    pub fn check_ca(&self, ca_given: bool) -> Result<(), String> {
        let ca_given = ca_given || self.rootcert.is_some();
        let why = match self.sslmode {
            _ if !ca_given => return Ok(()),
            SslMode::Disable => "sslmode=disable uses no TLS at all",
            SslMode::Prefer => "sslmode=prefer (the default) falls back to plain text when the server offers no TLS, and checks no certificate when it does",
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => return Ok(()),
        };
        Err(format!(
            "a CA is given for PostgreSQL, but {why}: nothing would be verified against it. Add sslmode=verify-full (or verify-ca) to store.url"
        ))
    }

    /// The TLS connector `sslmode` asks for; as libpq, `require` with a root certificate
    /// checks the chain like `verify-ca`.
    pub(super) fn connector(&self, files: &TlsFiles) -> Result<MakeRustlsConnect, String> {
        let files = files.clone().with_overrides(
            self.rootcert.clone(),
            self.cert.clone(),
            self.key.clone(),
        )?;
        self.check_ca(files.ca.is_some())?;
        let verify = match self.sslmode {
            SslMode::VerifyFull => Verify::Full,
            SslMode::VerifyCa => Verify::Chain,
            SslMode::Require if files.ca.is_some() => Verify::Chain,
            _ => Verify::Nothing,
        };
        Ok(MakeRustlsConnect::new(tls::client_config(&files, verify)?))
    }
}

/// `url` with its password replaced, for messages.
pub(super) fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let Some((userinfo, host)) = rest.split_once('@') else {
        return url.to_string();
    };
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_keep_libpq_tls_settings_and_name_what_was_expected() {
        let u = PostgresUrl::parse(
            "postgres://idem:s3cret@db.internal:5433/claims?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x",
        )
        .expect("parses");
        assert_eq!(u.sslmode, SslMode::VerifyFull);
        assert_eq!(u.rootcert, Some(PathBuf::from("/etc/ca.pem")));
        assert_eq!(u.config.get_application_name(), Some("x"));
        assert_eq!(u.config.get_dbname(), Some("claims"));
        assert!(!format!("{u:?}").contains("s3cret"));

        let e =
            PostgresUrl::parse("postgres://idem@db/claims?sslmode=verify").expect_err("bad mode");
        assert!(e.contains("verify-full"), "{e}");
        let u = PostgresUrl::parse("postgres://idem@db/claims?sslrootcert=/etc/ca+1.pem")
            .expect("parses");
        assert_eq!(
            u.rootcert.as_deref(),
            Some(std::path::Path::new("/etc/ca+1.pem")),
            "a + in a URL is a plus"
        );
        let e = PostgresUrl::parse("postgres://idem:pw@db/claims?sslrootcert=%zz")
            .expect_err("a bad escape");
        assert!(e.contains("sslrootcert") && !e.contains("pw@"), "{e}");
        let e = PostgresUrl::parse("postgres://db:5432/claims").expect_err("no user");
        assert!(e.contains("names no user"), "{e}");
        let e = PostgresUrl::parse("postgres://idem@db:port/claims").expect_err("bad port");
        assert!(e.contains("expected postgres://"), "{e}");
        assert_eq!(
            redact("postgres://idem:s3cret@db/claims"),
            "postgres://idem:***@db/claims"
        );
    }
}
