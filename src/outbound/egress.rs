//! Where requests no route covers may go. By default anywhere public: destinations that
//! resolve to private, loopback, link-local or otherwise internal addresses are refused (SSRF),
//! unless `[egress] allow` names them. With `only_allowed = true`, only `allow` (and the routes'
//! own upstreams, which never pass through here) may be reached.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper_util::client::legacy::connect::dns::Name;

use crate::config::{Config, ConfigError};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Rule {
    Host { host: String, port: Option<u16> },
    Net { addr: IpAddr, prefix: u8 },
}

#[derive(Debug)]
pub struct Egress {
    rules: Vec<Rule>,
    only_allowed: bool,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EgressError {
    #[error("{host}:{port} is not on the egress allow-list")]
    NotAllowed { host: String, port: u16 },
    #[error("{host}:{port} resolves to {addr}, an internal address")]
    Internal {
        host: String,
        port: u16,
        addr: IpAddr,
    },
    #[error("cannot resolve {host}: {message}")]
    Resolve { host: String, message: String },
}

impl Egress {
    pub fn build(config: &Config) -> Result<Egress, ConfigError> {
        let rules = config
            .egress
            .allow
            .iter()
            .enumerate()
            .map(|(i, s)| {
                parse_rule(s).map_err(|m| config.invalid(format!("egress.allow[{i}]"), m))
            })
            .collect::<Result<_, _>>()?;
        Ok(Egress {
            rules,
            only_allowed: config.egress.only_allowed,
        })
    }

    fn names(&self, host: &str, port: u16) -> bool {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        self.rules.iter().any(|r| match r {
            Rule::Host { host: h, port: p } => {
                h.eq_ignore_ascii_case(host) && p.is_none_or(|p| p == port)
            }
            Rule::Net { .. } => host.parse::<IpAddr>().is_ok_and(|a| self.net_admits(a)),
        })
    }

    fn net_admits(&self, addr: IpAddr) -> bool {
        self.rules.iter().any(|r| match r {
            Rule::Net { addr: net, prefix } => in_net(addr, *net, *prefix),
            Rule::Host { .. } => false,
        })
    }

    /// Resolves `host` and returns the addresses it may be dialled at, or why not. Blind
    /// tunnels dial exactly these addresses; the passthrough client resolves again, through a
    /// resolver that vets its own answers (`GuardedResolver`). Either way a second DNS answer
    /// cannot swap in an internal address.
    pub async fn check(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, EgressError> {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let named = self.names(bare, port);
        if self.only_allowed && !named {
            return Err(EgressError::NotAllowed {
                host: bare.to_string(),
                port,
            });
        }
        let addrs: Vec<SocketAddr> = match bare.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, port)],
            Err(_) => tokio::net::lookup_host((bare, port))
                .await
                .map_err(|e| EgressError::Resolve {
                    host: bare.to_string(),
                    message: e.to_string(),
                })?
                .collect(),
        };
        if addrs.is_empty() {
            return Err(EgressError::Resolve {
                host: bare.to_string(),
                message: "no addresses".into(),
            });
        }
        if !named {
            // Every address must be public: refusing only some would let DNS pick the target.
            if let Some(bad) = addrs
                .iter()
                .find(|a| is_internal(a.ip()) && !self.net_admits(a.ip()))
            {
                return Err(EgressError::Internal {
                    host: bare.to_string(),
                    port,
                    addr: bad.ip(),
                });
            }
        }
        Ok(addrs)
    }
}

impl Egress {
    /// The check again, on the addresses the connection is about to use, for a host that
    /// passed [`Egress::check`]: a DNS answer that changed in between (rebinding) to an
    /// internal address is refused here. Ports were checked before; this sees names only.
    fn vet_resolved(&self, host: &str, addrs: &[SocketAddr]) -> Result<(), EgressError> {
        let named = self.rules.iter().any(|r| match r {
            Rule::Host { host: h, .. } => h.eq_ignore_ascii_case(host),
            Rule::Net { .. } => false,
        });
        if named {
            return Ok(());
        }
        if self.only_allowed && !addrs.iter().all(|a| self.net_admits(a.ip())) {
            return Err(EgressError::NotAllowed {
                host: host.to_string(),
                port: addrs.first().map(|a| a.port()).unwrap_or(0),
            });
        }
        match addrs
            .iter()
            .find(|a| is_internal(a.ip()) && !self.net_admits(a.ip()))
        {
            Some(bad) => Err(EgressError::Internal {
                host: host.to_string(),
                port: bad.port(),
                addr: bad.ip(),
            }),
            None => Ok(()),
        }
    }
}

/// The DNS resolver of the upstream client. With an [`Egress`] (the client for requests no
/// route covers) it refuses answers that point inside; without one it only resolves.
#[derive(Clone, Default)]
pub struct GuardedResolver {
    egress: Option<Arc<Egress>>,
}

impl GuardedResolver {
    pub fn new(egress: Option<Arc<Egress>>) -> GuardedResolver {
        GuardedResolver { egress }
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower_service::Service<Name> for GuardedResolver {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let egress = self.egress.clone();
        Box::pin(async move {
            let host = name.as_str();
            // Port 0: the connector fills in the real one.
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, 0)).await?.collect();
            if let Some(egress) = egress {
                egress.vet_resolved(host, &addrs)?;
            }
            Ok(addrs.into_iter())
        })
    }
}

fn parse_rule(s: &str) -> Result<Rule, String> {
    let s = s.trim();
    if let Some((addr, prefix)) = s.split_once('/') {
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("`{s}` is not a CIDR block like 10.0.0.0/8"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix: u8 = prefix
            .parse()
            .ok()
            .filter(|p| *p <= max)
            .ok_or_else(|| format!("`{s}`: the prefix length must be 0..={max}"))?;
        return Ok(Rule::Net { addr, prefix });
    }
    if let Ok(addr) = s
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
    {
        return Ok(Rule::Net {
            addr,
            prefix: if addr.is_ipv4() { 32 } else { 128 },
        });
    }
    let authority: http::uri::Authority = s
        .parse()
        .map_err(|_| format!("`{s}` is not a host, host:port or CIDR block"))?;
    if s.contains('@') || authority.host().is_empty() {
        return Err(format!("`{s}` is not a host, host:port or CIDR block"));
    }
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    Ok(match host.parse::<IpAddr>() {
        Ok(addr) if authority.port().is_none() => Rule::Net {
            addr,
            prefix: if addr.is_ipv4() { 32 } else { 128 },
        },
        _ => Rule::Host {
            host: host.to_ascii_lowercase(),
            port: authority.port_u16(),
        },
    })
}

fn in_net(addr: IpAddr, net: IpAddr, prefix: u8) -> bool {
    match (to_canonical(addr), net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

/// IPv4-mapped IPv6 (`::ffff:10.0.0.1`) is judged as the IPv4 address it carries.
fn to_canonical(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

/// Whether an address is anything but the public internet: loopback, private, shared (CGNAT),
/// link-local (cloud metadata at 169.254.169.254), unique-local, multicast, reserved,
/// documentation and benchmarking ranges, and IPv6 forms that embed such an IPv4 address.
pub fn is_internal(addr: IpAddr) -> bool {
    match to_canonical(addr) {
        IpAddr::V4(a) => v4_internal(a),
        IpAddr::V6(a) => v6_internal(a),
    }
}

fn v4_internal(a: Ipv4Addr) -> bool {
    const NETS: [([u8; 4], u8); 15] = [
        ([0, 0, 0, 0], 8),       // "this network"
        ([10, 0, 0, 0], 8),      // private
        ([100, 64, 0, 0], 10),   // shared address space (CGNAT)
        ([127, 0, 0, 0], 8),     // loopback
        ([169, 254, 0, 0], 16),  // link-local, cloud metadata
        ([172, 16, 0, 0], 12),   // private
        ([192, 0, 0, 0], 24),    // IETF protocol assignments
        ([192, 0, 2, 0], 24),    // TEST-NET-1
        ([192, 88, 99, 0], 24),  // 6to4 relay anycast
        ([192, 168, 0, 0], 16),  // private
        ([198, 18, 0, 0], 15),   // benchmarking
        ([198, 51, 100, 0], 24), // TEST-NET-2
        ([203, 0, 113, 0], 24),  // TEST-NET-3
        ([224, 0, 0, 0], 4),     // multicast
        ([240, 0, 0, 0], 4),     // reserved, broadcast
    ];
    NETS.iter()
        .any(|(net, p)| in_net(IpAddr::V4(a), IpAddr::V4(Ipv4Addr::from(*net)), *p))
}

fn v6_internal(a: Ipv6Addr) -> bool {
    let seg = a.segments();
    // NAT64 (64:ff9b::/96) and 6to4 (2002::/16) carry an IPv4 address: judge that one.
    if seg[0] == 0x64 && seg[1] == 0xff9b && seg[2..6] == [0, 0, 0, 0] {
        let o = a.octets();
        return v4_internal(Ipv4Addr::new(o[12], o[13], o[14], o[15]));
    }
    if seg[0] == 0x2002 {
        let o = a.octets();
        return v4_internal(Ipv4Addr::new(o[2], o[3], o[4], o[5]));
    }
    const NETS: [(u128, u8); 8] = [
        (0, 96),                      // ::, ::1 and IPv4-compatible
        (0x0064_ff9b_0001 << 80, 48), // local-use NAT64
        (0x0100 << 112, 64),          // discard-only
        (0x2001_0000 << 96, 23),      // IETF protocol assignments (Teredo, ORCHID…)
        (0x2001_0db8 << 96, 32),      // documentation
        (0xfc00 << 112, 7),           // unique local
        (0xfe80 << 112, 10),          // link-local
        (0xff00 << 112, 8),           // multicast
    ];
    NETS.iter()
        .any(|(net, p)| in_net(IpAddr::V6(a), IpAddr::V6(Ipv6Addr::from(*net)), *p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn internal(s: &str) -> bool {
        is_internal(s.parse().expect("address"))
    }

    #[test]
    fn internal_ranges_are_refused() {
        for a in [
            "10.0.0.1",
            "10.255.255.255",
            "172.16.0.1",
            "172.31.255.254",
            "192.168.1.1",
            "127.0.0.1",
            "127.8.9.10",
            "169.254.169.254",
            "169.254.0.1",
            "100.64.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "198.18.0.1",
            "192.0.2.1",
            "::1",
            "::",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "ff02::1",
            "::ffff:10.0.0.1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
            "2002:c0a8:0101::1",
            "2001:db8::1",
            "::127.0.0.1",
        ] {
            assert!(internal(a), "{a} must count as internal");
        }
    }

    #[test]
    fn public_addresses_pass() {
        for a in [
            "8.8.8.8",
            "1.1.1.1",
            "172.15.255.255",
            "172.32.0.1",
            "192.169.0.1",
            "100.128.0.1",
            "169.255.0.1",
            "11.0.0.1",
            "2606:4700::1111",
            "2a00:1450:4001::200e",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
        ] {
            assert!(!internal(a), "{a} must count as public");
        }
    }

    fn egress(toml: &str) -> Egress {
        Egress::build(&Config::parse(toml, Path::new("t.toml")).expect("config")).expect("egress")
    }

    // Only literal addresses below: these checks resolve nothing and send nothing.
    #[tokio::test]
    async fn allow_list_admits_named_internal_destinations() {
        let e = egress("[egress]\nallow = [\"10.1.0.0/16\", \"127.0.0.1:9\", \"::1\"]\n");
        assert!(e.check("10.1.2.3", 443).await.is_ok());
        assert!(matches!(
            e.check("10.2.0.1", 443).await,
            Err(EgressError::Internal { .. })
        ));
        assert!(e.check("127.0.0.1", 9).await.is_ok());
        assert!(e.check("127.0.0.1", 10).await.is_err());
        assert!(e.check("[::1]", 80).await.is_ok());
        assert!(e.check("169.254.169.254", 80).await.is_err());
        assert!(e.check("8.8.8.8", 443).await.is_ok());
    }

    #[tokio::test]
    async fn only_allowed_refuses_everything_else() {
        let e = egress("[egress]\nallow = [\"8.8.8.8\"]\nonly_allowed = true\n");
        assert!(e.check("8.8.8.8", 443).await.is_ok());
        assert_eq!(
            e.check("1.1.1.1", 443).await,
            Err(EgressError::NotAllowed {
                host: "1.1.1.1".into(),
                port: 443
            })
        );
    }

    // Resolves `localhost` from the hosts file; nothing is sent anywhere.
    #[tokio::test]
    async fn the_resolver_refuses_internal_answers() {
        use tower_service::Service as _;
        let name: Name = "localhost".parse().expect("name");
        let mut guarded = GuardedResolver::new(Some(Arc::new(egress(""))));
        assert!(guarded.call(name.clone()).await.is_err());
        let mut allowed = GuardedResolver::new(Some(Arc::new(egress(
            "[egress]\nallow = [\"localhost:1\"]\n",
        ))));
        assert!(allowed.call(name.clone()).await.is_ok());
        let mut plain = GuardedResolver::new(None);
        assert!(plain.call(name).await.is_ok_and(|mut a| a.next().is_some()));
    }

    #[test]
    fn bad_rules_name_the_field() {
        let config = Config::parse("[egress]\nallow = [\"10.0.0.0/40\"]\n", Path::new("t.toml"))
            .expect("parses");
        let e = Egress::build(&config).expect_err("error").to_string();
        assert!(e.contains("egress.allow[0]"), "{e}");
    }
}
