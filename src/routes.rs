//! Routes resolved from config: which requests a route covers, where they go, and the
//! idempotency policy that applies to them.

use std::sync::Arc;

use http::uri::{Authority, Scheme};
use http::{HeaderName, Method, Uri};

use crate::config::{self, Config, ConfigError, Hold, MissingKey, RouteConfig};
use crate::idempotency::policy::{Policy, StatusSet};
use crate::idempotency::template::Template;
use crate::providers::{self, DuplicateRejection, KeyLimits, Placement};
use crate::proxy::upstream::{ClientOptions, UpstreamClient};

pub struct Upstream {
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
    pub upstream: Upstream,
    pub policy: Policy,
    pub key_header: HeaderName,
    pub forward_key_header: Option<HeaderName>,
    /// JSON body field the key is passed down in (exclusive with `forward_key_header`).
    pub forward_key_field: Option<String>,
    /// The provider's key limits; keys outside them are passed down in a derived form.
    pub forward_key_limits: KeyLimits,
    /// Derives a key for requests that carry none.
    pub key_template: Option<Template>,
    pub methods: Vec<Method>,
    pub missing_key: MissingKey,
    /// How long a fingerprint-derived key (`missing_key = "derive"`) lasts.
    pub dedup_window: std::time::Duration,
    /// The provider's "key already used" answer, never kept as a receipt.
    pub duplicate: Option<DuplicateRejection>,
    pub credential_headers: Vec<HeaderName>,
    /// Total deadline for one upstream call.
    pub timeout: std::time::Duration,
    /// `on_in_flight = "wait"`: how long a duplicate waits for the first request to settle.
    pub wait_timeout: std::time::Duration,
    pub client: UpstreamClient,
}

impl Route {
    pub fn protects(&self, method: &Method) -> bool {
        self.methods.contains(method)
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
}

impl Routes {
    pub fn build(config: &Config) -> Result<Routes, ConfigError> {
        let routes = config
            .routes
            .iter()
            .enumerate()
            .map(|(i, r)| build_route(config, i, r).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Routes { routes })
    }

    pub fn all(&self) -> &[Arc<Route>] {
        &self.routes
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
}

fn build_route(config: &Config, i: usize, r: &RouteConfig) -> Result<Route, ConfigError> {
    let field = |f: &str| format!("routes[{i}] ({}).{f}", r.name);
    let invalid = |f: &str, m: String| config.invalid(field(f), m);

    if r.name.is_empty()
        || !r
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(config.invalid(
            format!("routes[{i}].name"),
            "must be non-empty letters, digits, - or _",
        ));
    }
    let uri: Uri = r
        .upstream
        .parse()
        .map_err(|e| invalid("upstream", format!("`{}` is not a URL: {e}", r.upstream)))?;
    let scheme = match uri.scheme_str() {
        Some("https") => Scheme::HTTPS,
        Some("http") => Scheme::HTTP,
        _ => {
            return Err(invalid(
                "upstream",
                format!("`{}` must start with http:// or https://", r.upstream),
            ))
        }
    };
    let authority = uri
        .authority()
        .cloned()
        .ok_or_else(|| invalid("upstream", format!("`{}` has no host", r.upstream)))?;
    if uri.query().is_some() {
        return Err(invalid("upstream", "must not carry a query".into()));
    }
    let upstream = Upstream {
        scheme,
        host: authority.host().to_ascii_lowercase(),
        authority,
        base_path: uri.path().trim_end_matches('/').to_string(),
    };

    let (host, port) = match &r.host {
        Some(h) => split_host_port(h)
            .ok_or_else(|| invalid("host", format!("`{h}` is not a host or host:port")))?,
        None => (upstream.host.clone(), None),
    };
    let prefix = match &r.prefix {
        Some(p) if !p.starts_with('/') || p.len() < 2 => {
            return Err(invalid(
                "prefix",
                format!("`{p}` must start with / and name a path, e.g. /stripe"),
            ))
        }
        Some(p) => Some(p.trim_end_matches('/').to_string()),
        None => None,
    };

    let profile = match &r.provider {
        Some(name) => Some(providers::lookup(name).ok_or_else(|| {
            invalid(
                "provider",
                format!(
                    "`{name}` is not a built-in profile; known: {}",
                    providers::names().join(", ")
                ),
            )
        })?),
        None => None,
    };
    let honours_key = r
        .honours_key
        .or(profile.as_ref().map(|p| p.honours_key))
        .unwrap_or(false);
    let placement = match (&r.forward_key_header, &r.forward_key_field) {
        (Some(h), Some(f)) if !h.is_empty() && !f.is_empty() => {
            return Err(invalid(
                "forward_key_field",
                "set either forward_key_header or forward_key_field, not both".into(),
            ))
        }
        (Some(h), _) if !h.is_empty() => Placement::Header(h.clone()),
        (_, Some(f)) if !f.is_empty() => Placement::BodyField(f.clone()),
        (Some(_), _) | (_, Some(_)) => Placement::None,
        (None, None) => match &profile {
            Some(p) => p.placement.clone(),
            None => Placement::Header("Idempotency-Key".into()),
        },
    };
    let (forward_key_header, forward_key_field) = match placement {
        Placement::Header(h) => (
            Some(HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
                invalid("forward_key_header", format!("`{h}` is not a header name"))
            })?),
            None,
        ),
        Placement::BodyField(f) => (None, Some(f)),
        Placement::None => (None, None),
    };
    let base_limits = profile
        .as_ref()
        .map(|p| p.limits.clone())
        .unwrap_or_else(providers::default_limits);
    let forward_key_limits = KeyLimits::new(
        r.forward_key_min_len.unwrap_or(base_limits.min_len),
        r.forward_key_max_len.unwrap_or(base_limits.max_len),
        r.forward_key_charset
            .as_deref()
            .unwrap_or(base_limits.charset.spec()),
    )
    .map_err(|m| {
        invalid(
            if r.forward_key_charset.is_some() && m.contains("charset") {
                "forward_key_charset"
            } else {
                "forward_key_max_len"
            },
            m,
        )
    })?;
    let key_template = r
        .key
        .as_deref()
        .map(Template::parse)
        .transpose()
        .map_err(|m| invalid("key", format!("the key template cannot be used: {m}")))?;
    let duplicate = match &r.duplicate {
        Some(d) => Some(DuplicateRejection {
            status: d.status,
            code: d.code.clone(),
            lookup_hint: d.lookup_hint.clone(),
        }),
        None => profile.as_ref().and_then(|p| p.duplicate.clone()),
    };
    let hold = r.hold.unwrap_or(match &profile {
        Some(p) if p.hold_forever => Hold::Forever,
        _ => config::default_hold(),
    });
    let commit_statuses = r.commit_statuses.clone().unwrap_or_else(|| {
        match profile.as_ref().and_then(|p| p.commit_statuses) {
            Some(set) => set.iter().map(|s| s.to_string()).collect(),
            None => config::default_commit_statuses(),
        }
    });
    let unknown_statuses = r
        .unknown_statuses
        .clone()
        .unwrap_or_else(config::default_unknown_statuses);
    let key_header = HeaderName::from_bytes(r.key_header.as_bytes()).map_err(|_| {
        invalid(
            "key_header",
            format!("`{}` is not a header name", r.key_header),
        )
    })?;
    let methods = r
        .methods
        .iter()
        .map(|m| {
            Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                .map_err(|_| invalid("methods", format!("`{m}` is not a method")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let credential_headers = r
        .credential_headers
        .iter()
        .map(|h| {
            HeaderName::from_bytes(h.as_bytes())
                .map_err(|_| invalid("credential_headers", format!("`{h}` is not a header name")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let commit_statuses =
        StatusSet::parse(&commit_statuses).map_err(|m| invalid("commit_statuses", m))?;
    if let Some(bad) = unknown_statuses.iter().find(|s| !(100..=599).contains(*s)) {
        return Err(invalid(
            "unknown_statuses",
            format!("{bad} is not a status code"),
        ));
    }
    for (f, d) in [
        ("lease", r.lease),
        ("retention", r.retention),
        ("connect_timeout", r.connect_timeout),
        ("timeout", r.timeout),
        ("dedup_window", r.dedup_window),
        ("wait_timeout", r.wait_timeout),
    ] {
        if d.0.is_zero() {
            return Err(invalid(f, "must be greater than 0".into()));
        }
    }
    if r.lease.0 < std::time::Duration::from_secs(1) {
        return Err(invalid(
            "lease",
            "must be at least 1s: it is renewed every third of it".into(),
        ));
    }
    // A renewal lands at most a third of the lease plus one store timeout after the last;
    // any shorter lease lapses under a live holder whenever the store is merely slow.
    if r.lease.0.as_secs_f64() <= 1.5 * config.store.op_timeout.0.as_secs_f64() {
        return Err(invalid(
            "lease",
            format!(
                "must be longer than 1.5 × store.op_timeout ({}), or a slow store lets a live claim lapse",
                humantime::format_duration(config.store.op_timeout.0)
            ),
        ));
    }
    if let Some(path) = &r.upstream_ca {
        if !path.is_file() {
            return Err(invalid(
                "upstream_ca",
                format!("{} does not exist", path.display()),
            ));
        }
    }
    let client = UpstreamClient::new(&ClientOptions {
        extra_roots: r.upstream_ca.as_deref(),
        connect_to: r.connect_to.as_deref(),
        connect_timeout: r.connect_timeout.0,
        pool_idle_timeout: config.server.pool_idle_timeout.0,
        egress: None,
    })
    .map_err(|m| {
        invalid(
            if m.contains("host:port") {
                "connect_to"
            } else {
                "upstream_ca"
            },
            m,
        )
    })?;

    Ok(Route {
        name: r.name.clone(),
        host,
        port,
        prefix,
        upstream,
        policy: Policy {
            honours_key,
            commit_statuses,
            unknown_statuses,
            hold,
            lease: r.lease.0,
            retention: r.retention.0,
            upstream_timeout: r.timeout.0,
            on_in_flight: r.on_in_flight,
            fail_open: r.fail_open,
        },
        key_header,
        forward_key_header,
        forward_key_field,
        forward_key_limits,
        key_template,
        methods,
        missing_key: r.missing_key,
        dedup_window: r.dedup_window.0,
        duplicate,
        credential_headers,
        timeout: r.timeout.0,
        wait_timeout: r.wait_timeout.0,
        client,
    })
}

fn split_host_port(s: &str) -> Option<(String, Option<u16>)> {
    let authority: Authority = s.parse().ok()?;
    if authority.as_str().contains('@') {
        return None;
    }
    Some((authority.host().to_ascii_lowercase(), authority.port_u16()))
}
