//! The other ways to a protected provider than its routed host: its upstream's addresses
//! under another name (or none), and hosts of the provider that take side effects past the
//! route (its SMTP relays, its MCP server, upload and regional hosts). A CONNECT to any of them is refused before anything is sent; the names
//! an operator allows for tunnels are matched here too.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::providers::SideDoor;
use crate::routes::Route;

/// How long a route upstream's DNS answer is used before it is asked again.
const ANSWER_TTL: Duration = Duration::from_secs(60);
/// A route upstream that does not resolve is asked again after this.
const FAILED_TTL: Duration = Duration::from_secs(10);
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// `tls.tunnel_hosts`: exact names, and `*.example.com` for every name below example.com.
#[derive(Debug, Default)]
pub struct HostPatterns(Vec<String>);

impl HostPatterns {
    pub fn new(entries: &[String]) -> HostPatterns {
        HostPatterns(
            entries
                .iter()
                .map(|e| e.trim().trim_end_matches('.').to_ascii_lowercase())
                .collect(),
        )
    }

    pub fn matches(&self, host: &str) -> bool {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        self.0.iter().any(|p| match p.strip_prefix("*.") {
            Some(suffix) => host
                .strip_suffix(suffix)
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
            None => *p == host,
        })
    }

    pub fn names(&self) -> &[String] {
        &self.0
    }
}

/// A profile's side-door pattern: `*` stands for exactly one label.
fn side_door_matches(pattern: &str, host: &str) -> bool {
    let host = host.trim_end_matches('.');
    let (mut p, mut h) = (pattern.split('.'), host.split('.'));
    loop {
        match (p.next(), h.next()) {
            (None, None) => return true,
            (Some("*"), Some(label)) if !label.is_empty() => {}
            (Some(a), Some(b)) if a.eq_ignore_ascii_case(b) => {}
            _ => return false,
        }
    }
}

/// The route whose provider has `host` as a side door, and what that host is.
pub fn side_door<'r>(routes: &'r [Arc<Route>], host: &str) -> Option<(&'r Arc<Route>, SideDoor)> {
    routes.iter().find_map(|r| {
        let door = r
            .side_doors
            .iter()
            .find(|d| side_door_matches(d.host, host))?;
        Some((r, *door))
    })
}

/// Where the routes' upstreams are: `connect_to` addresses as written, names as DNS answers
/// now (cached for a minute), so a tunnel to the same address under another name is refused.
#[derive(Default)]
pub struct RoutedAddresses {
    answers: Mutex<Answers>,
}

/// `(host, port)` → when it was resolved, and what to.
type Answers = HashMap<(String, u16), (Instant, Arc<Vec<SocketAddr>>)>;

impl RoutedAddresses {
    /// The route that dials one of `addrs` (same address and port), if any.
    pub async fn route_at(
        &self,
        routes: &[Arc<Route>],
        addrs: &[SocketAddr],
    ) -> Option<Arc<Route>> {
        let wanted: Vec<SocketAddr> = addrs.iter().map(|a| canonical(*a)).collect();
        for route in routes {
            let dial = self.resolve(&route.dial.0, route.dial.1).await;
            if dial.iter().any(|a| wanted.contains(&canonical(*a))) {
                return Some(route.clone());
            }
        }
        None
    }

    async fn resolve(&self, host: &str, port: u16) -> Arc<Vec<SocketAddr>> {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = bare.parse::<IpAddr>() {
            return Arc::new(vec![SocketAddr::new(ip, port)]);
        }
        let key = (bare.to_string(), port);
        if let Some((at, addrs)) = self.lock().get(&key) {
            let ttl = if addrs.is_empty() {
                FAILED_TTL
            } else {
                ANSWER_TTL
            };
            if at.elapsed() < ttl {
                return addrs.clone();
            }
        }
        let looked_up: Vec<SocketAddr> =
            tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((bare, port)))
                .await
                .ok()
                .and_then(Result::ok)
                .map(|a| a.collect())
                .unwrap_or_default();
        let addrs = Arc::new(looked_up);
        self.lock().insert(key, (Instant::now(), addrs.clone()));
        addrs
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Answers> {
        self.answers.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// IPv4-mapped IPv6 compares as the IPv4 address it carries.
fn canonical(a: SocketAddr) -> SocketAddr {
    match a.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), a.port()),
            None => a,
        },
        IpAddr::V4(_) => a,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tunnel_hosts_match_names_and_names_below() {
        let p = HostPatterns::new(&["API.OpenAI.com.".into(), "*.anthropic.com".into()]);
        assert!(p.matches("api.openai.com"));
        assert!(p.matches("api.openai.com."));
        assert!(!p.matches("openai.com"));
        assert!(!p.matches("evil-api.openai.com"));
        assert!(p.matches("api.anthropic.com"));
        assert!(p.matches("a.b.anthropic.com"));
        assert!(!p.matches("anthropic.com"));
        assert!(!p.matches("evilanthropic.com"));
        assert!(!p.matches(".anthropic.com"));
    }

    #[test]
    fn side_door_stars_are_one_label() {
        assert!(side_door_matches(
            "email-smtp.*.amazonaws.com",
            "email-smtp.eu-west-1.amazonaws.com"
        ));
        assert!(side_door_matches("smtp.sendgrid.net", "SMTP.SendGrid.net."));
        assert!(!side_door_matches(
            "email-smtp.*.amazonaws.com",
            "email-smtp.amazonaws.com"
        ));
        assert!(!side_door_matches(
            "email-smtp.*.amazonaws.com",
            "email-smtp.a.b.amazonaws.com"
        ));
        assert!(!side_door_matches("smtp.sendgrid.net", "api.sendgrid.net"));
    }
}
