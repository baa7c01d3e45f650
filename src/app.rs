//! Everything a request needs, built once at start-up.

use std::sync::Arc;

use crate::config::{Config, ConfigError};
use crate::idempotency::claims::Claims;
use crate::proxy::connect::ConnectPolicy;
use crate::proxy::upstream::{ClientOptions, UpstreamClient};
use crate::routes::Routes;
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
        let store = store::open_with(
            &config.store.url,
            &config.store.namespace,
            &config.store.sqlite_synchronous,
            config.store.op_timeout.0,
        )
        .await?;
        let default_client = UpstreamClient::new(&ClientOptions {
            extra_roots: None,
            connect_to: None,
            connect_timeout: std::time::Duration::from_secs(10),
            pool_idle_timeout: config.server.pool_idle_timeout.0,
        })
        .map_err(|m| config.invalid("server", m))?;
        Ok(Arc::new(App {
            routes,
            claims: Arc::new(Claims::new(store, config.store.op_timeout.0)),
            namespace: config.store.namespace.clone(),
            max_body_bytes: config.server.max_body_bytes,
            max_receipt_bytes: config.server.max_receipt_bytes,
            default_client,
            connect,
        }))
    }
}
