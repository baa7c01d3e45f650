//! DNS rebinding protection for MCP routes. A web page can make a browser post to a proxy on
//! a loopback listener under the page's own name (its DNS answer rebinds to 127.0.0.1): the
//! request then carries `Host: evil.example` and `Origin: http://evil.example`. An MCP server
//! refuses those itself, but behind the proxy it never sees the caller's `Host` (the proxy
//! sends the upstream's own), so the proxy checks both before anything is read or forwarded.
//!
//! A `Host` passes when it names the route's server (the name a client dials through the
//! proxy), a configured `allowed_hosts` entry, or — on a loopback listener — a loopback name.
//! On a listener that is not loopback and has no `allowed_hosts`, any `Host` passes: there is
//! no local service to rebind to. An `Origin`, when sent, passes when it is a configured
//! `allowed_origins` entry, or its host would pass as a `Host` (on a listener that is not
//! loopback: the request's own `Host`, same-origin). `Origin: null` never passes.

use http::HeaderMap;

/// The names a route accepts besides its server's and loopback ones (`[routes.mcp]
/// allowed_hosts`, `allowed_origins`), lowercase.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allowed {
    /// `host` (any port) or `host:port`.
    hosts: Vec<String>,
    /// `scheme://host` or `scheme://host:port`.
    origins: Vec<String>,
}

/// A configured name that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllowedError {
    #[error("`{0}` is not a host name or host:port (no scheme, path or wildcard)")]
    Host(String),
    #[error("`{0}` is not an origin: http:// or https://, a host, an optional port, no path")]
    Origin(String),
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("the Host `{0}` is not a name this MCP route answers to (DNS rebinding protection); an operator can add it to [routes.mcp] allowed_hosts")]
    Host(String),
    #[error("the Origin `{0}` is not allowed on this MCP route (DNS rebinding protection); an operator can add it to [routes.mcp] allowed_origins")]
    Origin(String),
}

impl Allowed {
    pub fn new(hosts: &[String], origins: &[String]) -> Result<Allowed, AllowedError> {
        let hosts = hosts
            .iter()
            .map(|h| {
                let h = h.trim().to_ascii_lowercase();
                match split_host(&h) {
                    Some((name, _)) if valid_name(name) => Ok(h),
                    _ => Err(AllowedError::Host(h)),
                }
            })
            .collect::<Result<_, _>>()?;
        let origins = origins
            .iter()
            .map(|o| {
                let o = o.trim().trim_end_matches('/').to_ascii_lowercase();
                match origin_host(&o) {
                    Some(host) if split_host(host).is_some_and(|(n, _)| valid_name(n)) => Ok(o),
                    _ => Err(AllowedError::Origin(o)),
                }
            })
            .collect::<Result<_, _>>()?;
        Ok(Allowed { hosts, origins })
    }
}

/// Where a request arrived, for the check.
pub struct Arrival<'a> {
    /// The names the route's server goes by (its matched host, its upstream's host).
    pub server_names: &'a [&'a str],
    /// Whether the proxy's listener is a loopback address.
    pub loopback_listener: bool,
    /// The request's authority when it has no `Host` header (HTTP/2, absolute form).
    pub authority: Option<&'a str>,
}

/// Refuses a request whose `Host` or `Origin` this route does not answer to.
pub fn check(allowed: &Allowed, arrival: &Arrival<'_>, headers: &HeaderMap) -> Result<(), Refused> {
    let host = headers
        .get(http::header::HOST)
        .map(|v| {
            String::from_utf8_lossy(v.as_bytes())
                .trim()
                .to_ascii_lowercase()
        })
        .or_else(|| arrival.authority.map(str::to_ascii_lowercase));
    if let Some(host) = &host {
        let open = !arrival.loopback_listener && allowed.hosts.is_empty();
        if !open && !host_passes(allowed, arrival, host) {
            return Err(Refused::Host(host.clone()));
        }
    }
    let Some(origin) = headers.get(http::header::ORIGIN) else {
        return Ok(());
    };
    let origin = String::from_utf8_lossy(origin.as_bytes())
        .trim()
        .trim_end_matches('/')
        .to_ascii_lowercase();
    if allowed.origins.contains(&origin) {
        return Ok(());
    }
    let Some(of) = origin_host(&origin) else {
        return Err(Refused::Origin(origin));
    };
    let same_origin = !arrival.loopback_listener
        && host.as_deref().and_then(split_host).map(|(n, _)| n) == split_host(of).map(|(n, _)| n);
    if same_origin || host_passes(allowed, arrival, of) {
        Ok(())
    } else {
        Err(Refused::Origin(origin))
    }
}

/// Whether `host` (lowercase, `name[:port]`) is the route's server, configured, or loopback
/// on a loopback listener.
fn host_passes(allowed: &Allowed, arrival: &Arrival<'_>, host: &str) -> bool {
    let Some((name, _)) = split_host(host) else {
        return false;
    };
    if arrival
        .server_names
        .iter()
        .any(|s| s.eq_ignore_ascii_case(name))
    {
        return true;
    }
    if arrival.loopback_listener && is_loopback(name) {
        return true;
    }
    allowed.hosts.iter().any(|entry| match split_host(entry) {
        Some((n, None)) => n == name,
        Some((_, Some(_))) => entry == host,
        None => false,
    })
}

/// `name[:port]` taken apart; an IPv6 literal keeps its brackets.
fn split_host(host: &str) -> Option<(&str, Option<&str>)> {
    if host.is_empty() {
        return None;
    }
    if host.starts_with('[') {
        let end = host.find(']')?;
        let (name, rest) = host.split_at(end + 1);
        return match rest {
            "" => Some((name, None)),
            r => r
                .strip_prefix(':')
                .filter(|p| valid_port(p))
                .map(|p| (name, Some(p))),
        };
    }
    match host.split_once(':') {
        None => Some((host, None)),
        Some((name, port)) if valid_port(port) && !name.is_empty() => Some((name, Some(port))),
        Some(_) => None,
    }
}

fn valid_port(p: &str) -> bool {
    !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit())
}

fn valid_name(name: &str) -> bool {
    if let Some(inner) = name.strip_prefix('[').and_then(|n| n.strip_suffix(']')) {
        return inner.parse::<std::net::Ipv6Addr>().is_ok();
    }
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
}

/// The `host[:port]` of an origin `scheme://host[:port]`; `None` for anything else (`null`).
fn origin_host(origin: &str) -> Option<&str> {
    let rest = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))?;
    (!rest.is_empty() && !rest.contains('/')).then_some(rest)
}

fn is_loopback(name: &str) -> bool {
    if name == "localhost" || name.ends_with(".localhost") {
        return true;
    }
    let bare = name.trim_start_matches('[').trim_end_matches(']');
    bare.parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                http::HeaderName::from_bytes(k.as_bytes()).expect("name"),
                v.parse().expect("value"),
            );
        }
        h
    }

    fn at(loopback_listener: bool) -> Arrival<'static> {
        Arrival {
            server_names: &["mcp.tools.example"],
            loopback_listener,
            authority: None,
        }
    }

    #[test]
    fn a_loopback_listener_answers_loopback_names_and_its_server_only() {
        let none = Allowed::default();
        for ok in [
            "localhost:8080",
            "127.0.0.1:8080",
            "[::1]:8080",
            "127.0.0.1",
            "mcp.tools.example",
        ] {
            assert_eq!(
                check(&none, &at(true), &headers(&[("host", ok)])),
                Ok(()),
                "{ok}"
            );
        }
        for foreign in [
            "evil.example.com",
            "evil.example.com:8080",
            "localhost.evil.com",
        ] {
            assert!(matches!(
                check(&none, &at(true), &headers(&[("host", foreign)])),
                Err(Refused::Host(_))
            ));
        }
        let configured = Allowed::new(&["proxy.internal".into()], &[]).expect("valid");
        assert_eq!(
            check(
                &configured,
                &at(true),
                &headers(&[("host", "proxy.internal:9")])
            ),
            Ok(())
        );
    }

    #[test]
    fn a_foreign_origin_is_refused_a_loopback_or_configured_one_passes() {
        let allowed = Allowed::new(&[], &["https://app.example".into()]).expect("valid");
        let with = |origin: &str, loopback| {
            check(
                &allowed,
                &at(loopback),
                &headers(&[("host", "127.0.0.1:8080"), ("origin", origin)]),
            )
        };
        assert_eq!(with("http://127.0.0.1:8080", true), Ok(()));
        assert_eq!(with("http://localhost:3000", true), Ok(()));
        assert_eq!(with("https://app.example", true), Ok(()));
        assert_eq!(with("https://app.example/", false), Ok(()));
        for foreign in [
            "http://evil.example.com",
            "null",
            "file://",
            "https://app.example.evil",
        ] {
            assert!(
                matches!(with(foreign, true), Err(Refused::Origin(_))),
                "{foreign}"
            );
            assert!(
                matches!(with(foreign, false), Err(Refused::Origin(_))),
                "{foreign}"
            );
        }
        // Off loopback, any Host passes, and an Origin of that same host does.
        let open = Allowed::default();
        let lan = headers(&[
            ("host", "10.1.2.3:8080"),
            ("origin", "http://10.1.2.3:8080"),
        ]);
        assert_eq!(check(&open, &at(false), &lan), Ok(()));
    }

    #[test]
    fn configured_names_are_checked() {
        assert!(Allowed::new(&["a.example:443".into(), "[::1]".into()], &[]).is_ok());
        for bad in [
            "https://a.example",
            "a.example/path",
            "*.example",
            "a:b",
            "",
        ] {
            assert!(Allowed::new(&[bad.into()], &[]).is_err(), "{bad}");
        }
        assert!(Allowed::new(&[], &["http://localhost:3000".into()]).is_ok());
        for bad in ["app.example", "https://app.example/x", "ftp://a", "null"] {
            assert!(Allowed::new(&[], &[bad.into()]).is_err(), "{bad}");
        }
    }
}
