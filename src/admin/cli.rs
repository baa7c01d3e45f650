//! `idemproxy keys list|show|resolve|reconcile`, `idemproxy approvals list|approve|deny` and
//! `idemproxy freeze|unfreeze|freezes`: the admin API from a shell.

use clap::{Args, Subcommand};
use http::Method;

use super::client::{call, AdminClientError};

/// Where the admin API is, and the token for it: before or after the subcommand
/// (`idemproxy approvals list --admin URL`), as `--help` lists them there.
#[derive(Debug, Args)]
pub struct AdminTarget {
    /// Base URL of the admin listener.
    #[arg(
        long,
        global = true,
        env = "IDEMPROXY_ADMIN_URL",
        default_value = "http://127.0.0.1:9090"
    )]
    pub admin: String,
    /// Environment variable holding the admin token.
    #[arg(long, global = true, default_value = "IDEMPROXY_ADMIN_TOKEN")]
    pub token_env: String,
}

impl AdminTarget {
    fn token(&self) -> Result<String, CliError> {
        std::env::var(&self.token_env).map_err(|_| CliError::NoToken(self.token_env.clone()))
    }
}

#[derive(Debug, Args)]
pub struct KeysArgs {
    #[command(flatten)]
    pub target: AdminTarget,
    #[command(subcommand)]
    pub command: KeysCommand,
}

#[derive(Debug, Args)]
pub struct LookupArgs {
    /// The scope `list` printed (or give --route and --key).
    #[arg(long, conflicts_with_all = ["route", "key"])]
    pub scope: Option<String>,
    #[arg(long, requires = "key")]
    pub route: Option<String>,
    #[arg(long, default_value = crate::auth::DEFAULT_TENANT)]
    pub tenant: String,
    /// The client's idempotency key.
    #[arg(long, requires = "route")]
    pub key: Option<String>,
    /// A credential header the client sent, `Name: value` (repeatable), e.g.
    /// `--credential "Authorization: Bearer sk_live_…"`. Hashed by the proxy, never stored.
    #[arg(long = "credential")]
    pub credentials: Vec<String>,
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// List claims in a state (default: UNKNOWN, the ones waiting for an operator).
    List {
        #[arg(long, default_value = "unknown")]
        state: String,
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Show one claim.
    Show(LookupArgs),
    /// Resolve an UNKNOWN claim after checking the provider.
    Resolve {
        #[command(flatten)]
        lookup: LookupArgs,
        /// The token `show` printed; the resolve applies to that claim only.
        #[arg(long)]
        token: String,
        /// Delete the claim: the next retry executes at the provider.
        #[arg(
            long,
            conflicts_with = "commit_status",
            required_unless_present = "commit_status"
        )]
        release: bool,
        /// Commit this status as the receipt: retries replay it.
        #[arg(long)]
        commit_status: Option<u16>,
        /// Receipt header `Name: value` (repeatable).
        #[arg(long, requires = "commit_status")]
        commit_header: Vec<String>,
        /// Receipt body (UTF-8).
        #[arg(long, requires = "commit_status", conflicts_with = "commit_body_file")]
        commit_body: Option<String>,
        /// Receipt body read from a file (any bytes).
        #[arg(long, requires = "commit_status")]
        commit_body_file: Option<std::path::PathBuf>,
    },
    /// Ask the provider whether a held operation happened (the route's lookup, with the
    /// credentials given by --credential), and resolve the claim by its answer.
    Reconcile {
        #[command(flatten)]
        lookup: LookupArgs,
        /// The token `show` printed.
        #[arg(long)]
        token: String,
        /// The key the provider got, when it is not --key (e.g. a client_order_id the tool set).
        #[arg(long)]
        passed_down: Option<String>,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("the environment variable {0} (the admin token) is not set")]
    NoToken(String),
    #[error("`{0}` is not a header like `Name: value`")]
    Header(String),
    #[error("cannot read {}: {error}", path.display())]
    Read {
        path: std::path::PathBuf,
        // Not `source`: the message says it already, and a source is printed again.
        error: std::io::Error,
    },
    #[error(transparent)]
    Client(#[from] AdminClientError),
    #[error("the admin API answered {status}: {body}")]
    Refused { status: u16, body: String },
}

fn header_pairs(values: &[String]) -> Result<Vec<(String, String)>, CliError> {
    values
        .iter()
        .map(|h| {
            h.split_once(':')
                .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
                .filter(|(n, _)| !n.is_empty())
                .ok_or_else(|| CliError::Header(h.clone()))
        })
        .collect()
}

fn lookup_json(l: &LookupArgs) -> Result<serde_json::Map<String, serde_json::Value>, CliError> {
    let mut m = serde_json::Map::new();
    if let Some(s) = &l.scope {
        m.insert("scope".into(), s.clone().into());
    }
    if let Some(r) = &l.route {
        m.insert("route".into(), r.clone().into());
    }
    if let Some(k) = &l.key {
        m.insert("key".into(), k.clone().into());
    }
    m.insert("tenant".into(), l.tenant.clone().into());
    let creds: serde_json::Map<_, _> = header_pairs(&l.credentials)?
        .into_iter()
        .map(|(n, v)| (n, serde_json::Value::from(v)))
        .collect();
    m.insert("credentials".into(), creds.into());
    Ok(m)
}

/// Runs the command; returns the API's JSON answer, pretty-printed.
pub async fn run(args: KeysArgs) -> Result<String, CliError> {
    let token = args.target.token()?;
    let (method, path, body) = match &args.command {
        KeysCommand::List { state, limit } => {
            let mut path = format!("/v1/keys?state={state}");
            if let Some(n) = limit {
                path.push_str(&format!("&limit={n}"));
            }
            (Method::GET, path, None)
        }
        KeysCommand::Show(l) => (
            Method::POST,
            "/v1/keys/show".to_string(),
            Some(serde_json::Value::Object(lookup_json(l)?)),
        ),
        KeysCommand::Resolve {
            lookup,
            token: claim_token,
            release,
            commit_status,
            commit_header,
            commit_body,
            commit_body_file,
        } => {
            let mut m = lookup_json(lookup)?;
            m.insert("token".into(), claim_token.clone().into());
            if *release {
                m.insert("action".into(), "release".into());
            } else if let Some(status) = commit_status {
                m.insert("action".into(), "commit".into());
                let mut receipt = serde_json::json!({
                    "status": status,
                    "headers": header_pairs(commit_header)?,
                });
                if let Some(b) = commit_body {
                    receipt["body"] = b.clone().into();
                }
                if let Some(path) = commit_body_file {
                    use base64::Engine as _;
                    let bytes = std::fs::read(path).map_err(|source| CliError::Read {
                        path: path.clone(),
                        error: source,
                    })?;
                    receipt["body_base64"] = base64::engine::general_purpose::STANDARD
                        .encode(bytes)
                        .into();
                }
                m.insert("receipt".into(), receipt);
            }
            (
                Method::POST,
                "/v1/keys/resolve".to_string(),
                Some(serde_json::Value::Object(m)),
            )
        }
        KeysCommand::Reconcile {
            lookup,
            token: claim_token,
            passed_down,
        } => {
            let mut m = lookup_json(lookup)?;
            m.insert("token".into(), claim_token.clone().into());
            if let Some(k) = passed_down {
                m.insert("passed_down".into(), k.clone().into());
            }
            (
                Method::POST,
                "/v1/keys/reconcile".to_string(),
                Some(serde_json::Value::Object(m)),
            )
        }
    };
    send(&args.target.admin, &token, method, &path, body).await
}

/// One admin API call; the JSON answer pretty-printed, or the refusal.
async fn send(
    admin: &str,
    token: &str,
    method: Method,
    path: &str,
    body: Option<serde_json::Value>,
) -> Result<String, CliError> {
    let answer = call(admin, method, path, Some(token), body).await?;
    let text = match serde_json::from_slice::<serde_json::Value>(&answer.body) {
        Ok(v) => serde_json::to_string_pretty(&v).unwrap_or_default(),
        Err(_) => String::from_utf8_lossy(&answer.body).into_owned(),
    };
    if answer.status >= 300 {
        return Err(CliError::Refused {
            status: answer.status,
            body: text,
        });
    }
    Ok(text)
}

#[derive(Debug, Args)]
pub struct ApprovalsArgs {
    #[command(flatten)]
    pub target: AdminTarget,
    #[command(subcommand)]
    pub command: ApprovalsCommand,
}

#[derive(Debug, Subcommand)]
pub enum ApprovalsCommand {
    /// List approvals (default: the pending ones), with what each payment is.
    List {
        /// pending, approved, denied, expired or all.
        #[arg(long, default_value = "pending")]
        state: String,
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Approve a parked payment: it goes out (once) on its next attempt, or at once if its
    /// request is still waiting.
    Approve {
        /// The approval id (`apr_…`).
        id: String,
        /// Who approves: recorded.
        #[arg(long)]
        by: String,
        #[arg(long)]
        reason: Option<String>,
    },
    /// Deny a parked payment: it never goes out; every retry is told so.
    Deny {
        id: String,
        #[arg(long)]
        by: String,
        /// Why: recorded, and told to the tool.
        #[arg(long)]
        reason: String,
    },
}

/// Runs `idemproxy approvals …`; returns the API's JSON answer, pretty-printed.
pub async fn run_approvals(args: ApprovalsArgs) -> Result<String, CliError> {
    let token = args.target.token()?;
    let decision = |id: &str, by: &str, reason: Option<&str>| {
        Some(serde_json::json!({"id": id, "by": by, "reason": reason}))
    };
    let (method, path, body) = match &args.command {
        ApprovalsCommand::List { state, limit } => {
            let mut path = format!("/v1/approvals?state={state}");
            if let Some(n) = limit {
                path.push_str(&format!("&limit={n}"));
            }
            (Method::GET, path, None)
        }
        ApprovalsCommand::Approve { id, by, reason } => (
            Method::POST,
            "/v1/approvals/approve".to_string(),
            decision(id, by, reason.as_deref()),
        ),
        ApprovalsCommand::Deny { id, by, reason } => (
            Method::POST,
            "/v1/approvals/deny".to_string(),
            decision(id, by, Some(reason)),
        ),
    };
    send(&args.target.admin, &token, method, &path, body).await
}

/// `idemproxy freeze|unfreeze`: what to stop (or let go again), and who says so.
#[derive(Debug, Args)]
pub struct FreezeArgs {
    #[command(flatten)]
    pub target: AdminTarget,
    /// Every capped operation of this tenant, on every route (with --run: that run's only).
    #[arg(long, required_unless_present = "route")]
    pub tenant: Option<String>,
    /// One run of --tenant (default tenant when --tenant is absent).
    #[arg(long, conflicts_with = "route")]
    pub run: Option<String>,
    /// Every capped operation of this route, whoever asks.
    #[arg(long, conflicts_with = "tenant")]
    pub route: Option<String>,
    /// Who (recorded; a named admin token acts as its own name).
    #[arg(long)]
    pub by: Option<String>,
    /// Why: recorded, and told to the tools that are refused (required to freeze).
    #[arg(long)]
    pub reason: Option<String>,
}

/// Runs `idemproxy freeze` (`freeze`: true) or `idemproxy unfreeze`.
pub async fn run_freeze(args: FreezeArgs, freeze: bool) -> Result<String, CliError> {
    let token = args.target.token()?;
    let scope = match (&args.route, &args.run) {
        (Some(_), _) => "route",
        (None, Some(_)) => "run",
        (None, None) => "tenant",
    };
    let mut body = serde_json::json!({"scope": scope});
    for (k, v) in [
        ("tenant", &args.tenant),
        ("run", &args.run),
        ("route", &args.route),
        ("by", &args.by),
        ("reason", &args.reason),
    ] {
        if let Some(v) = v {
            body[k] = v.clone().into();
        }
    }
    let path = if freeze {
        "/v1/freezes/freeze"
    } else {
        "/v1/freezes/unfreeze"
    };
    send(&args.target.admin, &token, Method::POST, path, Some(body)).await
}

/// `idemproxy freezes`: every freeze in effect.
pub async fn list_freezes(target: AdminTarget) -> Result<String, CliError> {
    let token = target.token()?;
    send(&target.admin, &token, Method::GET, "/v1/freezes", None).await
}

/// `idemproxy healthcheck`: exit 0 when `url` answers 200.
pub async fn healthcheck(url: &str) -> Result<(), CliError> {
    let uri: http::Uri = url
        .parse()
        .map_err(|_| AdminClientError::Url(url.to_string()))?;
    let base = format!(
        "{}://{}",
        uri.scheme_str().unwrap_or("http"),
        uri.authority().map(|a| a.as_str()).unwrap_or("")
    );
    let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let answer = call(&base, Method::GET, path, None, None).await?;
    if answer.status == 200 {
        Ok(())
    } else {
        Err(CliError::Refused {
            status: answer.status,
            body: String::from_utf8_lossy(&answer.body).into_owned(),
        })
    }
}
