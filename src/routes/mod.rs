//! Routes resolved from config: which requests a route covers, where they go, and the
//! idempotency policy that applies to them.

use std::sync::Arc;

use arc_swap::ArcSwap;
use http::uri::{Authority, Scheme};
use http::{Method, Uri};

use crate::config::{Config, ConfigError};
use crate::idempotency::policy::Policy;
use crate::identity::key_limits::KeyLimits;
use crate::identity::operations::Pattern;
use crate::identity::passed_down::Passing;
use crate::identity::provider_key::KeyField;
use crate::identity::scope::Place;
use crate::identity::{Identity, RouteIdentity};
use crate::mcp::McpRules;
use crate::outbound::lookup::Lookup;
use crate::outbound::upstream::Upstream;
use crate::providers::ErrorShape;
use crate::request::path::PathRules;
use crate::spend::budget::Budget;
use crate::spend::cost::Pricing;

mod build;

/// Where a route's upstream is: its base URL, taken apart.
pub struct UpstreamBase {
    pub scheme: Scheme,
    pub authority: Authority,
    /// Host name, lowercase, without port.
    pub host: String,
    /// Path the upstream URL carries, without a trailing slash (`""` for none).
    pub base_path: String,
}

pub struct Route {
    pub name: String,
    /// Host matched by the forward proxy and HTTPS interception (lowercase).
    pub host: String,
    /// Port the host must be addressed on, when the route's `host` names one.
    pub port: Option<u16>,
    pub prefix: Option<String>,
    pub upstream: UpstreamBase,
    pub policy: Arc<Policy>,
    /// How accounts and operations are told apart.
    pub identity: RouteIdentity,
    /// Where the proxy passes its key down; `None` when the provider takes none, or signs
    /// what would carry it.
    pub pass_key: Option<KeyField>,
    /// The provider's key limits; keys outside them are passed down in a derived form.
    pub forward_key_limits: KeyLimits,
    pub methods: Vec<Method>,
    /// How long a request-derived identity (`key_source = "request"`, `missing_key =
    /// "derive"`) lasts.
    pub dedup_window: std::time::Duration,
    /// Total deadline for one upstream call.
    pub timeout: std::time::Duration,
    /// `on_in_flight = "wait"`: how long a duplicate waits for the first request to settle.
    pub wait_timeout: std::time::Duration,
    pub client: Arc<dyn Upstream>,
    /// How to ask the provider whether a held operation happened.
    pub lookup: Option<Lookup>,
    /// Caps and approvals for the requests that move money.
    pub spend: Option<RouteSpend>,
    /// `[routes.payments] x402 = true`: payments agents make per request, read and priced.
    pub payments: Option<crate::spend::x402::X402Rules>,
    /// How the provider's SDKs expect errors to look.
    pub errors: ErrorShape,
    /// Where the route's client dials (its `connect_to`, else the upstream's host and port):
    /// a blind tunnel there would reach the provider past the route.
    pub dial: (String, u16),
    /// Other hosts of the provider that perform side effects past this route (its SMTP
    /// relays, its MCP server…; `*` for one label): reachable through CONNECT only where a
    /// route of their own covers them.
    pub side_doors: &'static [crate::providers::SideDoor],
    /// What the provider's paths may hold beyond the proxy's grammar.
    pub path: PathRules,
    /// `protocol = "mcp"`: every POST is a JSON-RPC message, and the operation a tool call.
    pub mcp: Option<McpRules>,
}

/// `[routes.spend]`, built.
#[derive(Debug, Clone)]
pub struct RouteSpend {
    /// The requests that move or change money, and how each is priced.
    pub on: Vec<PricedOperation>,
    pub budget: Budget,
    /// Where a request's run comes from, first match wins; none: the tenant is one run.
    pub run_from: Vec<RunSource>,
    /// `false`: shadow mode (decisions logged and counted, nothing refused).
    pub enforce: bool,
    /// Capped operations whose keyless requests may derive an identity from the request.
    pub derive_without_key: Vec<Pattern>,
    /// Body fields left out of what a price and an approval are bound to.
    pub descriptive: Vec<String>,
}

/// One money-moving request of a route: which, how it is priced, and whether its answer
/// names an object whose later steps cost nothing more (kind, where the id is).
#[derive(Debug, Clone)]
pub struct PricedOperation {
    pub pattern: Pattern,
    pub pricing: Pricing,
    pub records: Option<(&'static str, &'static str)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunSource {
    /// The `Proxy-Authorization` user `tenant.run`.
    ProxyUser,
    Header(http::HeaderName),
}

impl RouteSpend {
    pub fn covers(&self, method: &Method, path: &str) -> bool {
        self.operation(method, path).is_some()
    }

    /// The first of the route's money-moving requests this one is.
    pub fn operation(&self, method: &Method, path: &str) -> Option<&PricedOperation> {
        self.on.iter().find(|p| p.pattern.matches(method, path))
    }

    /// Whether a keyless request to this capped operation may derive its identity from the
    /// whole request (a charge), rather than be refused (money out, orders).
    pub fn derives_without_key(&self, method: &Method, path: &str) -> bool {
        self.derive_without_key
            .iter()
            .any(|p| p.matches(method, path))
    }
}

/// Headers whose meaning is the message's body: the proxy reads them to read the body.
const CONTENT_HEADERS: [http::HeaderName; 3] = [
    http::header::CONTENT_TYPE,
    http::header::CONTENT_LENGTH,
    http::header::CONTENT_ENCODING,
];

impl Route {
    /// Where this route's operations are claimed for `tenant`: the scope's every part but
    /// the operation's own (the pipeline and the operators' key API build scopes from it
    /// alone, so the two agree to the byte).
    pub fn place<'a>(&'a self, namespace: &'a str, tenant: &'a str) -> Place<'a> {
        Place {
            namespace,
            tenant,
            route: &self.name,
            upstream_host: &self.upstream.host,
        }
    }

    /// How this route passes keys down to its provider (`identity::passed_down`).
    pub fn passing(&self) -> Passing<'_> {
        Passing {
            sets_key: self.pass_key.is_some(),
            limits: &self.forward_key_limits,
        }
    }

    /// Whether the proxy reads the header `name` on this route's protected requests: to
    /// identify them, to read their body, or to find their run. (A `Connection` header that
    /// names one would have the proxy decide on a header the provider never gets.)
    pub fn reads_header(&self, name: &http::HeaderName) -> bool {
        CONTENT_HEADERS.contains(name)
            || self.identity.reads_header(name)
            || matches!(&self.pass_key, Some(KeyField::Header(h)) if h == name)
            || self.spend.as_ref().is_some_and(|s| {
                s.budget.reads_header(name)
                    || s.run_from
                        .iter()
                        .any(|r| matches!(r, RunSource::Header(h) if h == name))
            })
    }

    pub fn protects(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    /// A method that differs from a protected one only in case (`post`): methods are
    /// case-sensitive, so it would pass unprotected while a lenient provider executes it.
    pub fn protects_other_case(&self, method: &Method) -> Option<&Method> {
        let m = method.as_str();
        self.methods
            .iter()
            .find(|p| p.as_str() != m && p.as_str().eq_ignore_ascii_case(m))
    }

    /// The policy for one request: a request-derived identity lasts the dedup window, and a
    /// provider deduplicates only on keys it actually gets (a signed body keeps the client's
    /// own key, which need not be the same across two requests of one derived operation).
    pub fn policy_for(&self, identity: &Identity) -> Arc<Policy> {
        let reaches_provider =
            self.pass_key.is_some() || !matches!(identity, Identity::Derived { .. });
        let honours_key = self.policy.honours_key && reaches_provider;
        let request = matches!(identity, Identity::Request);
        if honours_key == self.policy.honours_key && !request {
            return self.policy.clone();
        }
        let mut p = (*self.policy).clone();
        p.honours_key = honours_key;
        if request {
            p.retention = self.dedup_window;
        }
        Arc::new(p)
    }

    /// The upstream URI for a request path (already stripped of the route prefix).
    pub fn upstream_uri(&self, path_and_query: &str) -> Result<Uri, http::Error> {
        let pq = if path_and_query.starts_with('/') {
            format!("{}{}", self.upstream.base_path, path_and_query)
        } else {
            format!("{}/{}", self.upstream.base_path, path_and_query)
        };
        Uri::builder()
            .scheme(self.upstream.scheme.clone())
            .authority(self.upstream.authority.clone())
            .path_and_query(pq)
            .build()
    }
}

pub struct Routes {
    routes: Vec<Arc<Route>>,
    /// Some route caps spend: a payment credential then goes only through a route that
    /// prices it.
    capped: bool,
}

impl Routes {
    pub fn build(config: &Config) -> Result<Routes, ConfigError> {
        let routes = config
            .routes
            .iter()
            .enumerate()
            .map(|(i, r)| build::route(config, i, r).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        let capped = routes.iter().any(|r| r.spend.is_some());
        Ok(Routes { routes, capped })
    }

    /// Whether some route caps spend (see `Routes::capped`).
    pub fn capped(&self) -> bool {
        self.capped
    }

    pub fn all(&self) -> &[Arc<Route>] {
        &self.routes
    }

    /// Every route's upstream replaced by `upstream`: the pipeline's tests put a scripted
    /// provider in place of the network.
    #[cfg(test)]
    pub(crate) fn with_upstream(mut self, upstream: Arc<dyn Upstream>) -> Routes {
        for route in &mut self.routes {
            Arc::get_mut(route)
                .expect("routes just built are not shared yet")
                .client = upstream.clone();
        }
        self
    }

    /// Base-URL mode: the first route whose prefix is a whole-segment prefix of `path`.
    /// Returns the route and the path after the prefix.
    pub fn by_prefix<'p>(&self, path: &'p str) -> Option<(&Arc<Route>, &'p str)> {
        self.routes.iter().find_map(|r| {
            let prefix = r.prefix.as_deref()?;
            let rest = path.strip_prefix(prefix)?;
            (rest.is_empty() || rest.starts_with('/') || rest.starts_with('?')).then_some((r, rest))
        })
    }

    /// Forward-proxy and interception mode: the first route for this host (and port).
    pub fn by_host(&self, host: &str, port: u16) -> Option<&Arc<Route>> {
        let host = host.trim_end_matches('.');
        self.routes
            .iter()
            .find(|r| r.host.eq_ignore_ascii_case(host) && r.port.is_none_or(|p| p == port))
    }

    /// A route that covers `host` on another port than `port`: a request there must be
    /// refused, never passed through past the route's idempotency checks.
    pub fn on_other_port(&self, host: &str, port: u16) -> Option<&Arc<Route>> {
        let host = host.trim_end_matches('.');
        self.routes
            .iter()
            .find(|r| r.host.eq_ignore_ascii_case(host) && r.port.is_some_and(|p| p != port))
    }
}

/// The routes a running proxy uses, replaced whole when its config is reloaded. A request
/// keeps the route it matched for its whole life, so a reload never changes one under way.
pub struct RouteTable(ArcSwap<Routes>);

impl RouteTable {
    pub fn new(routes: Routes) -> RouteTable {
        RouteTable(ArcSwap::from_pointee(routes))
    }

    /// From now on, requests match these routes.
    pub fn replace(&self, routes: Routes) {
        self.0.store(Arc::new(routes));
    }

    pub fn all(&self) -> Vec<Arc<Route>> {
        self.0.load().all().to_vec()
    }

    /// See [`Routes::capped`].
    pub fn capped(&self) -> bool {
        self.0.load().capped()
    }

    /// See [`Routes::by_prefix`].
    pub fn by_prefix<'p>(&self, path: &'p str) -> Option<(Arc<Route>, &'p str)> {
        self.0
            .load()
            .by_prefix(path)
            .map(|(route, rest)| (route.clone(), rest))
    }

    /// See [`Routes::by_host`].
    pub fn by_host(&self, host: &str, port: u16) -> Option<Arc<Route>> {
        self.0.load().by_host(host, port).cloned()
    }

    /// See [`Routes::on_other_port`].
    pub fn on_other_port(&self, host: &str, port: u16) -> Option<Arc<Route>> {
        self.0.load().on_other_port(host, port).cloned()
    }
}
