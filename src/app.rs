//! Wiring: everything the proxy runs on, built from a config. `Parts::check` is what
//! `check-config` runs and what `serve` runs first, so the two accept exactly the same files.

use std::sync::Arc;

use crate::admin::AdminSettings;
use crate::auth::Tenants;
use crate::config::{Config, ConfigError};
use crate::idempotency::claims::Claims;
use crate::identity::minted_keys::MintedKeys;
use crate::metrics::Metrics;
use crate::outbound::announce::Webhook;
use crate::outbound::egress::Egress;
use crate::outbound::upstream::{ClientOptions, UpstreamClient};
use crate::proxy::admission::ForwardLimit;
use crate::proxy::egress_policy::ConnectPolicy;
use crate::proxy::App;
use crate::routes::{RouteTable, Routes};
use crate::spend::gate::{Announcer, Gate};
use crate::spend::port::SpendStore;
use crate::store::{self, Sealer, StoreError, StoreUrl};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Everything a config describes that can be built without touching the network or the
/// store: a config these build from is one `serve` starts on (the store permitting).
pub struct Parts {
    pub routes: Routes,
    pub connect: ConnectPolicy,
    pub tenants: Tenants,
    pub egress: Arc<Egress>,
    pub sealer: Option<Arc<Sealer>>,
    pub admin: AdminSettings,
    pub default_client: UpstreamClient,
    /// `[approvals] webhook`: where new approval requests are announced.
    pub webhook: Option<(http::Uri, UpstreamClient)>,
}

impl Parts {
    pub fn check(config: &Config) -> Result<Parts, ConfigError> {
        // Parsed here so check-config refuses what serve would; serve parses it again when
        // it opens the store (with the rest of `[store]`).
        let store_url =
            StoreUrl::parse(&config.store.url).map_err(|m| config.invalid("store.url", m))?;
        if let StoreUrl::Postgres(pg) = &store_url {
            pg.check_ca(config.store.tls_ca.is_some())
                .map_err(|m| config.invalid("store.tls_ca", m))?;
        }
        let egress = Arc::new(Egress::build(config)?);
        let default_client = UpstreamClient::new(&ClientOptions {
            extra_roots: None,
            connect_to: None,
            connect_timeout: std::time::Duration::from_secs(10),
            pool_idle_timeout: config.server.pool_idle_timeout.0,
            egress: Some(egress.clone()),
        })
        .map_err(|e| config.invalid("server", e.to_string()))?;
        let admin = AdminSettings::from_config(config)?;
        let routes = Routes::build(config)?;
        approvals_can_be_decided(config, &routes, &admin)?;
        Ok(Parts {
            routes,
            connect: ConnectPolicy::build(config)?,
            tenants: Tenants::build(config)?,
            egress,
            sealer: Sealer::load(&config.encryption, &config.env)
                .map_err(|e| config.invalid(e.field, e.message))?
                .map(Arc::new),
            admin,
            default_client,
            webhook: webhook(config)?,
        })
    }
}

/// A route that parks payments for a person's approval needs the admin listener and its
/// token, through which people decide: without them a parked payment can never go out, and
/// the agent waiting on it is stuck.
fn approvals_can_be_decided(
    config: &Config,
    routes: &Routes,
    admin: &AdminSettings,
) -> Result<(), ConfigError> {
    let with_approvals = routes.all().iter().enumerate().find_map(|(i, r)| {
        let field = r.spend.as_ref()?.budget.parks()?;
        Some(format!("routes[{i}] ({}).spend.{field}", r.name))
    });
    let Some(field) = with_approvals else {
        return Ok(());
    };
    let token = format!(
        "an admin token that may approve: the environment variable {} (admin.token_env) set when the proxy starts, admin.token_sha256, or an [[admin.tokens]] entry with role approver or operator",
        config.admin.token_env
    );
    if config.server.admin_listen.is_none() {
        return Err(config.invalid(
            field,
            format!("payments above it wait for a person's approval, given through the admin listener, and none is configured: add server.admin_listen (e.g. \"127.0.0.1:9090\") and {token}"),
        ));
    }
    if !admin.can_approve() {
        return Err(config.invalid(
            field,
            format!("payments above it wait for a person's approval, given through the admin API, and no token may approve: set {token}"),
        ));
    }
    Ok(())
}

/// Every cap of every route in the spend metrics, at 0 until it refuses something.
pub fn spend_metrics(metrics: &Metrics, routes: &Routes) {
    for r in routes.all() {
        if let Some(spend) = &r.spend {
            metrics.spend_caps(&r.name, &spend.budget.cap_names());
        }
    }
}

/// The approvals webhook's URL and a client for it (the operator's own endpoint: not
/// subject to the egress rules for tools).
fn webhook(config: &Config) -> Result<Option<(http::Uri, UpstreamClient)>, ConfigError> {
    let Some(raw) = &config.approvals.webhook else {
        return Ok(None);
    };
    let invalid = |m: String| config.invalid("approvals.webhook", m);
    let uri: http::Uri = raw
        .parse()
        .map_err(|e| invalid(format!("`{raw}` is not a URL: {e}")))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() {
        return Err(invalid(format!(
            "`{raw}` must be an http:// or https:// URL"
        )));
    }
    let client = UpstreamClient::new(&ClientOptions {
        extra_roots: None,
        connect_to: None,
        connect_timeout: std::time::Duration::from_secs(5),
        pool_idle_timeout: config.server.pool_idle_timeout.0,
        egress: None,
    })
    .map_err(|e| invalid(e.to_string()))?;
    Ok(Some((uri, client)))
}

/// The proxy's runtime state, its store opened, and the admin settings.
pub async fn build(config: &Config) -> Result<(Arc<App>, AdminSettings), StartError> {
    let parts = Parts::check(config)?;
    let metrics = Arc::new(Metrics::new());
    // Both ports behind the store's one guard: deadline, timing, sealing.
    let stores = store::open(&config.store, parts.sealer.clone(), metrics.clone()).await?;
    let claims = Claims::new(stores.claims);
    Ok(assemble(config, parts, claims, stores.spend, metrics))
}

/// The proxy's runtime state on stores already open (the pipeline's tests pass in-memory
/// ones), and the admin settings.
pub fn assemble(
    config: &Config,
    mut parts: Parts,
    claims: Claims,
    spend_store: Arc<dyn SpendStore>,
    metrics: Arc<Metrics>,
) -> (Arc<App>, AdminSettings) {
    let claims = Arc::new(claims.with_receipt_cache(config.server.receipt_cache_bytes));
    // Built whether or not a route has spend rules now: a reload may add some.
    let spend = {
        let webhook = parts
            .webhook
            .clone()
            .map(|(url, client)| Arc::new(Webhook::start(url, client, metrics.clone())));
        // The admin audit trail goes to the same webhook as approval requests.
        parts.admin.audit_hook = webhook.clone();
        let announcer = webhook.map(|w| w as Arc<dyn Announcer>);
        Arc::new(Gate::new(
            spend_store,
            claims.clone(),
            announcer,
            metrics.clone(),
        ))
    };
    spend_metrics(&metrics, &parts.routes);
    let app = App {
        routes: RouteTable::new(parts.routes),
        claims,
        namespace: config.store.namespace.clone(),
        max_body_bytes: config.server.max_body_bytes,
        max_receipt_bytes: config.server.max_receipt_bytes,
        default_client: parts.default_client,
        connect: parts.connect,
        metrics,
        tenants: parts.tenants,
        egress: parts.egress,
        admission: ForwardLimit::new(
            config.server.max_forwards,
            config.server.max_forward_bytes,
            config.server.max_body_bytes,
        ),
        minted_keys: MintedKeys::default(),
        spend,
    };
    (Arc::new(app), parts.admin)
}

/// The start-up (and reload) warning for routes only HTTPS interception can reach when no CA
/// is configured: their CONNECTs are refused. A config whose routes all have a base-URL
/// prefix and name no host of their own needs no CA, and gets no warning.
pub fn interception_warning(config: &Config, has_ca: bool) -> Option<String> {
    if has_ca {
        return None;
    }
    let needing: Vec<&str> = config
        .routes
        .iter()
        .filter(|r| r.prefix.is_none() || r.host.is_some())
        .map(|r| r.name.as_str())
        .collect();
    (!needing.is_empty()).then(|| {
        format!(
            "no [tls] CA configured: CONNECT (HTTPS_PROXY) to the hosts of routes {} is refused with 403; run `idemproxy ca init`, or use their base URL (prefix)",
            needing.join(", ")
        )
    })
}
