//! Everything a request needs, built once at start-up.

use std::sync::Arc;

use crate::auth::Tenants;
use crate::config::{Config, ConfigError};
use crate::idempotency::claims::Claims;
use crate::identity::minted_keys::MintedKeys;
use crate::metrics::{Metrics, TimedStore};
use crate::proxy::admission::Admission;
use crate::proxy::connect::ConnectPolicy;
use crate::proxy::egress::Egress;
use crate::proxy::upstream::{ClientOptions, UpstreamClient};
use crate::routes::Routes;
use crate::store::sealed::{SealedStore, Sealer};
use crate::store::{self, StoreError};

pub struct App {
    pub routes: Routes,
    pub claims: Arc<Claims>,
    pub namespace: String,
    pub max_body_bytes: usize,
    pub max_receipt_bytes: usize,
    /// For forward-proxy requests to hosts no route covers.
    pub default_client: UpstreamClient,
    /// CONNECT: allowed ports, unknown hosts, and the CA for interception.
    pub connect: ConnectPolicy,
    pub metrics: Arc<Metrics>,
    pub tenants: Tenants,
    /// Where requests no route covers may go.
    pub egress: Arc<Egress>,
    /// Bounds on protected requests being forwarded.
    pub admission: Admission,
    pub minted_keys: MintedKeys,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl App {
    pub async fn build(config: &Config) -> Result<Arc<App>, StartError> {
        let routes = Routes::build(config)?;
        let connect = ConnectPolicy::build(config)?;
        let tenants = Tenants::build(config)?;
        let egress = Arc::new(Egress::build(config)?);
        let sealer = Sealer::from_config(config)?;
        let metrics = Arc::new(Metrics::new());
        let store = store::open_with(
            &config.store.url,
            &config.store.namespace,
            &config.store.sqlite_synchronous,
            config.store.op_timeout.0,
        )
        .await?;
        let store = TimedStore::wrap(SealedStore::wrap(store, sealer), metrics.clone());
        let default_client = UpstreamClient::new(&ClientOptions {
            extra_roots: None,
            connect_to: None,
            connect_timeout: std::time::Duration::from_secs(10),
            pool_idle_timeout: config.server.pool_idle_timeout.0,
            egress: Some(egress.clone()),
        })
        .map_err(|m| config.invalid("server", m))?;
        Ok(Arc::new(App {
            routes,
            claims: Arc::new(
                Claims::new(store, config.store.op_timeout.0)
                    .with_receipt_cache(config.server.receipt_cache_bytes),
            ),
            namespace: config.store.namespace.clone(),
            max_body_bytes: config.server.max_body_bytes,
            max_receipt_bytes: config.server.max_receipt_bytes,
            default_client,
            connect,
            metrics,
            tenants,
            egress,
            admission: Admission::new(
                config.server.max_forwards,
                config.server.max_forward_bytes,
                config.server.max_body_bytes,
            ),
            minted_keys: MintedKeys::default(),
        }))
    }
}
