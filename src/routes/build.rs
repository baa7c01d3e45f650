//! A route from its config block and its provider profile: each part of a route is built by
//! one function below, and every error names the field that caused it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use http::uri::{Authority, Scheme};
use http::{HeaderName, Method, Uri};

use super::{PricedOperation, Route, RouteSpend, RunSource, UpstreamBase};
use crate::config::{
    self, Config, ConfigError, Hold, KeySource, OutcomeRuleConfig, Protocol, RouteConfig,
};
use crate::idempotency::policy::{BodyRule, Condition, Policy, RuleOutcome, StatusSet, Test};
use crate::identity::account::{AccountPart, AccountSpec, CREDENTIAL_FIELDS};
use crate::identity::derivation::{Derivation, Derivations};
use crate::identity::key_limits::{default_limits, KeyLimits, LimitsError};
use crate::identity::operations::Operation;
use crate::identity::operations::Pattern;
use crate::identity::provider_key::KeyField;
use crate::identity::{RouteIdentity, Signing};
use crate::mcp::McpRules;
use crate::outbound::lookup::Lookup;
use crate::outbound::upstream::{ClientBuildError, ClientOptions, UpstreamClient};
use crate::providers::catalogue::RowPrice;
use crate::providers::{self, ErrorShape, Profile, SpendDefaults};
use crate::request::template::Template;
use crate::spend::budget::{Budget, BudgetText, OnUnpriced, Pricing, ToolCounts};
use crate::spend::money::Currency;
use crate::spend::x402::{Asset, X402Rules};

/// How long identical tool calls are one, unless `[routes.mcp] window` says otherwise.
const DEFAULT_MCP_WINDOW: Duration = Duration::from_secs(24 * 3600);

/// The `i`-th `[[routes]]` block, built.
pub fn route(config: &Config, i: usize, r: &RouteConfig) -> Result<Route, ConfigError> {
    let b = Builder::new(config, i, r)?;
    let upstream = b.upstream()?;
    let upstream_dial = (
        upstream.host.clone(),
        upstream
            .authority
            .port_u16()
            .unwrap_or(if upstream.scheme == Scheme::HTTPS {
                443
            } else {
                80
            }),
    );
    let (host, port) = match &r.host {
        Some(h) => split_host_port(h)
            .ok_or_else(|| b.invalid("host", format!("`{h}` is not a host or host:port")))?,
        // The upstream's host, on the port its URL names: another port of that host is
        // another server, not this route's. A URL without a port matches any (as
        // `http://api.example.com/...` sent to an https upstream does).
        None => (upstream.host.clone(), upstream.authority.port_u16()),
    };
    let (key_field, pass_key, forward_key_limits) = b.key_passing()?;
    let identity = b.identity(key_field)?;
    let lookup = b.lookup()?;
    let mut policy = b.policy()?;
    policy.reconcile_after = lookup.as_ref().map(|l| l.after);
    let payments = b.payments()?;
    if payments.is_some() && policy.reconcile_after.is_none() {
        // A held purchase is looked at on its next retry: the first attempt's payment is
        // presented again (`proxy::purchase`), never a new one.
        policy.reconcile_after = Some(Duration::ZERO);
    }
    let mcp = b.mcp()?;
    if let Some(rules) = &mcp {
        mcp_policy(&mut policy, rules.answer_timeout);
    }
    let dedup_window = b.dedup_window();
    b.check_durations(&policy, dedup_window)?;
    Ok(Route {
        name: r.name.clone(),
        host,
        port,
        prefix: b.prefix()?,
        upstream,
        policy: Arc::new(policy),
        identity,
        pass_key,
        forward_key_limits,
        methods: b.methods()?,
        dedup_window,
        timeout: r.timeout.0,
        wait_timeout: r.wait_timeout.0,
        client: Arc::new(b.client()?),
        lookup,
        spend: b.spend()?,
        payments,
        errors: match (&mcp, &b.profile) {
            (Some(_), _) => ErrorShape::JsonRpc,
            (None, profile) => profile.as_ref().map_or(ErrorShape::Problem, |p| p.errors),
        },
        dial: b.dial(&upstream_dial)?,
        side_doors: b.profile.as_ref().map_or(&[][..], |p| p.side_doors),
        path: b.profile.as_ref().map(|p| p.path).unwrap_or_default(),
        mcp,
    })
}

/// What a tool call's kept response makes of its claim. The kept response is the call's
/// final JSON-RPC message (HTTP 200), or the server's HTTP answer when it gave no message:
/// a JSON-RPC error, or a result that is not complete (`input_required`), executed nothing
/// and releases; a complete result (`isError` too) and a task handle (the task is created)
/// commit; 401, 403, 404
/// (an expired session) and 400 release; a 5xx or a 200 without the call's answer (502 here)
/// may have executed and is held. MCP servers take no idempotency key.
///
/// `input_required` keeps the claim, pending, for the call's continuation up to
/// `answer_timeout` (a person answers the question); and since a person's answer inside a
/// call's stream may stretch the call by as much, a holder's call may run that much longer
/// than the route's `timeout` (how long an abandoned claim counts as possibly running).
fn mcp_policy(policy: &mut Policy, answer_timeout: Duration) {
    let set = |e: &[&str]| {
        StatusSet::parse(&e.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .expect("a fixed status set parses")
    };
    policy.honours_key = false;
    policy.commit_statuses = set(&["2xx"]);
    policy.declined_statuses = set(&["!1xx"]);
    policy.unknown_statuses = vec![500, 502, 503, 504];
    policy.upstream_timeout += answer_timeout;
    let release = |field: &str, test: Test, note: &str| BodyRule {
        statuses: Some(set(&["2xx"])),
        conditions: vec![Condition::new(field, test)],
        outcome: RuleOutcome::Release,
        note: note.into(),
    };
    policy.rules = Arc::from(vec![
        release(
            "error",
            Test::NonEmpty,
            "a JSON-RPC error: the tool did not run",
        ),
        BodyRule {
            statuses: Some(set(&["2xx"])),
            conditions: vec![Condition::new(
                "result.resultType",
                Test::Equals(vec!["input_required".into()]),
            )],
            outcome: RuleOutcome::Await(answer_timeout),
            note: "input required: nothing executed yet; the claim waits for the continuation"
                .into(),
        },
        // The tasks extension (2026-07-28): a server answers a task handle only once the task
        // is durably created. The call took effect; its handle is the receipt a re-run gets, so
        // the re-run follows the same task instead of starting another.
        BodyRule {
            statuses: Some(set(&["2xx"])),
            conditions: vec![
                Condition::new("result.resultType", Test::Equals(vec!["task".into()])),
                Condition::new("result.taskId", Test::NonEmpty),
            ],
            outcome: RuleOutcome::Commit,
            note: "a task handle: the task is created and running; kept as the call's receipt"
                .into(),
        },
        release(
            "result.resultType",
            Test::NotEquals(vec!["complete".into()]),
            "not a complete result yet (input required, or a result type the proxy does not know)",
        ),
    ]);
}

/// One `release_errors` entry: text an error result contains, compared lowercase. Not a
/// regular expression, so what looks like one is refused rather than matched literally.
fn release_pattern(p: &str) -> Result<String, String> {
    let text = p.trim();
    if text.is_empty() {
        return Err("an empty entry would release every isError result: name the text that says nothing happened".into());
    }
    if text.len() > 200 {
        return Err(format!("`{p}` is longer than 200 bytes"));
    }
    if text.starts_with('^') || text.ends_with('$') || text.contains(".*") {
        return Err(format!(
            "`{p}` looks like a regular expression; entries are plain text the error contains (case-insensitive), e.g. \"rate limited\""
        ));
    }
    Ok(text.to_ascii_lowercase())
}

struct Builder<'a> {
    config: &'a Config,
    i: usize,
    r: &'a RouteConfig,
    profile: Option<Profile>,
}

impl<'a> Builder<'a> {
    fn new(config: &'a Config, i: usize, r: &'a RouteConfig) -> Result<Builder<'a>, ConfigError> {
        let valid_name = !r.name.is_empty()
            && r.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !valid_name {
            return Err(config.invalid(
                format!("routes[{i}].name"),
                "must be non-empty letters, digits, - or _",
            ));
        }
        let mut b = Builder {
            config,
            i,
            r,
            profile: None,
        };
        b.profile = match &r.provider {
            Some(name) => Some(providers::lookup(name).ok_or_else(|| {
                b.invalid(
                    "provider",
                    format!(
                        "`{name}` is not a built-in profile; known: {}",
                        providers::names().join(", ")
                    ),
                )
            })?),
            None => None,
        };
        Ok(b)
    }

    fn invalid(&self, field: &str, message: String) -> ConfigError {
        self.config.invalid(
            format!("routes[{}] ({}).{field}", self.i, self.r.name),
            message,
        )
    }

    fn upstream(&self) -> Result<UpstreamBase, ConfigError> {
        let raw = &self.r.upstream;
        let uri: Uri = raw
            .parse()
            .map_err(|e| self.invalid("upstream", format!("`{raw}` is not a URL: {e}")))?;
        let scheme = match uri.scheme_str() {
            Some("https") => Scheme::HTTPS,
            Some("http") => Scheme::HTTP,
            _ => {
                return Err(self.invalid(
                    "upstream",
                    format!("`{raw}` must start with http:// or https://"),
                ))
            }
        };
        let authority: Authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| self.invalid("upstream", format!("`{raw}` has no host")))?;
        if uri.query().is_some() {
            return Err(self.invalid("upstream", "must not carry a query".into()));
        }
        Ok(UpstreamBase {
            scheme,
            host: authority.host().to_ascii_lowercase(),
            authority,
            base_path: uri.path().trim_end_matches('/').to_string(),
        })
    }

    /// The route's `connect_to`, else the upstream's own host and port.
    fn dial(&self, upstream: &(String, u16)) -> Result<(String, u16), ConfigError> {
        let Some(to) = &self.r.connect_to else {
            return Ok(upstream.clone());
        };
        split_host_port(to)
            .and_then(|(h, p)| Some((h, p?)))
            .ok_or_else(|| self.invalid("connect_to", format!("`{to}` is not a host:port")))
    }

    fn prefix(&self) -> Result<Option<String>, ConfigError> {
        match &self.r.prefix {
            Some(p) if !p.starts_with('/') || p.len() < 2 => Err(self.invalid(
                "prefix",
                format!("`{p}` must start with / and name a path, e.g. /stripe"),
            )),
            Some(p) => Ok(Some(p.trim_end_matches('/').to_string())),
            None => Ok(None),
        }
    }

    fn methods(&self) -> Result<Vec<Method>, ConfigError> {
        self.r
            .methods
            .iter()
            .map(|m| {
                Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                    .map_err(|_| self.invalid("methods", format!("`{m}` is not a method")))
            })
            .collect()
    }

    fn signing(&self) -> Signing {
        self.profile.as_ref().map(|p| p.signing).unwrap_or_default()
    }

    /// Where the provider takes its key, where the proxy may pass its own down (never into
    /// what a signature covers), and the provider's key limits.
    fn key_passing(&self) -> Result<(Option<KeyField>, Option<KeyField>, KeyLimits), ConfigError> {
        let r = self.r;
        let key_field = match (&r.forward_key_header, &r.forward_key_field) {
            (Some(h), Some(f)) if !h.is_empty() && !f.is_empty() => {
                return Err(self.invalid(
                    "forward_key_field",
                    "set either forward_key_header or forward_key_field, not both".into(),
                ))
            }
            (Some(h), _) if !h.is_empty() => {
                Some(KeyField::Header(self.header_name("forward_key_header", h)?))
            }
            (_, Some(f)) if !f.is_empty() => Some(KeyField::Body(f.clone())),
            (Some(_), _) | (_, Some(_)) => None,
            (None, None) => match &self.profile {
                Some(p) => p.key_field.clone(),
                None => Some(KeyField::Header(HeaderName::from_static("idempotency-key"))),
            },
        };
        let pass_key = match (&key_field, self.signing()) {
            (Some(KeyField::Header(_)), Signing::None | Signing::Body) => key_field.clone(),
            (Some(KeyField::Body(_)), Signing::None) => key_field.clone(),
            _ => None,
        };
        let base = self
            .profile
            .as_ref()
            .map(|p| p.limits.clone())
            .unwrap_or_else(default_limits);
        let limits = KeyLimits::new(
            r.forward_key_min_len.unwrap_or(base.min_len),
            r.forward_key_max_len.unwrap_or(base.max_len),
            r.forward_key_charset
                .as_deref()
                .unwrap_or(base.charset.spec()),
        )
        .map_err(|e| match e {
            LimitsError::Charset(m) => self.invalid("forward_key_charset", format!("charset {m}")),
            LimitsError::Length(m) => self.invalid("forward_key_max_len", m),
        })?;
        Ok((key_field, pass_key, limits))
    }

    fn header_name(&self, field: &str, name: &str) -> Result<HeaderName, ConfigError> {
        HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| self.invalid(field, format!("`{name}` is not a header name")))
    }

    /// How accounts and operations are told apart on this route.
    fn identity(&self, provider_key: Option<KeyField>) -> Result<RouteIdentity, ConfigError> {
        let r = self.r;
        let template = r
            .key
            .as_deref()
            .map(Template::parse)
            .transpose()
            .map_err(|m| self.invalid("key", format!("the key template cannot be used: {m}")))?;
        let operations = r
            .operations
            .iter()
            .enumerate()
            .map(|(j, o)| {
                Operation::parse(o.name.as_deref(), &o.matches, &o.key, o.missing_key)
                    .map_err(|(f, m)| self.invalid(&format!("operations[{j}].{f}"), m))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let key_source = match (r.key_source, &template) {
            (Some(KeySource::Template), None) => return Err(self.invalid(
                "key_source",
                "\"template\" needs a key template: set `key` (or use operations, which always derive)".into(),
            )),
            (Some(source), _) => source,
            (None, Some(_)) => KeySource::Template,
            (None, None) => self
                .profile
                .as_ref()
                .and_then(|p| p.key_source)
                .unwrap_or(KeySource::Client),
        };
        Ok(RouteIdentity {
            key_header: self.header_name("key_header", &r.key_header)?,
            key_source,
            template,
            operations,
            missing_key: r
                .missing_key
                .or(self.profile.as_ref().and_then(|p| p.missing_key))
                .unwrap_or_default(),
            account: self.account()?,
            volatile: self
                .profile
                .as_ref()
                .map(|p| p.volatile.iter().map(|v| v.to_string()).collect())
                .unwrap_or_default(),
            provider_key,
            signing: self.signing(),
            derivations: self.derivations(),
        })
    }

    /// The derivation `[identity]` names (checked when the file was read), and its window.
    fn derivations(&self) -> Derivations {
        let identity = &self.config.identity;
        Derivations::new(
            Derivation::from_number(identity.derivation).unwrap_or(Derivation::CURRENT),
            identity.fallback.0,
        )
    }

    /// The route's `account` template, else its `credential_headers`, else the profile's
    /// account parts, else every credential-looking header.
    fn account(&self) -> Result<AccountSpec, ConfigError> {
        match (&self.r.account, &self.r.credential_headers) {
            (Some(_), Some(_)) => Err(self.invalid(
                "account",
                "set either account or credential_headers, not both".into(),
            )),
            (Some(t), None) => Ok(AccountSpec::Template(Template::parse(t).map_err(|m| {
                self.invalid(
                    "account",
                    format!("the account template cannot be used: {m}"),
                )
            })?)),
            (None, Some(names)) => {
                let mut parts = vec![AccountPart::Headers(
                    names
                        .iter()
                        .map(|h| self.header_name("credential_headers", h))
                        .collect::<Result<Vec<_>, _>>()?,
                )];
                if self.profile.is_none() {
                    parts.push(AccountPart::Fields(self.credential_fields()?));
                }
                Ok(AccountSpec::Parts(parts))
            }
            (None, None) => Ok(AccountSpec::Parts(match &self.profile {
                Some(p) => p.account.clone(),
                None => vec![
                    AccountPart::CredentialLike,
                    AccountPart::Fields(self.credential_fields()?),
                ],
            })),
        }
    }

    /// The query and body fields a route without a profile reads as credentials.
    fn credential_fields(&self) -> Result<Vec<String>, ConfigError> {
        let fields: Vec<String> = match &self.r.credential_fields {
            Some(f) => f.clone(),
            None => CREDENTIAL_FIELDS.iter().map(|s| s.to_string()).collect(),
        };
        for (j, f) in fields.iter().enumerate() {
            if f.is_empty()
                || !f
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b))
            {
                return Err(self.invalid(
                    &format!("credential_fields[{j}]"),
                    format!("`{f}` is not a field name (letters, digits, _ and -)"),
                ));
            }
        }
        Ok(fields)
    }

    /// What becomes of a claim: statuses and rules, hold, lease and retention.
    fn policy(&self) -> Result<Policy, ConfigError> {
        let (r, profile) = (self.r, self.profile.as_ref());
        let commit = r.commit_statuses.clone().unwrap_or_else(|| {
            match profile.and_then(|p| p.commit_statuses) {
                Some(set) => set.iter().map(|s| s.to_string()).collect(),
                None => config::default_commit_statuses(),
            }
        });
        let declined = r
            .declined_statuses
            .clone()
            .unwrap_or_else(config::default_declined_statuses);
        let unknown_statuses = r.unknown_statuses.clone().unwrap_or_else(|| {
            match profile.and_then(|p| p.unknown_statuses) {
                Some(set) => set.to_vec(),
                None => config::default_unknown_statuses(),
            }
        });
        if let Some(bad) = unknown_statuses.iter().find(|s| !(100..=599).contains(*s)) {
            return Err(self.invalid("unknown_statuses", format!("{bad} is not a status code")));
        }
        Ok(Policy {
            honours_key: r
                .honours_key
                .or(profile.map(|p| p.honours_key))
                .unwrap_or(false),
            commit_statuses: StatusSet::parse(&commit)
                .map_err(|m| self.invalid("commit_statuses", m))?,
            declined_statuses: StatusSet::parse(&declined)
                .map_err(|m| self.invalid("declined_statuses", m))?,
            unknown_statuses,
            rules: Arc::from(self.rules()?),
            hold: r.hold.unwrap_or(match profile {
                Some(p) if p.hold_forever => Hold::Forever,
                _ => config::default_hold(),
            }),
            lease: r.lease.0,
            retention: r
                .retention
                .map(|d| d.0)
                .or(profile.and_then(|p| p.retention))
                .unwrap_or_else(config::default_retention),
            upstream_timeout: r.timeout.0,
            on_in_flight: r.on_in_flight,
            fail_open: r.fail_open,
            reconcile_after: None,
        })
    }

    /// `protocol = "mcp"` and `[routes.mcp]`.
    fn mcp(&self) -> Result<Option<McpRules>, ConfigError> {
        let r = self.r;
        if r.protocol != Protocol::Mcp {
            return match r.mcp {
                Some(_) => Err(self.invalid(
                    "mcp",
                    "is only read on a route with protocol = \"mcp\"".into(),
                )),
                None => Ok(None),
            };
        }
        let c = r.mcp.clone().unwrap_or_default();
        let window = c.window.map_or(DEFAULT_MCP_WINDOW, |d| d.0);
        if window.is_zero() {
            return Err(self.invalid("mcp.window", "must be longer than 0s".into()));
        }
        let answer_timeout = c
            .answer_timeout
            .map_or(crate::mcp::DEFAULT_ANSWER_TIMEOUT, |d| d.0);
        if answer_timeout.is_zero() {
            return Err(self.invalid("mcp.answer_timeout", "must be longer than 0s".into()));
        }
        let priced = self.r.spend.as_ref().and_then(|s| s.operations.as_ref());
        if let Some(tool) = c
            .read_only
            .iter()
            .find(|t| priced.is_some_and(|ops| ops.contains(t)))
        {
            return Err(self.invalid(
                "mcp.read_only",
                format!("{tool} is listed in read_only and priced by [routes.spend] operations: a priced tool is always claimed and capped; take it out of one of the two"),
            ));
        }
        let mut release_errors = std::collections::BTreeMap::new();
        for (tool, t) in &c.tools {
            if t.release_errors.is_empty() {
                continue;
            }
            let field = format!("mcp.tools.{tool}.release_errors");
            if c.read_only.contains(tool) {
                return Err(self.invalid(
                    &field,
                    "the tool is listed in read_only: its calls are never claimed, so nothing is kept to release".into(),
                ));
            }
            let mut patterns = Vec::new();
            for p in &t.release_errors {
                patterns.push(release_pattern(p).map_err(|e| self.invalid(&field, e))?);
            }
            release_errors.insert(tool.clone(), patterns);
        }
        let tools = c
            .tools
            .iter()
            .filter_map(|(tool, t)| t.key.clone().map(|k| (tool.clone(), k)))
            .collect();
        let refusals_as_results = match c.refusals.as_deref() {
            None | Some("error") => false,
            Some("result") => true,
            Some(other) => {
                return Err(
                    self.invalid("mcp.refusals", format!("`{other}` is not error or result"))
                )
            }
        };
        let mut rules = McpRules::new(window, c.read_only.clone(), c.trust_annotations, tools)
            .map_err(|(tool, e)| self.invalid(&format!("mcp.tools.{tool}.key"), e))?;
        rules.answer_timeout = answer_timeout;
        rules.release_errors = release_errors;
        rules.refusals_as_results = refusals_as_results;
        rules.allowed = self.allowed_names(&c)?;
        self.recorded(&c, &mut rules)?;
        Ok(Some(rules))
    }

    /// `[routes.mcp] allowed_hosts` and `allowed_origins`: each a name, never a pattern.
    fn allowed_names(
        &self,
        c: &config::McpConfig,
    ) -> Result<crate::mcp::origin::Allowed, ConfigError> {
        use crate::mcp::origin::{Allowed, AllowedError};
        Allowed::new(&c.allowed_hosts, &c.allowed_origins).map_err(|e| match e {
            AllowedError::Host(_) => self.invalid("mcp.allowed_hosts", e.to_string()),
            AllowedError::Origin(_) => self.invalid("mcp.allowed_origins", e.to_string()),
        })
    }

    /// `[routes.mcp.tools.<tool>]` `records` and `price_from`: each rule readable, and every
    /// `price_from` able to price something — its tool capped, its kind recorded by a tool.
    fn recorded(&self, c: &config::McpConfig, rules: &mut McpRules) -> Result<(), ConfigError> {
        use crate::mcp::recorded::{PriceFrom, Records};
        for (tool, t) in &c.tools {
            if let Some(r) = &t.records {
                if c.read_only.contains(tool) {
                    return Err(self.invalid(
                        &format!("mcp.tools.{tool}.records"),
                        format!("{tool} is listed in read_only: its calls are never claimed, so nothing would be recorded"),
                    ));
                }
                let records = Records::parse(&r.kind, &r.id, &r.amount, &r.currency, &r.unit)
                    .map_err(|(f, m)| self.invalid(&format!("mcp.tools.{tool}.records.{f}"), m))?;
                rules.records.insert(tool.clone(), records);
            }
        }
        for (tool, t) in &c.tools {
            let Some(p) = &t.price_from else {
                continue;
            };
            let field = format!("mcp.tools.{tool}.price_from");
            let from = PriceFrom::parse(&p.kind, &p.id, p.times.as_deref())
                .map_err(|(f, m)| self.invalid(&format!("{field}.{f}"), m))?;
            let capped = self
                .r
                .spend
                .as_ref()
                .and_then(|s| s.operations.as_ref())
                .is_some_and(|ops| ops.iter().any(|o| o == tool));
            if !capped {
                return Err(self.invalid(
                    &field,
                    format!("prices {tool} for the route's spend caps, but [routes.spend] operations does not list it: add \"{tool}\" there"),
                ));
            }
            if !rules.records.values().any(|r| r.kind == from.kind) {
                return Err(self.invalid(
                    &format!("{field}.kind"),
                    format!("no tool of this route records a `{kind}`: give the tool that creates one `records = {{ kind = \"{kind}\", id = \"{{result.id}}\", … }}`", kind = from.kind),
                ));
            }
            rules.price_from.insert(tool.clone(), from);
        }
        Ok(())
    }

    /// `[routes.spend]`, with the profile's defaults for what costs money and where the
    /// amount is.
    fn spend(&self) -> Result<Option<RouteSpend>, ConfigError> {
        let Some(c) = &self.r.spend else {
            return Ok(None);
        };
        let defaults = self.profile.as_ref().and_then(|p| p.spend);
        let missing = |f: &str| {
            self.invalid(
                &format!("spend.{f}"),
                "needed: this route's provider has no default for it".into(),
            )
        };
        let mcp = self.r.protocol == Protocol::Mcp;
        // On an MCP route `{args.NAME}` is the tool call's argument NAME.
        let args = |t: &str| {
            if mcp {
                t.replace("{args.", "{body.params.arguments.")
            } else {
                t.to_string()
            }
        };
        // A section with only count caps counts executions: it needs no amount.
        let x402 = self.r.payments.as_ref().is_some_and(|p| p.x402);
        let amount: Vec<String> = match (&c.amount, defaults) {
            // An x402 route prices from the signed payment (`proxy::purchase`); this stands
            // for it in the budget and is never read.
            (None, _) if x402 => vec!["{body.amount}".to_string()],
            (Some(a), _) => a.iter().map(|t| args(t)).collect(),
            (None, Some(d)) => d.amount.iter().map(|s| s.to_string()).collect(),
            (None, None) => Vec::new(),
        };
        let priced = !amount.is_empty();
        let currency = c
            .currency
            .as_deref()
            .map(args)
            .or_else(|| x402.then(|| c.caps_currency.clone()))
            .or_else(|| defaults.map(|d| d.currency.to_string()))
            .or_else(|| (!priced).then(|| c.caps_currency.clone()))
            .ok_or_else(|| missing("currency"))?;
        let unit = c
            .unit
            .clone()
            .or_else(|| x402.then(|| "minor".to_string()))
            .or_else(|| defaults.map(|d| d.unit.to_string()))
            .or_else(|| (!priced).then(|| "minor".to_string()))
            .ok_or_else(|| missing("unit"))?;
        let on_unpriced = match c.unpriced.as_deref() {
            None | Some("refuse") => OnUnpriced::Refuse,
            Some("approve") => OnUnpriced::Approve,
            Some(other) => {
                return Err(self.invalid(
                    "spend.unpriced",
                    format!("`{other}` is not refuse or approve"),
                ))
            }
        };
        let mut exponents: Vec<(&str, u32)> =
            defaults.map(|d| d.exponents.to_vec()).unwrap_or_default();
        for (code, places) in &c.exponents {
            if *places > 4 {
                return Err(self.invalid(
                    &format!("spend.exponents.{code}"),
                    format!("{places} decimal places: no currency has more than 4"),
                ));
            }
            exponents.push((code.as_str(), *places));
        }
        let tool_counts = self.tool_counts(c)?;
        let mut budget = Budget::parse(&BudgetText {
            amount: &amount,
            currency: &currency,
            unit: &unit,
            caps_currency: &c.caps_currency,
            rates: &c.rates,
            per_request: c.per_request.as_deref(),
            per_run: c.per_run.as_deref(),
            per_tenant: c.per_tenant.as_deref(),
            per_route: c.per_route.as_deref(),
            count_per_run: c.count_per_run,
            count_per_tenant: c.count_per_tenant,
            count_per_route: c.count_per_route,
            tenant_window: &c.tenant_window,
            run_window: &c.run_window,
            route_window: &c.route_window,
            time_zone: c.time_zone.as_deref(),
            approve_above: c.approve_above.as_deref(),
            approve_run_above: c.approve_run_above.as_deref(),
            approve_tenant_above: c.approve_tenant_above.as_deref(),
            approval_wait: c.approval_wait.0,
            approval_expires: c.approval_expires.0,
            exponents: &exponents,
            on_unpriced,
            tool_counts: &tool_counts,
        })
        .map_err(|(f, m)| self.invalid(&format!("spend.{f}"), m))?;
        let (on, priced_elsewhere) = self.spend_operations(c, defaults, &mut budget)?;
        let run_from = c
            .run_from
            .iter()
            .enumerate()
            .map(|(j, s)| {
                run_source(s).map_err(|m| self.invalid(&format!("spend.run_from[{j}]"), m))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let derive: Vec<String> = match (&c.derive_without_key, defaults) {
            (Some(d), _) => d.clone(),
            // Steps of counted objects and unpriced requests name no amount a duplicate
            // could be told apart by: identified by the whole request like a charge (and
            // then refused, parked, or free as their row says).
            (None, Some(d)) => d
                .derive_without_key
                .iter()
                .map(|s| s.to_string())
                .chain(priced_elsewhere)
                .collect(),
            (None, None) => Vec::new(),
        };
        let derive_without_key = derive
            .iter()
            .enumerate()
            .map(|(j, o)| {
                Pattern::parse(o)
                    .map_err(|m| self.invalid(&format!("spend.derive_without_key[{j}]"), m))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Some(RouteSpend {
            on,
            budget,
            run_from,
            enforce: c.enforce,
            derive_without_key,
            descriptive: c.descriptive.clone(),
        }))
    }

    /// `[routes.payments]`: the x402 rules of a route that enables it.
    fn payments(&self) -> Result<Option<X402Rules>, ConfigError> {
        let Some(c) = self.r.payments.as_ref().filter(|c| c.x402) else {
            return Ok(None);
        };
        if c.networks.is_empty() {
            return Err(self.invalid(
                "payments.networks",
                "needed with x402 = true: the CAIP-2 networks a payment may be on, e.g. [\"eip155:8453\"]".into(),
            ));
        }
        if self.r.protocol == Protocol::Mcp {
            return Err(self.invalid(
                "payments.x402",
                "is read on HTTP routes; payments inside MCP tool calls are not read yet".into(),
            ));
        }
        let mut assets = Vec::new();
        for (j, a) in c.assets.iter().enumerate() {
            let field = |f: &str| format!("payments.assets[{j}].{f}");
            let currency = Currency::parse(&a.currency)
                .map_err(|e| self.invalid(&field("currency"), e.to_string()))?;
            if a.decimals > 30 {
                return Err(self.invalid(
                    &field("decimals"),
                    format!("{}: no token has more than 30 decimals", a.decimals),
                ));
            }
            if !c.networks.contains(&a.network) {
                return Err(self.invalid(
                    &field("network"),
                    format!("`{}` is not in payments.networks", a.network),
                ));
            }
            assets.push(Asset {
                network: a.network.clone(),
                asset: a.asset.to_ascii_lowercase(),
                currency,
                decimals: a.decimals,
            });
        }
        if self.r.spend.is_some() && assets.is_empty() {
            return Err(self.invalid(
                "payments.assets",
                "needed on a capped route: a payment in an asset without a row cannot be priced"
                    .into(),
            ));
        }
        Ok(Some(X402Rules {
            networks: c.networks.clone(),
            assets,
        }))
    }

    /// `[routes.spend.tools.NAME]`: count caps of one tool, on an MCP route, of a tool the
    /// section gates (else they would count nothing).
    fn tool_counts(
        &self,
        c: &crate::config::SpendConfig,
    ) -> Result<BTreeMap<String, ToolCounts>, ConfigError> {
        let mut out = BTreeMap::new();
        for (tool, t) in &c.tools {
            let field = format!("spend.tools.{tool}");
            if self.r.protocol != Protocol::Mcp {
                return Err(self.invalid(
                    &field,
                    "is only read on a route with protocol = \"mcp\" (count caps of one tool)"
                        .into(),
                ));
            }
            let gated = c
                .operations
                .iter()
                .flatten()
                .chain(&c.unpriced_operations)
                .any(|o| o == tool);
            if !gated {
                return Err(self.invalid(
                    &field,
                    format!("`{tool}` is in neither spend.operations nor spend.unpriced_operations: its calls are not gated, so nothing would count them"),
                ));
            }
            let counts = ToolCounts {
                per_run: t.count_per_run,
                per_tenant: t.count_per_tenant,
                per_route: t.count_per_route,
            };
            if counts == ToolCounts::default() {
                return Err(self.invalid(
                    &field,
                    "names no cap: set count_per_run, count_per_tenant or count_per_route".into(),
                ));
            }
            out.insert(tool.clone(), counts);
        }
        Ok(out)
    }

    /// The requests that cost money: the route's own `operations` (priced by its `amount`),
    /// else its profile's catalogue, each row priced as it says. Also the rows not priced
    /// from the body (steps of counted objects, unpriced requests).
    fn spend_operations(
        &self,
        c: &crate::config::SpendConfig,
        defaults: Option<SpendDefaults>,
        budget: &mut Budget,
    ) -> Result<(Vec<PricedOperation>, Vec<String>), ConfigError> {
        let parse = |j: usize, o: &str| {
            Pattern::parse(o).map_err(|m| self.invalid(&format!("spend.operations[{j}]"), m))
        };
        let mcp = self.r.protocol == Protocol::Mcp;
        if mcp && c.operations.is_none() {
            return Err(self.invalid(
                "spend.operations",
                "needed on an MCP route: the tools that move money, e.g. [\"create_refund\"]"
                    .into(),
            ));
        }
        // Listed first: the first row an operation matches prices it.
        let mut never_priced = Vec::new();
        for (j, o) in c.unpriced_operations.iter().enumerate() {
            let field = format!("spend.unpriced_operations[{j}]");
            let (op, why) = if mcp {
                let op = tool_operation(o).map_err(|m| self.invalid(&field, m))?;
                (
                    op,
                    format!("the tool {o} moves money and its arguments say no amount"),
                )
            } else {
                (
                    o.clone(),
                    format!("{o} moves money and the request says no amount"),
                )
            };
            if c.operations.iter().flatten().any(|p| p == o) {
                return Err(self.invalid(
                    &field,
                    format!("`{o}` is in spend.operations too: name it in one of the two"),
                ));
            }
            never_priced.push(PricedOperation {
                pattern: Pattern::parse(&op).map_err(|m| self.invalid(&field, m))?,
                pricing: Pricing::Unpriced(why),
                records: None,
            });
        }
        // Without a key, identified by the whole request like a charge (REST rows).
        let unpriced_names = c.unpriced_operations.clone();
        if let Some(ops) = &c.operations {
            let on = never_priced
                .into_iter()
                .map(Ok)
                .chain(ops.iter().enumerate().map(|(j, named)| {
                    let o = if mcp {
                        tool_operation(named)
                            .map_err(|m| self.invalid(&format!("spend.operations[{j}]"), m))?
                    } else {
                        named.clone()
                    };
                    // A tool priced from a recorded object reads no amount of its own.
                    let recorded = mcp
                        .then_some(self.r.mcp.as_ref())
                        .flatten()
                        .and_then(|m| m.tools.get(named.as_str()))
                        .and_then(|t| t.price_from.as_ref());
                    Ok(PricedOperation {
                        pattern: parse(j, &o)?,
                        pricing: match recorded {
                            Some(p) => Pricing::Recorded {
                                kind: p.kind.clone(),
                            },
                            None => Pricing::Amount(0),
                        },
                        records: None,
                    })
                }))
                .collect::<Result<Vec<_>, ConfigError>>()?;
            return Ok((on, Vec::new()));
        }
        // An x402 route caps every purchase, whatever its path (`proxy::pipeline`).
        if self.r.payments.as_ref().is_some_and(|p| p.x402) && defaults.is_none() {
            return Ok((never_priced, Vec::new()));
        }
        let Some(d) = defaults else {
            return Err(self.invalid(
                "spend.operations",
                "needed: this route's provider has no default for it".into(),
            ));
        };
        let mut on = never_priced;
        let mut elsewhere = unpriced_names;
        for (j, row) in d.rows.iter().enumerate() {
            let pricing = match row.price {
                RowPrice::Body => Pricing::Amount(0),
                RowPrice::Fields(amount, currency, unit) => {
                    let amount: Vec<String> = amount.iter().map(|s| s.to_string()).collect();
                    let i = budget
                        .add_amount(&amount, currency, unit)
                        .map_err(|(f, m)| self.invalid(&format!("spend.{f}"), m))?;
                    Pricing::Amount(i)
                }
                RowPrice::Counted(kind, id_segment) => Pricing::Counted { kind, id_segment },
                RowPrice::UnpricedIf(fields, why) => Pricing::UnpricedIf {
                    fields: fields.iter().map(|s| s.to_string()).collect(),
                    why: why.to_string(),
                },
                RowPrice::Unpriced(why) => Pricing::Unpriced(why.to_string()),
            };
            if !matches!(pricing, Pricing::Amount(_)) {
                elsewhere.push(row.op.to_string());
            }
            on.push(PricedOperation {
                pattern: parse(j, row.op)?,
                pricing,
                records: row.records,
            });
        }
        Ok((on, elsewhere))
    }

    /// The route's own lookup, else the profile's.
    fn lookup(&self) -> Result<Option<Lookup>, ConfigError> {
        let config = self
            .r
            .lookup
            .clone()
            .or_else(|| self.profile.as_ref().and_then(|p| p.lookup.clone()));
        config
            .map(|c| {
                if self.signing().body_signed() {
                    return Err(self.invalid(
                        "lookup",
                        "this provider signs its requests: the proxy cannot sign a lookup of its own"
                            .into(),
                    ));
                }
                Lookup::parse(&c).map_err(|(f, m)| self.invalid(&format!("lookup.{f}"), m))
            })
            .transpose()
    }

    /// The route's own body rules, its `duplicate` answer, then the profile's rules.
    fn rules(&self) -> Result<Vec<BodyRule>, ConfigError> {
        let mut rules = self
            .r
            .outcome_rules
            .iter()
            .enumerate()
            .map(|(j, rule)| {
                outcome_rule(rule).map_err(|m| self.invalid(&format!("outcome_rules[{j}]"), m))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(d) = &self.r.duplicate {
            let hint = if d.lookup_hint.is_empty() {
                String::new()
            } else {
                format!(". Look it up with {}", d.lookup_hint)
            };
            rules.push(BodyRule {
                statuses: Some(
                    StatusSet::parse(&[d.status.to_string()])
                        .map_err(|m| self.invalid("duplicate.status", m))?,
                ),
                conditions: vec![Condition::new("code", Test::Equals(vec![d.code.clone()]))],
                outcome: RuleOutcome::Duplicate,
                note: format!(
                    "it already has an operation with the key passed down (code {}){hint}",
                    d.code
                ),
            });
        }
        if let Some(p) = &self.profile {
            rules.extend(p.rules.iter().cloned());
        }
        Ok(rules)
    }

    fn dedup_window(&self) -> Duration {
        self.r
            .dedup_window
            .map(|d| d.0)
            .or(self.profile.as_ref().and_then(|p| p.dedup_window))
            .unwrap_or_else(config::default_dedup_window)
    }

    fn check_durations(&self, policy: &Policy, dedup_window: Duration) -> Result<(), ConfigError> {
        let r = self.r;
        for (f, d) in [
            ("lease", r.lease.0),
            ("retention", policy.retention),
            ("connect_timeout", r.connect_timeout.0),
            ("timeout", r.timeout.0),
            ("dedup_window", dedup_window),
            ("wait_timeout", r.wait_timeout.0),
        ] {
            if d.is_zero() {
                return Err(self.invalid(f, "must be greater than 0".into()));
            }
        }
        if r.lease.0 < Duration::from_secs(1) {
            return Err(self.invalid(
                "lease",
                "must be at least 1s: it is renewed every third of it".into(),
            ));
        }
        // A renewal lands at most a third of the lease plus one store timeout after the last;
        // any shorter lease lapses under a live holder whenever the store is merely slow.
        let op_timeout = self.config.store.op_timeout.0;
        if r.lease.0.as_secs_f64() <= 1.5 * op_timeout.as_secs_f64() {
            return Err(self.invalid(
                "lease",
                format!(
                    "must be longer than 1.5 × store.op_timeout ({}), or a slow store lets a live claim lapse",
                    humantime::format_duration(op_timeout)
                ),
            ));
        }
        Ok(())
    }

    /// The route's own pooled client: its `connect_to` and extra roots.
    fn client(&self) -> Result<UpstreamClient, ConfigError> {
        let r = self.r;
        if let Some(path) = &r.upstream_ca {
            if !path.is_file() {
                return Err(
                    self.invalid("upstream_ca", format!("{} does not exist", path.display()))
                );
            }
        }
        UpstreamClient::new(&ClientOptions {
            extra_roots: r.upstream_ca.as_deref(),
            connect_to: r.connect_to.as_deref(),
            connect_timeout: r.connect_timeout.0,
            pool_idle_timeout: self.config.server.pool_idle_timeout.0,
            egress: None,
        })
        .map_err(|e| match e {
            ClientBuildError::ConnectTo(_) => self.invalid("connect_to", e.to_string()),
            ClientBuildError::Roots(_) | ClientBuildError::Tls(_) => {
                self.invalid("upstream_ca", e.to_string())
            }
        })
    }
}

/// A configured body rule: one condition (`equals`, `not_equals`, `prefix` or `non_empty`).
fn outcome_rule(r: &OutcomeRuleConfig) -> Result<BodyRule, String> {
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

fn run_source(s: &str) -> Result<RunSource, String> {
    match s.split_once(':') {
        None if s == "proxy-user" => Ok(RunSource::ProxyUser),
        Some(("header", name)) => HeaderName::from_bytes(name.trim().as_bytes())
            .map(RunSource::Header)
            .map_err(|_| format!("`{name}` is not a header name")),
        _ => Err(format!(
            "`{s}` is not a run source: proxy-user or header:NAME"
        )),
    }
}

/// An MCP route's capped tool, as the pattern its calls are matched by (`POST /TOOL`: the
/// proxy asks `covers(POST, "/TOOL")` for a tool call).
fn tool_operation(tool: &str) -> Result<String, String> {
    let ok = !tool.is_empty()
        && tool.len() <= 128
        && tool
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
    if !ok {
        return Err(format!(
            "`{tool}`: on an MCP route, name a tool (letters, digits, '_', '-', '.'), e.g. \"create_refund\""
        ));
    }
    Ok(format!("POST /{tool}"))
}
