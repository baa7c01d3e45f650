//! `CONNECT host:port` (HTTPS_PROXY). A host a route covers is intercepted, so its requests go
//! through the idempotency pipeline. Any other host may get a blind tunnel — but no CONNECT is
//! a way to a protected provider past its route: not its upstream's address under another
//! name, not its other hosts (SMTP relays, MCP server…) no route covers, and not a ClientHello naming a routed host inside a tunnel opened
//! for something else. Where a route caps spend, unknown hosts are refused unless an operator
//! listed them, and addresses and hellos that hide their name are refused too.
//!
//! After answering 200 the proxy peeks at the client's first bytes (its ClientHello) before it
//! splices or terminates, as squid's peek-and-splice does; what it read is replayed exactly.

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::upgrade::{OnUpgrade, Upgraded};
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use self::peek::{peek, peek_while_server_speaks, Seen};
use self::replay::Replay;
use super::connection::ConnectionSlot;
use crate::config::UnknownHosts;
use crate::http::body::{empty, Body};
use crate::metrics::RequestOutcome;
use crate::proxy::egress_policy::side_doors;
use crate::proxy::egress_policy::{ConnectError, ConnectTarget};
use crate::proxy::App;
use crate::tls::client_hello::ClientHello;

pub mod intercept;
pub mod peek;
pub mod replay;
pub mod tunnel;

/// How long a blind tunnel may take to reach its target.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// The client's side of an answered CONNECT, with what the peek read put back.
type Client = Replay<TokioIo<Upgraded>>;

/// Answers a CONNECT from `tenant` (already authenticated by the caller). On success the
/// answer is an empty 200 and the connection is handed, once upgraded and peeked at, to the
/// interceptor or a blind tunnel.
pub async fn handle(app: Arc<App>, req: Request<Incoming>, tenant: String) -> Response<Body> {
    // Kept for the log line: clients show only the status of a refused CONNECT, never its
    // body, so the log and the metric are where its reason can be seen.
    let authority = req.uri().to_string();
    match open(app.clone(), req, tenant.clone()).await {
        Ok(resp) => resp,
        Err(e) => {
            refused(&app, &e, &authority, &tenant);
            e.into_response()
        }
    }
}

fn refused(app: &App, e: &ConnectError, authority: &str, tenant: &str) {
    app.metrics.request("-", RequestOutcome::Rejected);
    app.metrics.connect_refused(e.reason());
    tracing::info!(
        authority,
        tenant,
        reason = e.reason(),
        status = e.status().as_u16(),
        "CONNECT refused: {e}. {}",
        e.advice()
    );
}

/// What the connection is for, decided before the 200.
enum Plan {
    Intercept,
    /// A blind tunnel to this (already dialled) upstream, unless the peek says otherwise.
    Tunnel(TcpStream),
}

/// One answered CONNECT: who asked, for what, and on which deployment.
struct Tunnel {
    app: Arc<App>,
    target: ConnectTarget,
    tenant: String,
    run: Option<String>,
    /// A route caps spend: hellos that hide their name are refused.
    guarded: bool,
}

async fn open(
    app: Arc<App>,
    req: Request<Incoming>,
    tenant: String,
) -> Result<Response<Body>, ConnectError> {
    let target = ConnectTarget::parse(req.uri())?;
    // Held by the tunnel for its whole life (see `ConnectionSlot`).
    let slot = req.extensions().get::<ConnectionSlot>().cloned();
    let policy = &app.connect;
    if !policy.ports.contains(&target.port) {
        return Err(ConnectError::PortNotAllowed(target.port));
    }
    let routes = app.routes.all();
    let guarded = routes.iter().any(|r| r.spend.is_some());
    let plan = match app.routes.by_host(&target.host, target.port) {
        Some(route) if policy.leaves.is_none() => {
            return Err(ConnectError::NoCa {
                route: route.name.clone(),
                host: target.to_string(),
            })
        }
        Some(_) => Plan::Intercept,
        None => Plan::Tunnel(unrouted(&app, &routes, &target, guarded).await?),
    };
    // The run the proxy user names (`tenant.run`) belongs to every request in the tunnel.
    let tunnel = Tunnel {
        app: app.clone(),
        run: crate::auth::run_of_proxy_user(req.headers()),
        target,
        tenant,
        guarded,
    };
    let upgrade = hyper::upgrade::on(req);
    tokio::spawn(async move {
        let _slot = slot;
        tunnel.after_answer(upgrade, plan).await
    });
    Ok(established())
}

/// The checks for a host no route covers, then the dialled connection: a blind tunnel may
/// only go where none of the routes' providers is.
async fn unrouted(
    app: &App,
    routes: &[Arc<crate::routes::Route>],
    target: &ConnectTarget,
    guarded: bool,
) -> Result<TcpStream, ConnectError> {
    let policy = &app.connect;
    // A protected host on a port its route does not name is refused, not tunnelled past
    // the route.
    if let Some(route) = app.routes.on_other_port(&target.host, target.port) {
        return Err(ConnectError::RouteOnOtherPort {
            route: route.name.clone(),
            host: target.host.clone(),
            route_port: route.port.unwrap_or(target.port),
        });
    }
    if let Some((route, door)) = side_doors::side_door(routes, target.name()) {
        return Err(ConnectError::SideDoor {
            host: target.host.clone(),
            route: route.name.clone(),
            provider: door.what,
        });
    }
    if guarded && target.name().parse::<std::net::IpAddr>().is_ok() {
        return Err(ConnectError::AddressLiteral(target.to_string()));
    }
    if policy.unknown_hosts(guarded) == UnknownHosts::Deny
        && !policy.tunnel_hosts.matches(target.name())
    {
        return Err(match policy.unknown_hosts(false) {
            // Deny only because a route caps spend.
            UnknownHosts::Tunnel => ConnectError::HostNotListed(target.to_string()),
            UnknownHosts::Deny => ConnectError::HostDenied(target.to_string()),
        });
    }
    let addrs = tunnel::addresses(target, &app.egress).await?;
    if let Some(route) = policy.routed_addresses.route_at(routes, &addrs).await {
        return Err(ConnectError::RoutedAddress {
            target: target.to_string(),
            route: route.name.clone(),
            dial: format!("{}:{}", route.dial.0, route.dial.1),
        });
    }
    // Dial before answering, so an unreachable target is a 502 the client can read rather
    // than a tunnel that closes at once.
    tunnel::dial(target, &addrs, DIAL_TIMEOUT).await
}

impl Tunnel {
    /// Once the client has the 200: peek at what it sends first, then intercept, splice or
    /// close.
    async fn after_answer(self, upgrade: OnUpgrade, plan: Plan) {
        let mut io = match upgrade.await {
            Ok(upgraded) => TokioIo::new(upgraded),
            Err(e) => {
                tracing::debug!(target = %self.target, error = %e, "CONNECT upgrade failed");
                return;
            }
        };
        let policy = &self.app.connect;
        let whole = policy.handshake_timeout;
        let peeked = match &plan {
            // A client of an intercepted host has nothing to wait for: it speaks first.
            Plan::Intercept => peek(&mut io, std::future::pending(), whole).await,
            // A server that speaks first (SMTP, SSH) is spliced as soon as it does, or once
            // the client has said nothing for the peek timeout.
            Plan::Tunnel(upstream) => {
                let spoke = async {
                    let _ = tokio::time::timeout(policy.peek_timeout, upstream.readable()).await;
                };
                peek(&mut io, spoke, whole).await
            }
        };
        let client = Replay::new(peeked.bytes, io);
        match plan {
            Plan::Intercept => self.intercept_routed(client, peeked.seen).await,
            Plan::Tunnel(upstream) => self.tunnel(client, peeked.seen, upstream).await,
        }
    }

    /// A CONNECT to a routed host: TLS is terminated unless the hello names another host
    /// where that is refused.
    async fn intercept_routed(self, mut client: Client, seen: Seen) {
        match seen {
            Seen::Hello(hello) => {
                let other = hello
                    .server_name
                    .as_deref()
                    .filter(|n| *n != self.target.name());
                if self.guarded && other.is_some() {
                    return self.close(client, "sni_mismatch", &hello).await;
                }
                intercept::serve(self.app, self.target, client, self.tenant, self.run).await
            }
            Seen::NotTls => {
                intercept::not_tls(&self.app, &self.target, &mut client).await;
            }
            Seen::Malformed(why) => intercept::broke_off(
                &self.app,
                &self.target,
                "client_tls_failed",
                format_args!("bad TLS client hello: {why}"),
            ),
            Seen::Silence | Seen::Closed => {
                tracing::debug!(target = %self.target, "no TLS client hello")
            }
        }
    }

    /// A CONNECT to a host no route covers: a hello naming a routed host is that host's
    /// traffic (intercepted, to the route's own upstream; or refused where spend is capped);
    /// a hello that hides its name is refused where spend is capped; everything else is
    /// spliced, counted by what it sent.
    async fn tunnel(self, client: Client, seen: Seen, upstream: TcpStream) {
        let splice = match &seen {
            Seen::Closed => return,
            Seen::Silence => return self.after_silence(client, upstream).await,
            Seen::NotTls if self.guarded => return self.refuse(client, "not_tls").await,
            Seen::NotTls => "not_tls",
            Seen::Malformed(_) if self.guarded => {
                return self.refuse(client, "unparsed_hello").await
            }
            Seen::Malformed(_) => "unparsed",
            Seen::Hello(hello) => match self.judge(hello) {
                Judged::Splice(label) => label,
                Judged::Refuse(reason) => return self.close(client, reason, hello).await,
                Judged::Intercept => return self.intercept_hello(client, hello, upstream).await,
            },
        };
        if let Seen::Malformed(why) = seen {
            tracing::debug!(target = %self.target, why, "tunnel without a well-formed ClientHello");
        }
        self.splice(client, upstream, splice).await
    }

    /// The client said nothing within the peek timeout. Where a route caps spend that is
    /// refused, unless the operator lists the port as server-first (`tls.server_first_ports`):
    /// a silent client could otherwise send, unjudged, a ClientHello naming a capped provider
    /// that the tunnel host's address also serves (a shared CDN edge). Where it is let
    /// through, the server's bytes flow while the client's first bytes are held and judged
    /// by the same rules as an immediate ClientHello, before any of them is forwarded.
    async fn after_silence(self, client: Client, mut upstream: TcpStream) {
        let policy = &self.app.connect;
        if self.guarded && !policy.server_first_ports.contains(&self.target.port) {
            tracing::info!(target = %self.target, timeout = ?policy.peek_timeout, "the client sent nothing within tls.peek_timeout, and this port is not in tls.server_first_ports");
            return self.refuse(client, "silent_client").await;
        }
        let idle = policy.tunnel_idle_timeout;
        let (peeked, client) = peek_while_server_speaks(client, &mut upstream, idle).await;
        let client = client.put_back(peeked.bytes);
        let splice = match &peeked.seen {
            Seen::Closed => return,
            Seen::Silence => {
                tracing::debug!(target = %self.target, ?idle, "tunnel idle before the client spoke; closed");
                return;
            }
            Seen::NotTls => "server_first",
            Seen::Malformed(_) if self.guarded => {
                return self.refuse(client, "unparsed_hello").await
            }
            Seen::Malformed(_) => "unparsed",
            Seen::Hello(hello) => match self.judge(hello) {
                Judged::Splice(label) => label,
                Judged::Refuse(reason) => return self.close(client, reason, hello).await,
                Judged::Intercept => return self.intercept_hello(client, hello, upstream).await,
            },
        };
        self.splice(client, upstream, splice).await
    }

    /// A blind tunnel, counted by what its client sent first.
    async fn splice(self, client: Client, upstream: TcpStream, label: &'static str) {
        self.app.metrics.request("-", RequestOutcome::Tunnel);
        self.app.metrics.tunnel(label);
        let idle = self.app.connect.tunnel_idle_timeout;
        tunnel::run(client, upstream, self.target, idle).await
    }

    async fn intercept_hello(self, client: Client, hello: &ClientHello, upstream: TcpStream) {
        drop(upstream);
        let Some(name) = hello.server_name.clone() else {
            return;
        };
        self.intercept_by_name(client, name).await
    }

    fn judge(&self, hello: &ClientHello) -> Judged {
        let Some(name) = hello.server_name.as_deref() else {
            return if self.guarded {
                Judged::Refuse("no_sni")
            } else {
                Judged::Splice("no_sni")
            };
        };
        let same = name == self.target.name();
        if !same && self.app.routes.by_host(name, self.target.port).is_some() {
            return if self.guarded {
                Judged::Refuse("sni_mismatch")
            } else {
                Judged::Intercept
            };
        }
        // A shared TLS edge may serve a provider's other host on the tunnel's address.
        if !same && side_doors::side_door(&self.app.routes.all(), name).is_some() {
            return Judged::Refuse("sni_side_door");
        }
        match (same, hello.ech, self.guarded) {
            (false, _, true) => Judged::Refuse("sni_mismatch"),
            (_, true, true) => Judged::Refuse("ech"),
            (_, true, false) => Judged::Splice("ech"),
            (false, false, false) => Judged::Splice("sni_other"),
            (true, false, _) => Judged::Splice("sni_match"),
        }
    }

    /// The hello of a tunnel opened for an unrouted host names a routed one: its requests go
    /// to that route, as if the CONNECT had named it.
    async fn intercept_by_name(self, client: Client, name: String) {
        if self.app.connect.leaves.is_none() {
            return self.refuse(client, "no_ca").await;
        }
        tracing::info!(target = %self.target, sni = %name, "tunnel's ClientHello names a routed host: intercepted to its route");
        let target = ConnectTarget {
            host: name,
            port: self.target.port,
        };
        intercept::serve(self.app, target, client, self.tenant, self.run).await
    }

    async fn close(self, client: Client, reason: &'static str, hello: &ClientHello) {
        tracing::warn!(
            target = %self.target,
            sni = hello.server_name.as_deref().unwrap_or("-"),
            ech = hello.ech,
            reason,
            "tunnel refused after its ClientHello: where a route caps spend, a hello must name the host the CONNECT named"
        );
        self.refuse(client, reason).await
    }

    /// Closes the client's connection; nothing of it reached anyone.
    async fn refuse(self, mut client: Client, reason: &'static str) {
        self.app.metrics.request("-", RequestOutcome::Rejected);
        self.app.metrics.connect_refused(reason);
        tracing::info!(target = %self.target, reason, "tunnel closed before anything was sent");
        let _ = client.shutdown().await;
    }
}

enum Judged {
    Splice(&'static str),
    Refuse(&'static str),
    Intercept,
}

/// `200` with no body and no framing headers (RFC 9110 §9.3.6).
fn established() -> Response<Body> {
    Response::new(empty())
}
