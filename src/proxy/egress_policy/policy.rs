//! What CONNECT may reach and why one is refused: the settings built at start-up (ports,
//! unknown hosts, the CA that intercepts), the target a CONNECT names, and its refusals.

use std::time::Duration;

use crate::proxy::refusals::{self, Kind};
use http::{Response, StatusCode, Uri};

use super::side_doors::{HostPatterns, RoutedAddresses};
use crate::config::{Config, ConfigError, UnknownHosts};
use crate::http::body::Body;
use crate::http::problem::Problem;
use crate::proxy::drain::{Intercepted, Pass};
use crate::tls::ca::CertAuthority;
use crate::tls::leaf_cache::LeafCache;

/// Everything CONNECT needs, built once at start-up.
pub struct ConnectPolicy {
    pub ports: Vec<u16>,
    /// `tls.unknown_hosts` as written; unset, it follows the routes (see [`Self::unknown_hosts`]).
    unknown_hosts: Option<UnknownHosts>,
    /// `tls.tunnel_hosts`: names tunnelled even when unknown hosts are refused.
    pub tunnel_hosts: HostPatterns,
    /// `tls.peek_timeout`: how long a tunnel waits for the client to speak first.
    pub peek_timeout: Duration,
    /// `tls.server_first_ports`: where a capped deployment lets a silent client wait for the
    /// server (whose bytes then flow while the client's first bytes are still judged).
    pub server_first_ports: Vec<u16>,
    /// Where the routes' upstreams are, as DNS says now (cached).
    pub routed_addresses: RoutedAddresses,
    /// `None` when no CA is configured: CONNECT to a routed host is then refused.
    pub leaves: Option<LeafCache>,
    /// Time a client has to finish its TLS handshake and send each request head.
    pub handshake_timeout: Duration,
    pub tunnel_idle_timeout: Duration,
    /// `server.max_header_bytes`, applied inside intercepted connections too.
    pub max_header_bytes: usize,
    /// Intercepted connections outlive the CONNECT request that opened them, so the
    /// listener's graceful shutdown never sees them; they are drained here instead.
    intercepted: Intercepted,
}

impl ConnectPolicy {
    /// Loads the CA when `[tls]` names one; a missing, malformed or mismatched pair is an
    /// error naming the field.
    pub fn build(config: &Config) -> Result<ConnectPolicy, ConfigError> {
        let leaves = match (&config.tls.ca_cert, &config.tls.ca_key) {
            (Some(cert), Some(key)) => Some(LeafCache::new(
                CertAuthority::load(cert, key)
                    .map_err(|e| config.invalid(e.field(), e.to_string()))?,
            )),
            _ => None,
        };
        Ok(ConnectPolicy {
            ports: config.tls.connect_ports.clone(),
            unknown_hosts: config.tls.unknown_hosts,
            tunnel_hosts: HostPatterns::new(&config.tls.tunnel_hosts),
            peek_timeout: config.tls.peek_timeout.0,
            server_first_ports: config.tls.server_first_ports.clone(),
            routed_addresses: RoutedAddresses::default(),
            leaves,
            handshake_timeout: config.server.header_read_timeout.0,
            tunnel_idle_timeout: config.tls.tunnel_idle_timeout.0,
            max_header_bytes: config.server.max_header_bytes,
            intercepted: Intercepted::default(),
        })
    }

    /// What a CONNECT to a host no route covers gets, with these routes: `tls.unknown_hosts`,
    /// else `deny` while any route caps spend (a reload that adds caps closes the door too).
    pub fn unknown_hosts(&self, guarded: bool) -> UnknownHosts {
        match self.unknown_hosts {
            Some(mode) => mode,
            None if guarded => UnknownHosts::Deny,
            None => UnknownHosts::Tunnel,
        }
    }

    /// A pass for an intercepted connection about to serve requests; `None` when the proxy
    /// is shutting down.
    pub fn enter(&self) -> Option<Pass> {
        self.intercepted.enter()
    }

    /// Asks every intercepted connection to finish its in-flight requests and close (an idle
    /// one closes at once), and waits up to `grace` for them. Returns whether they all did.
    pub async fn drain_intercepted(&self, grace: Duration) -> bool {
        self.intercepted.drain(grace).await
    }
}

/// What `check-config` says about CONNECT to hosts no route covers, and why.
pub fn summary(config: &Config) -> String {
    let capped = config.routes.iter().find(|r| r.spend.is_some());
    let listed = if config.tls.tunnel_hosts.is_empty() {
        "none".to_string()
    } else {
        config.tls.tunnel_hosts.join(", ")
    };
    let doors = match (config.unknown_hosts(), capped) {
        (UnknownHosts::Deny, Some(route)) if config.tls.unknown_hosts.is_none() => format!(
            "CONNECT to hosts no route covers: refused, because route `{}` caps spend (an agent must not reach a payment provider by another name or address); tunnelled: {listed} (tls.tunnel_hosts). IP addresses and ClientHellos that hide or change the name are refused too.",
            route.name
        ),
        (UnknownHosts::Deny, _) => format!(
            "CONNECT to hosts no route covers: refused (tls.unknown_hosts = \"deny\"); tunnelled: {listed} (tls.tunnel_hosts)."
        ),
        (UnknownHosts::Tunnel, Some(route)) => format!(
            "CONNECT to hosts no route covers: blind tunnel although route `{}` caps spend (tls.tunnel_with_spend = true). IP addresses and ClientHellos that hide or change the name are still refused.",
            route.name
        ),
        (UnknownHosts::Tunnel, None) => "CONNECT to hosts no route covers: blind tunnel (tls.unknown_hosts = \"tunnel\"), except the routes' own upstream addresses and their providers' other hosts (SMTP relays, MCP servers…) no route covers.".to_string(),
    };
    if capped.is_none() {
        return doors;
    }
    let ports: Vec<String> = config
        .tls
        .server_first_ports
        .iter()
        .map(u16::to_string)
        .collect();
    let ports = if ports.is_empty() {
        "none".to_string()
    } else {
        ports.join(", ")
    };
    format!("{doors} A tunnel whose client sends nothing within tls.peek_timeout is refused, except on ports where the server speaks first: {ports} (tls.server_first_ports).")
}

/// Why a CONNECT was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("`{0}` is not a CONNECT target of the form host:port")]
    BadTarget(String),
    #[error("CONNECT to port {0} is not allowed")]
    PortNotAllowed(u16),
    #[error("no route covers {0}, and tls.unknown_hosts is \"deny\"")]
    HostDenied(String),
    #[error("no route covers {0}; a route caps spend, so only the names in tls.tunnel_hosts are tunnelled")]
    HostNotListed(String),
    #[error("{0} is an address, and a route caps spend: an address says nothing about whose server is behind it")]
    AddressLiteral(String),
    #[error("{target} is where route `{route}` sends its requests ({dial}): a tunnel there would reach the provider past the route")]
    RoutedAddress {
        target: String,
        route: String,
        dial: String,
    },
    #[error("{host} is the {provider} of route `{route}`'s provider: what is sent there takes effect past the route")]
    SideDoor {
        host: String,
        route: String,
        provider: &'static str,
    },
    #[error("route `{route}` covers {host}, but no CA is configured to intercept its HTTPS")]
    NoCa { route: String, host: String },
    #[error("cannot reach {target}: {reason}")]
    Unreachable { target: String, reason: String },
    #[error("egress refused: {0}")]
    EgressRefused(String),
    #[error("route `{route}` protects {host} on port {route_port}, not on this port")]
    RouteOnOtherPort {
        route: String,
        host: String,
        route_port: u16,
    },
}

impl ConnectError {
    /// Its status, slug and title, declared once in `proxy::refusals`.
    pub fn kind(&self) -> &'static Kind {
        match self {
            ConnectError::BadTarget(_) => &refusals::BAD_CONNECT_TARGET,
            ConnectError::PortNotAllowed(_) | ConnectError::RouteOnOtherPort { .. } => {
                &refusals::CONNECT_PORT
            }
            ConnectError::HostDenied(_) | ConnectError::HostNotListed(_) => &refusals::CONNECT_HOST,
            ConnectError::AddressLiteral(_) => &refusals::CONNECT_ADDRESS,
            ConnectError::RoutedAddress { .. } => &refusals::CONNECT_ROUTED_ADDRESS,
            ConnectError::SideDoor { .. } => &refusals::CONNECT_SIDE_DOOR,
            ConnectError::NoCa { .. } => &refusals::NO_CA,
            ConnectError::EgressRefused(_) => &refusals::EGRESS_REFUSED,
            ConnectError::Unreachable { .. } => &refusals::TUNNEL_UNREACHABLE,
        }
    }

    pub fn status(&self) -> StatusCode {
        self.kind().status
    }

    pub fn slug(&self) -> &'static str {
        self.kind().slug
    }

    /// The metric label: a small fixed set, so a scrape never grows with the hosts asked for.
    pub fn reason(&self) -> &'static str {
        match self {
            ConnectError::BadTarget(_) => "bad_target",
            ConnectError::PortNotAllowed(_) => "port_not_allowed",
            ConnectError::RouteOnOtherPort { .. } => "route_on_other_port",
            ConnectError::HostDenied(_) => "host_denied",
            ConnectError::HostNotListed(_) => "host_not_listed",
            ConnectError::AddressLiteral(_) => "address_literal",
            ConnectError::RoutedAddress { .. } => "routed_address",
            ConnectError::SideDoor { .. } => "side_door",
            ConnectError::NoCa { .. } => "no_ca",
            ConnectError::EgressRefused(_) => "egress_refused",
            ConnectError::Unreachable { .. } => "unreachable",
        }
    }

    pub fn title(&self) -> &'static str {
        self.kind().title
    }

    pub fn into_response(self) -> Response<Body> {
        Problem {
            status: self.status(),
            slug: self.slug(),
            title: self.title(),
            detail: format!("{self}. {}", self.advice()),
            retry_after: None,
        }
        .into_response()
    }

    pub fn advice(&self) -> String {
        match self {
            ConnectError::BadTarget(_) => "Send `CONNECT host:port`, e.g. `CONNECT api.stripe.com:443`.".into(),
            ConnectError::PortNotAllowed(_) => "Use an allowed port, or add this one to tls.connect_ports.".into(),
            ConnectError::HostDenied(_) => "Only hosts a route covers may be reached through this proxy; add a route, list the host in tls.tunnel_hosts, or set tls.unknown_hosts = \"tunnel\".".into(),
            ConnectError::HostNotListed(_) => "Nothing was sent. Where a route caps spend, the proxy is the only way out: an operator lists the hosts workers need (their LLM API…) in tls.tunnel_hosts, or adds a route.".into(),
            ConnectError::AddressLiteral(_) => "Nothing was sent. Use the host's name (one a route covers, or one in tls.tunnel_hosts).".into(),
            ConnectError::RoutedAddress { route, .. } => format!("Nothing was sent. Send the request to the host route `{route}` covers, so it passes the route's checks."),
            ConnectError::SideDoor { route, host, .. } => format!("Nothing was sent. Send through the API route `{route}` protects instead, or add a route for {host} (an MCP server: a route with protocol = \"mcp\")."),
            ConnectError::NoCa { .. } => "The proxy refuses to tunnel a protected host past its idempotency checks. Run `idemproxy ca init`, set tls.ca_cert and tls.ca_key, and trust the CA on the worker; or use the route's base URL instead of HTTPS_PROXY.".into(),
            ConnectError::Unreachable { .. } => "Nothing was sent. Check the host name and that it accepts connections, then retry.".into(),
            ConnectError::EgressRefused(_) => "Nothing was sent. An operator can allow the destination in [egress] allow, or add a route for it.".into(),
            ConnectError::RouteOnOtherPort { .. } => "A tunnel to this port would bypass the route's idempotency checks. Use the route's port, or add this one to the route's host.".into(),
        }
    }
}

/// Where a CONNECT goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectTarget {
    /// Lowercase, as `Authority::host` spells it (IPv6 in brackets); what routes match on.
    pub host: String,
    pub port: u16,
}

impl ConnectTarget {
    pub fn parse(uri: &Uri) -> Result<ConnectTarget, ConnectError> {
        let bad = || ConnectError::BadTarget(uri.to_string());
        let authority = match (uri.authority(), uri.scheme(), uri.path_and_query()) {
            (Some(a), None, None) => a,
            _ => return Err(bad()),
        };
        if authority.as_str().contains('@') {
            return Err(bad());
        }
        let host = authority.host().trim_end_matches('.').to_ascii_lowercase();
        match authority.port_u16() {
            Some(port) if port != 0 && !host.is_empty() => Ok(ConnectTarget { host, port }),
            _ => Err(bad()),
        }
    }

    /// The host as a certificate names it and a resolver takes it: IPv6 without brackets.
    pub fn name(&self) -> &str {
        self.host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(&self.host)
    }
}

impl std::fmt::Display for ConnectTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<ConnectTarget, ConnectError> {
        let uri: Uri = s.parse().map_err(|_| ConnectError::BadTarget(s.into()))?;
        ConnectTarget::parse(&uri)
    }

    #[test]
    fn targets_need_a_host_and_a_nonzero_port() {
        assert_eq!(
            parse("API.Stripe.com.:443").expect("test setup"),
            ConnectTarget {
                host: "api.stripe.com".into(),
                port: 443
            }
        );
        let v6 = parse("[::1]:8443").expect("test setup");
        assert_eq!(
            (v6.host.as_str(), v6.name(), v6.port),
            ("[::1]", "::1", 8443)
        );
        for bad in [
            "api.stripe.com",
            "api.stripe.com:0",
            "user@api.stripe.com:443",
            "/v1/charges",
            "https://api.stripe.com:443/",
            ":443",
        ] {
            assert!(
                matches!(parse(bad), Err(ConnectError::BadTarget(_))),
                "{bad}"
            );
        }
    }
}
