//! Routes resolved from config: which requests a route covers, where they go, and the
//! idempotency policy that applies to them.

use std::sync::Arc;

use http::uri::{Authority, Scheme};
use http::{HeaderName, Method, Uri};

use crate::config::{self, Config, ConfigError, Hold, KeySource, RouteConfig};
use crate::idempotency::policy::{BodyRule, Condition, Policy, RuleOutcome, StatusSet, Test};
use crate::idempotency::template::Template;
use crate::identity::account::{AccountPart, AccountSpec};
use crate::identity::operations::Operation;
use crate::identity::provider_key::KeyField;
use crate::identity::{Identity, RouteIdentity, Signing};
use crate::providers::{self, KeyLimits, LimitsError};
use crate::proxy::upstream::{ClientError, ClientOptions, UpstreamClient};

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
    pub client: UpstreamClient,
}

impl Route {
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

    /// A route that covers `host` on another port than `port`: a request there must be
    /// refused, never passed through past the route's idempotency checks.
    pub fn on_other_port(&self, host: &str, port: u16) -> Option<&Arc<Route>> {
        let host = host.trim_end_matches('.');
        self.routes
            .iter()
            .find(|r| r.host.eq_ignore_ascii_case(host) && r.port.is_some_and(|p| p != port))
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
    let signing = profile.as_ref().map(|p| p.signing).unwrap_or_default();
    let key_field = match (&r.forward_key_header, &r.forward_key_field) {
        (Some(h), Some(f)) if !h.is_empty() && !f.is_empty() => {
            return Err(invalid(
                "forward_key_field",
                "set either forward_key_header or forward_key_field, not both".into(),
            ))
        }
        (Some(h), _) if !h.is_empty() => Some(KeyField::Header(
            HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
                invalid("forward_key_header", format!("`{h}` is not a header name"))
            })?,
        )),
        (_, Some(f)) if !f.is_empty() => Some(KeyField::Body(f.clone())),
        (Some(_), _) | (_, Some(_)) => None,
        (None, None) => match &profile {
            Some(p) => p.key_field.clone(),
            None => Some(KeyField::Header(HeaderName::from_static("idempotency-key"))),
        },
    };
    // A signed body is never changed, so a key can go down only in a header the signature
    // does not cover.
    let pass_key = match (&key_field, signing) {
        (Some(KeyField::Header(_)), Signing::None | Signing::Body) => key_field.clone(),
        (Some(KeyField::Body(_)), Signing::None) => key_field.clone(),
        _ => None,
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
    .map_err(|e| match e {
        LimitsError::Charset(m) => invalid("forward_key_charset", format!("charset {m}")),
        LimitsError::Length(m) => invalid("forward_key_max_len", m),
    })?;
    let key_template = r
        .key
        .as_deref()
        .map(Template::parse)
        .transpose()
        .map_err(|m| invalid("key", format!("the key template cannot be used: {m}")))?;
    let operations = r
        .operations
        .iter()
        .enumerate()
        .map(|(j, o)| {
            Operation::parse(o.name.as_deref(), &o.matches, &o.key, o.missing_key)
                .map_err(|(f, m)| invalid(&format!("operations[{j}].{f}"), m))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let key_source = match (r.key_source, &key_template) {
        (Some(KeySource::Template), None) => return Err(invalid(
            "key_source",
            "\"template\" needs a key template: set `key` (or use operations, which always derive)"
                .into(),
        )),
        (Some(source), _) => source,
        (None, Some(_)) => KeySource::Template,
        (None, None) => profile
            .as_ref()
            .and_then(|p| p.key_source)
            .unwrap_or(KeySource::Client),
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
    let declined_statuses = r
        .declined_statuses
        .clone()
        .unwrap_or_else(config::default_declined_statuses);
    let unknown_statuses = r.unknown_statuses.clone().unwrap_or_else(|| {
        match profile.as_ref().and_then(|p| p.unknown_statuses) {
            Some(set) => set.to_vec(),
            None => config::default_unknown_statuses(),
        }
    });
    let mut rules = r
        .outcome_rules
        .iter()
        .enumerate()
        .map(|(j, rule)| outcome_rule(rule).map_err(|m| invalid(&format!("outcome_rules[{j}]"), m)))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(d) = &r.duplicate {
        rules.push(BodyRule {
            statuses: Some(
                StatusSet::parse(&[d.status.to_string()])
                    .map_err(|m| invalid("duplicate.status", m))?,
            ),
            conditions: vec![Condition::new("code", Test::Equals(vec![d.code.clone()]))],
            outcome: RuleOutcome::Duplicate,
            note: if d.lookup_hint.is_empty() {
                format!("it already has an operation with the key passed down (code {})", d.code)
            } else {
                format!(
                    "it already has an operation with the key passed down (code {}). Look it up with {}",
                    d.code, d.lookup_hint
                )
            },
        });
    }
    if let Some(p) = &profile {
        rules.extend(p.rules.iter().cloned());
    }
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
    let account = match (&r.account, &r.credential_headers) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "account",
                "set either account or credential_headers, not both".into(),
            ))
        }
        (Some(t), None) => AccountSpec::Template(Template::parse(t).map_err(|m| {
            invalid(
                "account",
                format!("the account template cannot be used: {m}"),
            )
        })?),
        (None, Some(names)) => AccountSpec::Parts(vec![AccountPart::Headers(
            names
                .iter()
                .map(|h| {
                    HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
                        invalid("credential_headers", format!("`{h}` is not a header name"))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
        )]),
        (None, None) => AccountSpec::Parts(match &profile {
            Some(p) => p.account.clone(),
            None => vec![AccountPart::CredentialLike],
        }),
    };
    let retention = r
        .retention
        .map(|d| d.0)
        .or(profile.as_ref().and_then(|p| p.retention))
        .unwrap_or_else(config::default_retention);
    let dedup_window = r
        .dedup_window
        .map(|d| d.0)
        .or(profile.as_ref().and_then(|p| p.dedup_window))
        .unwrap_or_else(config::default_dedup_window);
    let commit_statuses =
        StatusSet::parse(&commit_statuses).map_err(|m| invalid("commit_statuses", m))?;
    let declined_statuses =
        StatusSet::parse(&declined_statuses).map_err(|m| invalid("declined_statuses", m))?;
    if let Some(bad) = unknown_statuses.iter().find(|s| !(100..=599).contains(*s)) {
        return Err(invalid(
            "unknown_statuses",
            format!("{bad} is not a status code"),
        ));
    }
    for (f, d) in [
        ("lease", r.lease.0),
        ("retention", retention),
        ("connect_timeout", r.connect_timeout.0),
        ("timeout", r.timeout.0),
        ("dedup_window", dedup_window),
        ("wait_timeout", r.wait_timeout.0),
    ] {
        if d.is_zero() {
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
    .map_err(|e| match e {
        ClientError::ConnectTo(_) => invalid("connect_to", e.to_string()),
        ClientError::Roots(_) | ClientError::Tls(_) => invalid("upstream_ca", e.to_string()),
    })?;

    let volatile: Vec<String> = profile
        .as_ref()
        .map(|p| p.volatile.iter().map(|v| v.to_string()).collect())
        .unwrap_or_default();
    Ok(Route {
        name: r.name.clone(),
        host,
        port,
        prefix,
        upstream,
        policy: Arc::new(Policy {
            honours_key,
            commit_statuses,
            declined_statuses,
            unknown_statuses,
            rules: Arc::from(rules),
            hold,
            lease: r.lease.0,
            retention,
            upstream_timeout: r.timeout.0,
            on_in_flight: r.on_in_flight,
            fail_open: r.fail_open,
        }),
        identity: RouteIdentity {
            key_header,
            key_source,
            template: key_template,
            operations,
            missing_key: r.missing_key,
            account,
            volatile,
            provider_key: key_field,
            signing,
        },
        pass_key,
        forward_key_limits,
        methods,
        dedup_window,
        timeout: r.timeout.0,
        wait_timeout: r.wait_timeout.0,
        client,
    })
}

/// A configured body rule: one condition (`equals`, `not_equals`, `prefix` or `non_empty`).
fn outcome_rule(r: &config::OutcomeRuleConfig) -> Result<BodyRule, String> {
    let outcome = RuleOutcome::parse(&r.outcome).ok_or_else(|| {
        format!(
            "outcome `{}` is not one of commit, decline, release, unknown, duplicate",
            r.outcome
        )
    })?;
    let tests: Vec<Test> = [
        (!r.equals.is_empty()).then(|| Test::Equals(r.equals.clone())),
        (!r.not_equals.is_empty()).then(|| Test::NotEquals(r.not_equals.clone())),
        (!r.prefix.is_empty()).then(|| Test::Prefix(r.prefix.clone())),
        r.non_empty.then_some(Test::NonEmpty),
    ]
    .into_iter()
    .flatten()
    .collect();
    let [test] = <[Test; 1]>::try_from(tests).map_err(|_| {
        "give exactly one test: equals, not_equals, prefix or non_empty = true".to_string()
    })?;
    if r.field.is_empty() || r.field.split('.').any(str::is_empty) {
        return Err(format!(
            "field `{}` must be a path like `error` or `data.0.sCode`",
            r.field
        ));
    }
    let statuses = r.status.as_ref().map(|s| StatusSet::parse(s)).transpose()?;
    Ok(BodyRule {
        statuses,
        conditions: vec![Condition::new(&r.field, test)],
        outcome,
        note: r.note.clone(),
    })
}

fn split_host_port(s: &str) -> Option<(String, Option<u16>)> {
    let authority: Authority = s.parse().ok()?;
    if authority.as_str().contains('@') {
        return None;
    }
    Some((authority.host().to_ascii_lowercase(), authority.port_u16()))
}
