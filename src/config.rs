//! The TOML configuration: parsed once, validated once, turned into typed routes.
//!
//! Every timeout, limit and TTL is a named field with a default, so a config file only
//! says what differs from a sane production setup.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer};

pub use crate::idempotency::policy::{Hold, OnInFlight};
pub use crate::identity::{KeySource, MissingKey, DEFAULT_TENANT};

/// A config problem, always naming the file and the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: cannot read: {error}")]
    Read {
        file: PathBuf,
        // Not `source`: the message says it already, and a source is printed again.
        error: std::io::Error,
    },
    #[error("{file}: {message}")]
    Parse { file: PathBuf, message: String },
    #[error("{file}: {field}: {message}")]
    Invalid {
        file: PathBuf,
        field: String,
        message: String,
    },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub server: ServerConfig,
    #[serde(default)]
    pub store: StoreConfig,
    #[serde(default)]
    pub tls: TlsConfig,
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    #[serde(default)]
    pub admin: AdminConfig,
    /// Who may use the proxy (`Proxy-Authorization`); none: everyone, as tenant `default`.
    #[serde(default)]
    pub tenants: Vec<TenantConfig>,
    #[serde(default)]
    pub egress: EgressConfig,
    #[serde(default)]
    pub encryption: EncryptionConfig,
    #[serde(default)]
    pub approvals: ApprovalsConfig,
    #[serde(default)]
    pub identity: IdentityConfig,
    /// Where the file was read from, for messages that name it.
    #[serde(skip)]
    pub source: PathBuf,
    /// Where its `*_env` settings are read: the process's environment.
    #[serde(skip)]
    pub env: Environment,
}

/// The environment variables a config's `*_env` settings name (tokens, secrets, keys): the
/// process's, with any set over them for one proxy alone (a proxy run inside a test
/// process, where the process's environment is every test's).
#[derive(Clone, Default)]
pub struct Environment {
    set: std::sync::Arc<std::collections::BTreeMap<String, String>>,
}

impl Environment {
    /// The process's environment with `vars` set over it.
    pub fn with(vars: impl IntoIterator<Item = (String, String)>) -> Environment {
        Environment {
            set: std::sync::Arc::new(vars.into_iter().collect()),
        }
    }

    pub fn var(&self, name: &str) -> Option<String> {
        match self.set.get(name) {
            Some(v) => Some(v.clone()),
            None => std::env::var(name).ok(),
        }
    }
}

impl std::fmt::Debug for Environment {
    /// Names only: the values are secrets.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.set.keys()).finish()
    }
}

/// `[identity]`: which derivation of scopes, accounts and fingerprints to claim under, and for
/// how long to look under the other one (docs/operations.md, "Upgrading").
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IdentityConfig {
    /// 1 derives as the release before this one did (the first step of a rolling upgrade);
    /// 2, the default, is this release's.
    pub derivation: u8,
    /// How long after start a request whose scope the other derivation computes differently
    /// also looks there; `"0s"` never does.
    pub fallback: Dur,
}

impl Default for IdentityConfig {
    fn default() -> Self {
        Self {
            derivation: crate::identity::derivation::Derivation::CURRENT.number(),
            fallback: Dur(crate::identity::derivation::DEFAULT_WINDOW),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Environment variable holding the key API's bearer token (one token, named `admin`,
    /// with the operator role).
    pub token_env: String,
    /// Or: hex SHA-256 of the token, so the config file holds no secret.
    pub token_sha256: Option<String>,
    /// Most records one list (and the `unknown_claims` gauge) looks at.
    pub list_limit: usize,
    /// Named tokens, each with a role: who may look, approve, or resolve (console and API).
    pub tokens: Vec<AdminTokenConfig>,
    /// Environment variable holding the key that signs console sessions (at least 32 bytes,
    /// as 64 hex digits or base64). Give every replica the same key so a session works on
    /// all of them; without one each process makes its own and sessions stay on it.
    pub session_key_env: Option<String>,
    /// Or: a file holding that key.
    pub session_key_file: Option<PathBuf>,
    /// How long a console login lasts.
    pub session_ttl: Dur,
    /// Failed console logins one client address may make per minute before it waits.
    pub login_attempts_per_minute: u32,
    /// Approvals above one of these amounts (`"1000.00 USD"`) need two different
    /// approvers; an approval in a currency not listed needs two as soon as the list is
    /// non-empty.
    pub four_eyes_above: Vec<String>,
    /// PEM certificate (chain) and key: the admin listener speaks HTTPS.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// The console is reached over HTTPS through something that terminates TLS in front of
    /// the admin listener: session cookies are marked `Secure` (they always are when the
    /// listener has `tls_cert`).
    pub behind_tls: bool,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            token_env: "IDEMPROXY_ADMIN_TOKEN".into(),
            token_sha256: None,
            list_limit: 1000,
            tokens: Vec::new(),
            session_key_env: None,
            session_key_file: None,
            session_ttl: Dur(Duration::from_secs(8 * 3600)),
            login_attempts_per_minute: 10,
            four_eyes_above: Vec::new(),
            tls_cert: None,
            tls_key: None,
            behind_tls: false,
        }
    }
}

/// One named admin token (`[[admin.tokens]]`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminTokenConfig {
    /// Who holds it: recorded with every decision made with it.
    pub name: String,
    /// `viewer` (looks), `approver` (also approves and denies), `operator` (also resolves
    /// held outcomes, reloads, freezes).
    pub role: String,
    /// Hex SHA-256 of the token …
    pub sha256: Option<String>,
    /// … or the environment variable holding it.
    pub env: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// Letters, digits, `-`, `_`; part of every store key of this tenant. The Basic user name.
    pub name: String,
    /// Hex SHA-256 of the tenant's secret (`printf %s "$SECRET" | sha256sum`).
    pub secret_sha256: Option<String>,
    /// Or: the environment variable holding the secret itself.
    pub secret_env: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EgressConfig {
    /// Hosts (`name`, `name:port`), addresses and CIDR blocks (`10.1.0.0/16`) that may be
    /// reached even when they are internal.
    pub allow: Vec<String>,
    /// Refuse every destination `allow` does not name.
    pub only_allowed: bool,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EncryptionConfig {
    /// Environment variable holding the 32-byte key as 64 hex digits or base64.
    pub key_env: Option<String>,
    /// File holding the key (32 raw bytes, 64 hex digits or base64).
    pub key_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub listen: String,
    pub admin_listen: Option<String>,
    /// Time a client has to send a full request head (slowloris guard).
    pub header_read_timeout: Dur,
    /// Largest request body a protected request may carry; it is buffered to fingerprint it.
    pub max_body_bytes: usize,
    /// Largest provider response the proxy keeps as a receipt.
    pub max_receipt_bytes: usize,
    /// Time in-flight requests get to settle after SIGTERM.
    pub shutdown_grace: Dur,
    /// Idle keep-alive connections to upstreams are closed after this; keep it below the
    /// providers' own keep-alive so a pooled POST never races a server-side close.
    pub pool_idle_timeout: Dur,
    /// Open client connections beyond this are answered 503 and closed.
    pub max_connections: usize,
    /// Largest request head (request line and headers); larger ones get 431.
    pub max_header_bytes: usize,
    /// Memory for receipts this proxy has replayed, so further replays skip the store; 0 = off.
    pub receipt_cache_bytes: u64,
    /// Threads that run requests; 0 = one per CPU the process may use. With one, the
    /// single-threaded scheduler runs everything on the main thread.
    pub worker_threads: usize,
    /// Protected requests being forwarded at once (including those whose client went away);
    /// beyond it a new one is refused with 503 before anything is claimed.
    pub max_forwards: usize,
    /// Request bodies buffered for protected requests at once, in bytes; beyond it a new
    /// one is refused with 503 before anything is claimed.
    pub max_forward_bytes: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            admin_listen: None,
            header_read_timeout: Dur(Duration::from_secs(30)),
            max_body_bytes: 4 * 1024 * 1024,
            max_receipt_bytes: 8 * 1024 * 1024,
            shutdown_grace: Dur(Duration::from_secs(10)),
            pool_idle_timeout: Dur(Duration::from_secs(30)),
            max_connections: 4096,
            max_header_bytes: 64 * 1024,
            receipt_cache_bytes: 16 * 1024 * 1024,
            worker_threads: 0,
            max_forwards: 1024,
            max_forward_bytes: 256 * 1024 * 1024,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// `sqlite://PATH` (embedded, default), `postgres://USER@HOST:PORT/DB`,
    /// `redis://HOST:PORT[/DB]`, `rediss://…` (TLS), `redis+sentinel://HOST:PORT,…/MASTER[/DB]`
    /// or `redis+cluster://HOST:PORT,…` (see docs/stores.md).
    pub url: String,
    /// Prefix of every store key, so several deployments can share one Redis.
    pub namespace: String,
    /// Every store call gives up after this and the request is answered 503.
    pub op_timeout: Dur,
    /// SQLite `synchronous`: `full` (a power loss loses nothing acknowledged) or `normal`
    /// (a power loss may lose the last transactions; a process crash loses nothing).
    pub sqlite_synchronous: String,
    /// SQLite: write records compact (JSON and response body deflated; about half the disk,
    /// and ~3x the CPU of a new key: deflate's state is set up per record). Off by default.
    /// Every version since reads both forms; the release before reads only uncompressed
    /// records, so leave it off while a proxy of that release shares the file (docs/stores.md).
    pub sqlite_compress: bool,
    /// PEM file of the CA that signs the store's server certificate (`rediss://…`, and
    /// `postgres://…` with `sslmode=verify-ca|verify-full`). Default: the system's roots.
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate (chain) for mutual TLS with the store; with `tls_key`.
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// PostgreSQL: most connections one proxy opens (claims, settles and reads share them).
    pub pool_size: usize,
    /// PostgreSQL: how often expired rows are deleted (in batches, never blocking claims).
    pub sweep_interval: Dur,
    /// Redis (plain, TLS, Sentinel, Cluster): a claim or settle is acknowledged only once this
    /// many replicas have it (`WAIT`), so a failover cannot lose it. 0 = off (the default):
    /// replication is asynchronous and a failover may lose the last acknowledged writes.
    pub redis_wait_replicas: u32,
    /// How long `WAIT` waits for those replicas; short of them, the operation fails (503).
    pub redis_wait_timeout: Dur,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            url: "sqlite://data/idemproxy.db".into(),
            namespace: "idem".into(),
            op_timeout: Dur(Duration::from_secs(2)),
            sqlite_synchronous: "full".into(),
            sqlite_compress: false,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            pool_size: 16,
            sweep_interval: Dur(Duration::from_secs(60)),
            redis_wait_replicas: 0,
            redis_wait_timeout: Dur(Duration::from_millis(200)),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// The proxy's CA (`idemproxy ca init`); needed to intercept CONNECT to routed hosts.
    pub ca_cert: Option<PathBuf>,
    pub ca_key: Option<PathBuf>,
    /// What CONNECT to a host no route covers gets: a blind tunnel, or 403. Default: 403
    /// when any route has `[routes.spend]` (see [`Config::unknown_hosts`]), else a tunnel.
    pub unknown_hosts: Option<UnknownHosts>,
    /// Host names (`api.openai.com`, or `*.openai.com` for every name below it) that get a
    /// blind tunnel although `unknown_hosts` is `deny`: the worker's LLM API and the like.
    pub tunnel_hosts: Vec<String>,
    /// Setting `unknown_hosts = "tunnel"` on a config where a route caps spend says that an
    /// agent may reach any host past the proxy's checks; this says it was meant.
    pub tunnel_with_spend: bool,
    /// How long a tunnel waits for the client's first bytes (its ClientHello) before it
    /// takes the server to be the one that speaks first (SMTP, SSH) and splices.
    pub peek_timeout: Dur,
    /// Ports CONNECT may reach (intercepted or tunnelled); any other port is a 403.
    pub connect_ports: Vec<u16>,
    /// Ports whose protocol has the server speak first (SMTP's 25 and 587, SSH's 22). Where a
    /// route caps spend, a tunnel whose client stays silent past `peek_timeout` is refused
    /// unless its port is listed here; on a listed port the server's bytes flow and the
    /// client's first bytes are still judged before any is forwarded.
    pub server_first_ports: Vec<u16>,
    /// A blind tunnel with no byte in either direction for this long is closed, so tunnels
    /// whose client vanished without a FIN do not pile up.
    pub tunnel_idle_timeout: Dur,
}

impl Default for TlsConfig {
    fn default() -> Self {
        Self {
            ca_cert: None,
            ca_key: None,
            unknown_hosts: None,
            tunnel_hosts: Vec::new(),
            tunnel_with_spend: false,
            peek_timeout: Dur(Duration::from_secs(1)),
            connect_ports: vec![443],
            server_first_ports: Vec::new(),
            tunnel_idle_timeout: Dur(Duration::from_secs(600)),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnknownHosts {
    /// Copy bytes both ways untouched (the worker's other HTTPS keeps working).
    Tunnel,
    /// Answer 403.
    Deny,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub name: String,
    /// Host (optionally `host:port`) matched by the forward proxy and HTTPS interception.
    /// Defaults to the upstream's host.
    pub host: Option<String>,
    /// Base-URL prefix, e.g. `/stripe`; requests under it go to `upstream`.
    pub prefix: Option<String>,
    pub upstream: String,
    /// Extra PEM roots trusted for this upstream (on top of the web PKI roots).
    pub upstream_ca: Option<PathBuf>,
    /// Dial this `host:port` instead of the upstream's (TLS still verifies the upstream name).
    pub connect_to: Option<String>,
    /// Built-in provider profile: sets how the key is passed down, the provider's key
    /// limits, `honours_key`, `commit_statuses`, `hold` and duplicate rejections.
    pub provider: Option<String>,
    pub honours_key: Option<bool>,
    /// Header the key is passed down in; empty for none.
    pub forward_key_header: Option<String>,
    /// Top-level JSON body field the key is passed down in, instead of a header.
    pub forward_key_field: Option<String>,
    /// The provider's key limits; a key outside them is passed down in a derived form.
    pub forward_key_min_len: Option<usize>,
    pub forward_key_max_len: Option<usize>,
    /// Characters the provider accepts in a key, like a regex class body: `A-Za-z0-9 _-`.
    pub forward_key_charset: Option<String>,
    /// Template naming the operation a request performs, e.g.
    /// `payment:{body.metadata.invoice_id}:{body.amount|decimal:2}`.
    pub key: Option<String>,
    /// Where the identity comes from: `client`, `template` (default when `key` is set) or
    /// `request`. Default without `key`: the profile's, else `client`.
    pub key_source: Option<KeySource>,
    /// Templates for single endpoints of the route (`match = "POST /v1/refunds"`); the first
    /// that matches a request names its operation, before the route's own `key`.
    #[serde(default)]
    pub operations: Vec<OperationConfig>,
    /// With `key_source = "request"` or `missing_key = "derive"`: how long identical requests
    /// count as one. Default: the profile's, else 10 minutes.
    pub dedup_window: Option<Dur>,
    /// Template naming the provider account a request acts for, instead of hashing its
    /// credentials: `{tenant}`, `{header.x-account}`, `{bearer.sub}`. For credentials that
    /// change between attempts of one operation (refreshed OAuth tokens, temporary keys).
    pub account: Option<String>,
    /// A provider answer meaning "this key was already used", which is never a receipt.
    pub duplicate: Option<DuplicateConfig>,
    /// Header the client sends its key in.
    #[serde(default = "default_key_header")]
    pub key_header: String,
    /// Methods this route protects; others pass through untouched.
    #[serde(default = "default_methods")]
    pub methods: Vec<String>,
    /// A request without a key: `forward` (unprotected), `reject` (400) or `derive` (the
    /// whole request within `dedup_window`). Default: the profile's, else `forward`.
    pub missing_key: Option<MissingKey>,
    #[serde(default)]
    pub on_in_flight: OnInFlight,
    /// With `on_in_flight = "wait"`: how long a duplicate waits for the first to settle
    /// before it gets 409.
    #[serde(default = "default_wait_timeout")]
    pub wait_timeout: Dur,
    /// Statuses that become the receipt. Entries: `2xx`, `404`, `!409` (exclude).
    /// Default: the profile's, else `default_commit_statuses()`.
    pub commit_statuses: Option<Vec<String>>,
    /// Statuses that leave the outcome UNKNOWN on a provider that does not honour keys.
    pub unknown_statuses: Option<Vec<u16>>,
    /// Committed statuses that say nothing happened (a decline, a validation error): an
    /// identical retry replays them, but a corrected request for the same derived operation
    /// executes as a new attempt. Default: the profile's, else 4xx except 408, 409, 425, 429.
    pub declined_statuses: Option<Vec<String>>,
    /// Outcomes read from the response body, checked before the status rules (providers that
    /// answer failures with HTTP 200). The profile's rules come after these.
    #[serde(default)]
    pub outcome_rules: Vec<OutcomeRuleConfig>,
    /// How to ask the provider whether a held operation happened. Default: the profile's.
    pub lookup: Option<LookupConfig>,
    /// Spend caps and approvals for the requests that move money.
    pub spend: Option<SpendConfig>,
    /// Payments agents make per request on this route (`x402 = true`): recognised, priced
    /// from what is signed, capped by `[routes.spend]`, paid once.
    pub payments: Option<PaymentsConfig>,
    /// How long an UNKNOWN claim is held before the next retry executes; `forever` to hold
    /// until an operator resolves it. Default: the profile's, else 5 minutes.
    pub hold: Option<Hold>,
    /// How long receipts (and every other claim) are kept. Default: the profile's (7 days
    /// for money and trading profiles), else 24 hours.
    pub retention: Option<Dur>,
    /// How long a claim stays PENDING without a heartbeat before it counts as abandoned.
    #[serde(default = "default_lease")]
    pub lease: Dur,
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout: Dur,
    /// Total deadline for one upstream call (send + response body).
    #[serde(default = "default_timeout")]
    pub timeout: Dur,
    /// Headers whose values identify the caller's account; hashed into the scope, never
    /// stored. Default: the profile's account headers, else every header whose name looks like
    /// a credential (see `identity::account`).
    pub credential_headers: Option<Vec<String>>,
    /// On a route without a provider profile: query and body fields whose values identify
    /// the caller's account (hashed, never stored), besides its headers. Default:
    /// `identity::account::CREDENTIAL_FIELDS`; `[]` reads none.
    pub credential_fields: Option<Vec<String>>,
    /// When the store is unreachable, forward unprotected instead of answering 503.
    #[serde(default)]
    pub fail_open: bool,
    /// What the route speaks: `http` (the default: each request is an operation) or `mcp` (a
    /// remote MCP server over Streamable HTTP: each tool call is an operation).
    #[serde(default)]
    pub protocol: Protocol,
    /// `[routes.mcp]`: which tools are read-only and how a tool call is identified.
    pub mcp: Option<McpConfig>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    #[default]
    Http,
    Mcp,
}

/// `[routes.mcp]`: a route to a remote MCP server.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct McpConfig {
    /// How long two calls of one tool with the same arguments (and no template or client key)
    /// count as one call. Default: 24 hours.
    pub window: Option<Dur>,
    /// Tools that change nothing: never claimed. Every other tool is protected.
    #[serde(default)]
    pub read_only: Vec<String>,
    /// Leave unclaimed a tool the server's own `tools/list` marks `readOnlyHint: true`. Off by
    /// default: a server's annotations are hints, and a wrong one would execute twice.
    #[serde(default)]
    pub trust_annotations: bool,
    /// How long a person may take to answer what a call asks: a server request (elicitation,
    /// sampling) inside a call's stream pauses the route's `timeout` up to this long in all,
    /// and a call that answered `input_required` keeps its claim this long for its
    /// continuation. Default: 10 minutes.
    pub answer_timeout: Option<Dur>,
    /// Per tool: `[routes.mcp.tools.create_refund] key = "refund:{args.charge}"`.
    #[serde(default)]
    pub tools: std::collections::BTreeMap<String, McpToolConfig>,
    /// How a tool call's spend refusal (a cap, an approval pending or denied) is answered:
    /// `error` (a JSON-RPC error, the default) or `result` (a tool result with `isError:
    /// true`, for agent frameworks that show their model only results).
    pub refusals: Option<String>,
    /// Host names (`host` or `host:port`) the route answers to besides its server's and, on a
    /// loopback listener, loopback ones: any other `Host` is refused with 403 (DNS rebinding).
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
    /// Origins (`https://app.example`) a browser may post from besides loopback ones and the
    /// route's server: any other `Origin` is refused with 403.
    #[serde(default)]
    pub allowed_origins: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpToolConfig {
    /// The operation a call names, from its arguments (`{args.NAME}`) and the request
    /// (`{header.NAME}`, `{bearer.CLAIM}`, `{tenant}`), instead of all its arguments.
    pub key: Option<String>,
    /// `isError: true` results whose text contains one of these (ASCII case-insensitive) are
    /// passed to the client but not kept: the tool said nothing happened ("rate limited"), so
    /// a retry executes. Default: none (every complete result is kept).
    #[serde(default)]
    pub release_errors: Vec<String>,
    /// What a successful call creates, kept to price later calls that name it:
    /// `records = { kind = "price", id = "{result.id}", amount = "{result.unit_amount}",
    /// currency = "{result.currency}", unit = "minor" }`.
    pub records: Option<RecordsConfig>,
    /// On a capped tool that carries no amount: priced as an object an earlier call recorded,
    /// `price_from = { kind = "price", id = "{args.price}", times = "{args.quantity}" }`.
    pub price_from: Option<PriceFromConfig>,
}

/// `[routes.mcp.tools.<tool>] records`: the object a successful call made. Fields are
/// `{result.NAME}` (the object the call's result holds) or `{args.NAME}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordsConfig {
    /// What kind of object (`price`): the name `price_from` asks for.
    pub kind: String,
    pub id: String,
    pub amount: String,
    /// A field, or a code (`"usd"`).
    pub currency: String,
    /// `minor` (integers of cents, as Stripe writes `unit_amount`) or `major`.
    pub unit: String,
}

/// `[routes.mcp.tools.<tool>] price_from`: which recorded object a call names (`{args.NAME}`)
/// and, optionally, the argument its amount is multiplied by.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriceFromConfig {
    pub kind: String,
    pub id: String,
    pub times: Option<String>,
}

/// A provider's "key already used" answer: this status with this top-level JSON `code`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DuplicateConfig {
    pub status: u16,
    pub code: String,
    /// Where an operator finds the original operation; `{key}` is the key passed down.
    #[serde(default)]
    pub lookup_hint: String,
}

/// One endpoint's operation template: `match = "POST /v1/payment_intents/*/confirm"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperationConfig {
    /// For logs and metrics; default: the match text.
    pub name: Option<String>,
    /// `METHOD /path` (or `* /path` for any protected method); `*` stands for one segment.
    #[serde(rename = "match")]
    pub matches: String,
    pub key: String,
    /// Default: the route's.
    pub missing_key: Option<MissingKey>,
}

/// What a request costs and the budgets it counts against (`[routes.spend]`). Amounts in
/// caps and thresholds are decimals of `caps_currency` ("500.00").
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpendConfig {
    /// Which requests cost money (`"POST /v1/payment_intents"`). Default: the profile's.
    pub operations: Option<Vec<String>>,
    /// Where the amount is: a template field (`"{body.amount}"`), or a product of fields
    /// (`"{body.qty} * {body.limit_price}"`); a list is tried in order. Default: the profile's.
    pub amount: Option<Vec<String>>,
    /// The request's currency: a template field (`"{body.currency}"`) or a code (`"usd"`).
    pub currency: Option<String>,
    /// `minor` (integers of cents: Stripe) or `major` (decimals: PayPal). Default: the profile's.
    pub unit: Option<String>,
    /// On an MCP route, count caps of one tool (`[routes.spend.tools.create_refund]
    /// count_per_run = 3`), beside the route-wide ones, which count every listed tool
    /// together.
    #[serde(default)]
    pub tools: BTreeMap<String, ToolSpendConfig>,
    /// Operations that move money and never say how much (an MCP route: tool names,
    /// `finalize_invoice`): always unpriced, whatever the request carries — an `amount` an
    /// agent adds to such a call is not read — so sent for approval (`unpriced = "approve"`)
    /// or refused.
    #[serde(default)]
    pub unpriced_operations: Vec<String>,
    /// What a money-moving request the proxy cannot price gets where money is limited:
    /// `refuse` (403 `unpriced-operation`, the default) or `approve` (parked for a person).
    pub unpriced: Option<String>,
    /// Currencies whose minor unit differs from ISO 4217 for this route's provider, beyond
    /// the profile's own list: `{ mga = 0 }`.
    #[serde(default)]
    pub exponents: BTreeMap<String, u32>,
    /// The currency caps and thresholds are written in.
    pub caps_currency: String,
    /// Other currencies a request may use: units of `caps_currency` per unit of each.
    /// A currency neither here nor `caps_currency` is refused.
    #[serde(default, deserialize_with = "amount::rates")]
    pub rates: BTreeMap<String, String>,
    #[serde(default, deserialize_with = "amount::per_request")]
    pub per_request: Option<String>,
    #[serde(default, deserialize_with = "amount::per_run")]
    pub per_run: Option<String>,
    #[serde(default, deserialize_with = "amount::per_tenant")]
    pub per_tenant: Option<String>,
    /// What every tenant together may spend on the route in `route_window`.
    pub per_route: Option<String>,
    /// Executions of the route's capped operations per run, tenant and route, each in its
    /// window (emails, SMS, orders: what has no amount still has a count).
    pub count_per_run: Option<u32>,
    pub count_per_tenant: Option<u32>,
    pub count_per_route: Option<u32>,
    /// The window of `per_tenant`, `count_per_tenant` and `approve_tenant_above`: a rolling
    /// duration (`24h`), or `calendar-day` (from midnight in `time_zone`).
    #[serde(default = "default_window")]
    pub tenant_window: String,
    /// How long a run's spend counts (a run id reused later starts afresh); a duration or
    /// `calendar-day`.
    #[serde(default = "default_window")]
    pub run_window: String,
    /// The window of `per_route` and `count_per_route`; a duration or `calendar-day`.
    #[serde(default = "default_window")]
    pub route_window: String,
    /// The IANA time zone (`Europe/Berlin`) whose midnight starts a `calendar-day` window.
    /// Default: UTC.
    pub time_zone: Option<String>,
    /// A single request above this needs a person's approval.
    #[serde(default, deserialize_with = "amount::approve_above")]
    pub approve_above: Option<String>,
    /// A run whose spend (this request included) would pass this needs approval.
    #[serde(default, deserialize_with = "amount::approve_run_above")]
    pub approve_run_above: Option<String>,
    /// A tenant whose spend on the route in `tenant_window` (this request included) would
    /// pass this needs approval: what a worker naming a new run per payment cannot escape.
    pub approve_tenant_above: Option<String>,
    /// `false`: shadow mode. Every decision is logged and counted as it would be; nothing is
    /// refused or parked (freezes still stop requests).
    #[serde(default = "default_true")]
    pub enforce: bool,
    /// Capped operations whose requests without a key may take an identity derived from the
    /// whole request, within the route's `dedup_window` (charges). Every other capped request
    /// without a key is refused with 400 naming the key to add (money out, orders). Default:
    /// the profile's list, else none.
    pub derive_without_key: Option<Vec<String>>,
    /// Body fields that do not change what a payment is (a description an LLM rewords):
    /// left out of what an approval and a price are bound to. Dotted paths.
    #[serde(default = "default_descriptive")]
    pub descriptive: Vec<String>,
    /// How long a request waits, open, for a decision before it is told to retry.
    #[serde(default = "default_approval_wait")]
    pub approval_wait: Dur,
    /// How long an approval request (and an approval not yet used) stays valid.
    #[serde(default = "default_approval_expires")]
    pub approval_expires: Dur,
    /// Where the run comes from, first match wins: `proxy-user` (`Proxy-Authorization`
    /// user `tenant.run`), `header:NAME`. Absent: the tenant is one run.
    #[serde(default = "default_run_from")]
    pub run_from: Vec<String>,
}

/// `[routes.payments]`: the per-request payment protocols a route reads.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PaymentsConfig {
    /// Recognise x402 (v2 `PAYMENT-SIGNATURE`, v1 `X-PAYMENT`) on this route.
    #[serde(default)]
    pub x402: bool,
    /// CAIP-2 networks a payment may be on (`eip155:8453`); at least one.
    #[serde(default)]
    pub networks: Vec<String>,
    /// What each asset's atomic units are worth: a capped route refuses an asset without a
    /// row.
    #[serde(default)]
    pub assets: Vec<AssetConfig>,
}

/// One row of a route's x402 asset table: `decimals` atomic units of the token at `asset`
/// on `network` make one unit of `currency`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AssetConfig {
    pub network: String,
    pub asset: String,
    pub currency: String,
    pub decimals: u32,
}

/// Count caps of one tool of an MCP route: executions of that tool alone, in the windows of
/// the route-wide count caps.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolSpendConfig {
    pub count_per_run: Option<u32>,
    pub count_per_tenant: Option<u32>,
    pub count_per_route: Option<u32>,
}

fn default_true() -> bool {
    true
}
fn default_descriptive() -> Vec<String> {
    vec!["description".into()]
}
/// Amounts in `[routes.spend]` are text ("500.00"): a TOML float would round them. A bare
/// number is refused with the line to write instead.
mod amount {
    use std::collections::BTreeMap;
    use std::fmt;

    use serde::de::{self, MapAccess, Visitor};
    use serde::Deserializer;

    struct Amount(&'static str);

    impl Amount {
        fn refuse<E: de::Error>(&self, number: String) -> E {
            let whole = if number.contains('.') {
                number.clone()
            } else {
                format!("{number}.00")
            };
            E::custom(format!(
                "amounts are text, in caps_currency: write {} = \"{whole}\", not {number}",
                self.0
            ))
        }
    }

    impl<'de> Visitor<'de> for Amount {
        type Value = Option<String>;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "an amount as text, e.g. {} = \"500.00\"", self.0)
        }

        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            Err(self.refuse(v.to_string()))
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Err(self.refuse(v.to_string()))
        }

        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
            Err(self.refuse(v.to_string()))
        }
    }

    fn field<'de, D: Deserializer<'de>>(
        d: D,
        name: &'static str,
    ) -> Result<Option<String>, D::Error> {
        d.deserialize_any(Amount(name))
    }

    pub fn per_request<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        field(d, "per_request")
    }
    pub fn per_run<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        field(d, "per_run")
    }
    pub fn per_tenant<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        field(d, "per_tenant")
    }
    pub fn approve_above<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        field(d, "approve_above")
    }
    pub fn approve_run_above<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        field(d, "approve_run_above")
    }

    struct Rates;

    impl<'de> Visitor<'de> for Rates {
        type Value = BTreeMap<String, String>;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a table of rates as text, e.g. rates = { eur = \"1.09\" }")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut rates = BTreeMap::new();
            while let Some(currency) = map.next_key::<String>()? {
                let rate = map.next_value::<toml::Value>()?;
                match rate {
                    toml::Value::String(text) => {
                        rates.insert(currency, text);
                    }
                    other => {
                        return Err(de::Error::custom(format!(
                        "rates are text: write rates = {{ {currency} = \"{other}\" }}, not {other}"
                    )))
                    }
                }
            }
            Ok(rates)
        }
    }

    pub fn rates<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
        d.deserialize_map(Rates)
    }
}

fn default_window() -> String {
    "24h".into()
}
/// Short enough that a tool held for a decision gets its answer within a tool call's usual
/// 30 s timeout (Stripe's SDKs are told not to retry a pending approval).
fn default_approval_wait() -> Dur {
    Dur(Duration::from_secs(20))
}
fn default_approval_expires() -> Dur {
    Dur(Duration::from_secs(24 * 3600))
}
fn default_run_from() -> Vec<String> {
    vec!["proxy-user".into(), "header:idempotency-run".into()]
}

/// Where approval requests are announced (`[approvals]`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApprovalsConfig {
    /// POSTed a JSON notice of every new approval request (a chat incoming webhook works:
    /// the notice carries a `text` field).
    pub webhook: Option<String>,
}

/// How a route asks its provider whether an operation happened, by the key passed down.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LookupConfig {
    /// `GET /v2/orders:by_client_order_id?client_order_id={key}`: `{key}` is the key the held
    /// attempt passed down; other fields as in key templates, read from the retry's request.
    pub request: String,
    /// Statuses meaning the operation happened (its answer becomes the receipt).
    #[serde(default = "default_lookup_found")]
    pub found: Vec<String>,
    /// Statuses meaning it did not happen.
    #[serde(default = "default_lookup_not_found")]
    pub not_found: Vec<String>,
    /// A found answer must carry this JSON field, non-empty (else the lookup is unclear).
    pub found_field: Option<String>,
    // No "an empty search result means not found": a search answer is not the operation's
    // response (it would be replayed as the receipt), and search indexes lag behind writes.
    /// How old an unknown outcome must be before a lookup may say "not found": an operation
    /// may still be on its way into the provider's records.
    #[serde(default = "default_lookup_after")]
    pub after: Dur,
}

pub fn default_lookup_found() -> Vec<String> {
    vec!["2xx".into()]
}
pub fn default_lookup_not_found() -> Vec<String> {
    vec!["404".into()]
}
pub fn default_lookup_after() -> Dur {
    Dur(Duration::from_secs(5))
}

/// An outcome read from the response body: `field` (a JSON path such as `error` or
/// `data.0.sCode`) tested one way, deciding what becomes of the claim.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutcomeRuleConfig {
    /// Statuses the rule applies to (`2xx`, `400`); default: every status.
    pub status: Option<Vec<String>>,
    pub field: String,
    /// The field's value (as text) is one of these.
    #[serde(default)]
    pub equals: Vec<String>,
    /// The field is present and its value is none of these.
    #[serde(default)]
    pub not_equals: Vec<String>,
    /// The value (or any item of an array) starts with one of these.
    #[serde(default)]
    pub prefix: Vec<String>,
    /// The field is a non-empty array, object or string.
    #[serde(default)]
    pub non_empty: bool,
    /// `commit`, `decline`, `release`, `unknown` or `duplicate`.
    pub outcome: String,
    /// Said in logs, the record's note and a `duplicate` answer's detail.
    #[serde(default)]
    pub note: String,
}

pub fn default_dedup_window() -> Duration {
    Duration::from_secs(600)
}
fn default_key_header() -> String {
    "Idempotency-Key".into()
}
fn default_methods() -> Vec<String> {
    ["POST", "PUT", "PATCH", "DELETE"]
        .map(String::from)
        .to_vec()
}
pub fn default_commit_statuses() -> Vec<String> {
    ["2xx", "3xx", "4xx", "!408", "!409", "!425", "!429"]
        .map(String::from)
        .to_vec()
}
pub fn default_unknown_statuses() -> Vec<u16> {
    vec![500, 502, 504]
}
pub fn default_hold() -> Hold {
    Hold::For(Duration::from_secs(300))
}
pub fn default_retention() -> Duration {
    Duration::from_secs(24 * 3600)
}
pub fn default_declined_statuses() -> Vec<String> {
    ["4xx", "!408", "!409", "!425", "!429"]
        .map(String::from)
        .to_vec()
}
fn default_lease() -> Dur {
    Dur(Duration::from_secs(15))
}
fn default_wait_timeout() -> Dur {
    Dur(Duration::from_secs(30))
}
fn default_connect_timeout() -> Dur {
    Dur(Duration::from_secs(5))
}
fn default_timeout() -> Dur {
    Dur(Duration::from_secs(60))
}

/// A duration written as `30s`, `5m`, `24h`, `250ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dur(pub Duration);

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(s.trim()).map(Dur).map_err(|e| {
            serde::de::Error::custom(format!("`{s}` is not a duration like 30s, 5m or 24h: {e}"))
        })
    }
}

impl Config {
    /// Reads and validates a config file. Every error names the file and the field.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
            file: path.to_path_buf(),
            error,
        })?;
        Self::parse(&text, path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let mut config: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            file: path.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })?;
        config.source = path.to_path_buf();
        config.validate()?;
        Ok(config)
    }

    /// What the config allows but an operator should know, one line each, naming the field:
    /// printed by `check-config` and at start-up.
    pub fn warnings(&self) -> Vec<String> {
        self.routes
            .iter()
            .enumerate()
            .filter(|(_, r)| r.fail_open && r.spend.is_some())
            .map(|(i, r)| {
                format!(
                    "routes[{i}].fail_open (route `{}`): the route caps spend, and a priced or capped operation never fails open: while the store is out of reach it is refused with 503; only what [routes.spend] does not price is forwarded unprotected",
                    r.name
                )
            })
            .collect()
    }

    pub fn invalid(&self, field: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            file: self.source.clone(),
            field: field.into(),
            message: message.into(),
        }
    }

    /// The store's TLS files must be readable PEM, the key given with its certificate.
    fn validate_store_tls(&self) -> Result<(), ConfigError> {
        let files = [
            ("store.tls_ca", &self.store.tls_ca, "CERTIFICATE"),
            ("store.tls_cert", &self.store.tls_cert, "CERTIFICATE"),
            ("store.tls_key", &self.store.tls_key, "PRIVATE KEY"),
        ];
        for (field, path, label) in files {
            let Some(path) = path else { continue };
            let text = std::fs::read_to_string(path)
                .map_err(|e| self.invalid(field, format!("cannot read {}: {e}", path.display())))?;
            if !text.contains("-----BEGIN ") || !text.contains(label) {
                return Err(self.invalid(field, format!("{} holds no PEM {label}", path.display())));
            }
        }
        match (&self.store.tls_cert, &self.store.tls_key) {
            (Some(_), None) => {
                Err(self.invalid("store.tls_key", "must be set together with store.tls_cert"))
            }
            (None, Some(_)) => {
                Err(self.invalid("store.tls_cert", "must be set together with store.tls_key"))
            }
            _ => Ok(()),
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.validate_server()?;
        self.validate_store()?;
        self.validate_tls()?;
        self.validate_route_names()?;
        if crate::identity::derivation::Derivation::from_number(self.identity.derivation).is_none()
        {
            return Err(self.invalid(
                "identity.derivation",
                format!(
                    "{} is not a derivation this build knows: 1 or 2",
                    self.identity.derivation
                ),
            ));
        }
        Ok(())
    }

    fn validate_server(&self) -> Result<(), ConfigError> {
        parse_listen(&self.server.listen).map_err(|m| self.invalid("server.listen", m))?;
        if let Some(a) = &self.server.admin_listen {
            parse_listen(a).map_err(|m| self.invalid("server.admin_listen", m))?;
        }
        if self.server.max_connections == 0 {
            return Err(self.invalid("server.max_connections", "must be greater than 0"));
        }
        if self.server.max_header_bytes < 8192 {
            return Err(self.invalid("server.max_header_bytes", "must be at least 8192"));
        }
        if self.server.max_body_bytes == 0 {
            return Err(self.invalid("server.max_body_bytes", "must be greater than 0"));
        }
        if self.server.max_forwards == 0 {
            return Err(self.invalid("server.max_forwards", "must be greater than 0"));
        }
        if self.server.max_forward_bytes < self.server.max_body_bytes as u64 {
            return Err(self.invalid(
                "server.max_forward_bytes",
                format!(
                    "must be at least server.max_body_bytes ({}): one largest body must fit",
                    self.server.max_body_bytes
                ),
            ));
        }
        Ok(())
    }

    fn validate_store(&self) -> Result<(), ConfigError> {
        if !matches!(self.store.sqlite_synchronous.as_str(), "full" | "normal") {
            return Err(self.invalid("store.sqlite_synchronous", "must be `full` or `normal`"));
        }
        if self.store.namespace.is_empty() || self.store.namespace.contains(':') {
            return Err(self.invalid("store.namespace", "must be non-empty and contain no `:`"));
        }
        if self.store.op_timeout.0.is_zero() {
            return Err(self.invalid("store.op_timeout", "must be greater than 0"));
        }
        self.validate_store_tls()?;
        if self.store.pool_size == 0 {
            return Err(self.invalid("store.pool_size", "must be greater than 0"));
        }
        if self.store.sweep_interval.0.is_zero() {
            return Err(self.invalid("store.sweep_interval", "must be greater than 0"));
        }
        if self.store.redis_wait_replicas > 0
            && (self.store.redis_wait_timeout.0.is_zero()
                || self.store.redis_wait_timeout.0 >= self.store.op_timeout.0)
        {
            return Err(self.invalid(
                "store.redis_wait_timeout",
                format!(
                    "must be greater than 0 and shorter than store.op_timeout ({:?})",
                    self.store.op_timeout.0
                ),
            ));
        }
        Ok(())
    }

    fn validate_tls(&self) -> Result<(), ConfigError> {
        if self.tls.connect_ports.is_empty() || self.tls.connect_ports.contains(&0) {
            return Err(self.invalid(
                "tls.connect_ports",
                "must list at least one port, each 1-65535 (default [443])",
            ));
        }
        if self.tls.tunnel_idle_timeout.0.is_zero() {
            return Err(self.invalid("tls.tunnel_idle_timeout", "must be greater than 0"));
        }
        if self.tls.peek_timeout.0.is_zero() || self.tls.peek_timeout.0 > Duration::from_secs(30) {
            return Err(self.invalid("tls.peek_timeout", "must be between 1ms and 30s"));
        }
        for (i, host) in self.tls.tunnel_hosts.iter().enumerate() {
            tunnel_host(host).map_err(|m| self.invalid(format!("tls.tunnel_hosts[{i}]"), m))?;
        }
        for (i, port) in self.tls.server_first_ports.iter().enumerate() {
            if !self.tls.connect_ports.contains(port) {
                return Err(self.invalid(
                    format!("tls.server_first_ports[{i}]"),
                    format!("port {port} is not in tls.connect_ports, so no CONNECT can reach it; add it there too, or remove it here"),
                ));
            }
        }
        if self.tls.unknown_hosts == Some(UnknownHosts::Tunnel) && !self.tls.tunnel_with_spend {
            if let Some(route) = self.routes.iter().find(|r| r.spend.is_some()) {
                return Err(self.invalid(
                    "tls.unknown_hosts",
                    format!(
                        "\"tunnel\" lets an agent reach any host past the proxy, and route `{}` caps spend: a CONNECT to another name or address of a payment provider would pay past its caps. \
                         List the hosts workers need in tls.tunnel_hosts (their LLM API…) and leave unknown_hosts unset (it is \"deny\" when a route caps spend), \
                         or set tls.tunnel_with_spend = true to say the risk is accepted",
                        route.name
                    ),
                ));
            }
        }
        match (&self.tls.ca_cert, &self.tls.ca_key) {
            (Some(_), None) => {
                return Err(self.invalid("tls.ca_key", "must be set together with tls.ca_cert"))
            }
            (None, Some(_)) => {
                return Err(self.invalid("tls.ca_cert", "must be set together with tls.ca_key"))
            }
            _ => {}
        }
        Ok(())
    }

    fn validate_route_names(&self) -> Result<(), ConfigError> {
        let mut names = std::collections::HashSet::new();
        for (i, r) in self.routes.iter().enumerate() {
            if !names.insert(r.name.as_str()) {
                return Err(self.invalid(
                    format!("routes[{i}].name"),
                    format!("`{}` is used by two routes", r.name),
                ));
            }
        }
        Ok(())
    }
}

impl Config {
    /// What CONNECT to a host no route covers gets: `tls.unknown_hosts`, else `deny` when
    /// any route caps spend (an agent must not reach a payment provider by another name),
    /// else `tunnel`.
    pub fn unknown_hosts(&self) -> UnknownHosts {
        match self.tls.unknown_hosts {
            Some(mode) => mode,
            None if self.routes.iter().any(|r| r.spend.is_some()) => UnknownHosts::Deny,
            None => UnknownHosts::Tunnel,
        }
    }
}

/// A `tls.tunnel_hosts` entry: a DNS name, or `*.` and one (every name below it). Never an
/// address: an address says nothing about whose server is behind it.
pub fn tunnel_host(entry: &str) -> Result<(), String> {
    let name = entry.strip_prefix("*.").unwrap_or(entry);
    let dns = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    if !dns
        || name.parse::<std::net::IpAddr>().is_ok()
        || name.bytes().all(|b| b.is_ascii_digit() || b == b'.')
    {
        return Err(format!(
            "`{entry}` is not a host name like api.openai.com or *.openai.com (no port, no address: an address says nothing about whose server is behind it)"
        ));
    }
    Ok(())
}

/// Parses a listen address; port 0 asks the OS for a free port.
pub fn parse_listen(s: &str) -> Result<SocketAddr, String> {
    s.parse::<SocketAddr>()
        .map_err(|_| format!("`{s}` is not an address like 127.0.0.1:8080 or [::]:8080"))
}
