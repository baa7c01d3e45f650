//! Wiring: everything the proxy runs on, built from a config. `Parts::check` is what
//! `check-config` runs and what `serve` runs first, so the two accept exactly the same files.

use std::sync::Arc;

use crate::admin::AdminSettings;
use crate::auth::Tenants;
use crate::config::{Config, ConfigError};
use crate::idempotency::claims::Claims;
use crate::identity::minted_keys::MintedKeys;
use crate::metrics::Metrics;
use crate::proxy::admission::Admission;
use crate::proxy::connect_policy::ConnectPolicy;
use crate::proxy::egress::Egress;
use crate::proxy::upstream::{ClientOptions, UpstreamClient};
use crate::proxy::App;
use crate::routes::{RouteTable, Routes};
use crate::store::sealed::{SealedStore, Sealer};
use crate::store::timed::TimedStore;
use crate::store::{self, StoreError, StoreUrl};

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
    pub sealer: Option<Sealer>,
    pub admin: AdminSettings,
    pub store_url: StoreUrl,
    pub default_client: UpstreamClient,
}

impl Parts {
    pub fn check(config: &Config) -> Result<Parts, ConfigError> {
        let store_url =
            StoreUrl::parse(&config.store.url).map_err(|m| config.invalid("store.url", m))?;
        let egress = Arc::new(Egress::build(config)?);
        let default_client = UpstreamClient::new(&ClientOptions {
            extra_roots: None,
            connect_to: None,
            connect_timeout: std::time::Duration::from_secs(10),
            pool_idle_timeout: config.server.pool_idle_timeout.0,
            egress: Some(egress.clone()),
        })
        .map_err(|e| config.invalid("server", e.to_string()))?;
        Ok(Parts {
            routes: Routes::build(config)?,
            connect: ConnectPolicy::build(config)?,
            tenants: Tenants::build(config)?,
            egress,
            sealer: Sealer::load(&config.encryption)
                .map_err(|e| config.invalid(e.field, e.message))?,
            admin: AdminSettings::from_config(config)?,
            store_url,
            default_client,
        })
    }
}

/// The proxy's runtime state, its store opened, and the admin settings.
pub async fn build(config: &Config) -> Result<(Arc<App>, AdminSettings), StartError> {
    let parts = Parts::check(config)?;
    let metrics = Arc::new(Metrics::new());
    let store = store::open_with(
        &config.store.url,
        &config.store.namespace,
        &config.store.sqlite_synchronous,
        config.store.op_timeout.0,
    )
    .await?;
    let store = TimedStore::wrap(SealedStore::wrap(store, parts.sealer), metrics.clone());
    let app = App {
        routes: RouteTable::new(parts.routes),
        claims: Arc::new(
            Claims::new(store, config.store.op_timeout.0)
                .with_receipt_cache(config.server.receipt_cache_bytes),
        ),
        namespace: config.store.namespace.clone(),
        max_body_bytes: config.server.max_body_bytes,
        max_receipt_bytes: config.server.max_receipt_bytes,
        default_client: parts.default_client,
        connect: parts.connect,
        metrics,
        tenants: parts.tenants,
        egress: parts.egress,
        admission: Admission::new(
            config.server.max_forwards,
            config.server.max_forward_bytes,
            config.server.max_body_bytes,
        ),
        minted_keys: MintedKeys::default(),
    };
    Ok((Arc::new(app), parts.admin))
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
