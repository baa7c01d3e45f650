//! The proxy started from its config file: built, listening on its proxy and admin
//! addresses, then serving until told to stop. `idemproxy serve` runs exactly this (adding
//! only what belongs to a process: signals and the listening line), and so does the test
//! tier that runs the proxy inside the test process.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::TcpListener;

use crate::app::{self, StartError};
use crate::config::{parse_listen, Config};
use crate::proxy::server::{serve, ServerOptions};
use crate::proxy::App;
use crate::reload::Reloader;

/// A proxy built and listening, not yet serving.
pub struct Listening {
    pub app: Arc<App>,
    /// Re-reads the config file the proxy started on (SIGHUP, the admin API).
    pub reloader: Arc<Reloader>,
    pub proxy: SocketAddr,
    /// The admin listener's address, when the config names one (already serving).
    pub admin: Option<SocketAddr>,
    listener: TcpListener,
    options: ServerOptions,
}

/// Builds the proxy from `config` (read from `path`, which reloads read again), binds its
/// listener and starts its admin listener.
pub async fn listen(path: PathBuf, config: Config) -> Result<Listening, StartError> {
    let (app, admin_settings) = app::build(&config).await?;
    if let Some(warning) = app.claims.store().durability_warning().await {
        tracing::warn!("{warning}");
    }
    if let Some(warning) = app::interception_warning(&config, app.connect.leaves.is_some()) {
        tracing::warn!("{warning}");
    }
    let listener = bind(&config, "server.listen", &config.server.listen).await?;
    let proxy = local_addr(&config, "server.listen", &listener)?;
    let reloader = Arc::new(Reloader::new(path, app.clone(), config.clone()));
    let admin = match &config.server.admin_listen {
        Some(listen) => {
            let listener = bind(&config, "server.admin_listen", listen).await?;
            let local = local_addr(&config, "server.admin_listen", &listener)?;
            let admin =
                crate::admin::Admin::new(app.clone(), admin_settings).with_reload(reloader.clone());
            if !admin.key_api_enabled() {
                tracing::warn!("admin key API and console disabled: no token in admin.token_env / admin.token_sha256 / [[admin.tokens]]");
            }
            for warning in crate::admin::warnings(&config) {
                tracing::warn!("{warning}");
            }
            tokio::spawn(crate::admin::serve(Arc::new(admin), listener));
            Some(local)
        }
        None => None,
    };
    for warning in config.warnings() {
        tracing::warn!("{warning}");
    }
    tracing::info!(local = %proxy, store = %config.store.url, routes = config.routes.len(), "idemproxy started");
    say_where_accounts_come_from(&config);
    let options = ServerOptions {
        header_read_timeout: config.server.header_read_timeout.0,
        shutdown_grace: config.server.shutdown_grace.0,
        max_connections: config.server.max_connections,
        max_header_bytes: config.server.max_header_bytes,
    };
    Ok(Listening {
        app,
        reloader,
        proxy,
        admin,
        listener,
        options,
    })
}

impl Listening {
    /// Serves until `shutdown` resolves, then lets in-flight requests settle within the
    /// grace period, intercepted HTTPS connections included.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) {
        let grace = self.options.shutdown_grace;
        serve(self.app.clone(), self.listener, self.options, shutdown).await;
        // Intercepted HTTPS connections are not the listener's; let their requests settle too.
        if !self.app.connect.drain_intercepted(grace).await {
            tracing::warn!("grace period over for intercepted HTTPS connections; unsettled claims become UNKNOWN when their leases run out");
        }
    }
}

/// `server.worker_threads` threads, by default one per CPU this process may run on. With
/// one (a container with one CPU, `taskset`), the single-threaded scheduler does the same
/// work without the work-stealing machinery, which there only costs (about 15% of
/// throughput in the benchmark).
pub fn runtime(config: &Config) -> std::io::Result<tokio::runtime::Runtime> {
    let threads = match config.server.worker_threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let mut builder = if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads);
        b
    };
    builder.enable_all().build()
}

async fn bind(config: &Config, field: &str, listen: &str) -> Result<TcpListener, StartError> {
    let addr = parse_listen(listen).map_err(|m| config.invalid(field, m))?;
    TcpListener::bind(addr).await.map_err(|e| {
        config
            .invalid(field, format!("cannot listen on {addr}: {e}"))
            .into()
    })
}

fn local_addr(
    config: &Config,
    field: &str,
    listener: &TcpListener,
) -> Result<SocketAddr, StartError> {
    listener.local_addr().map_err(|e| {
        config
            .invalid(field, format!("the listener has no local address: {e}"))
            .into()
    })
}

/// On a route without a profile the account is read from credential-looking headers and
/// query and body fields: said once per route at start, so an operator sees what splits
/// accounts (and a per-request field that would split every retry).
fn say_where_accounts_come_from(config: &Config) {
    for r in config
        .routes
        .iter()
        .filter(|r| r.provider.is_none() && r.account.is_none())
    {
        let fields = match &r.credential_fields {
            Some(f) => f.join(", "),
            None => crate::identity::account::CREDENTIAL_FIELDS.join(", "),
        };
        let headers = match &r.credential_headers {
            Some(h) => h.join(", "),
            None => "every credential-looking header".to_string(),
        };
        tracing::info!(route = %r.name, %headers, query_and_body_fields = %fields, "the route's account is read from these (credential_fields, credential_headers to change)");
        eprintln!(
            "route {}: account from headers: {headers}; query and body fields: {fields}",
            r.name
        );
    }
}
