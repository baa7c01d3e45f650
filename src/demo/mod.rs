//! `idemproxy demo`: the proxy in front of stand-in providers on this machine, for trying it
//! without an account anywhere. The config (by default `config/examples/local.toml`, built
//! into the binary, so the demo runs from any directory) names the routes; every route whose
//! upstream is dialled on this machine gets a stand-in there: a Stripe-shaped one
//! (`stripe.rs`) for a `provider = "stripe"` route, a counting one (`counter.rs`) otherwise.
//! Each run starts afresh: a new store in a directory of its own, removed when the demo
//! ends, and stand-ins that count from 0. The CA (`certs/`) is kept.

pub mod counter;
pub mod stripe;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::tls::ca::{CaError, CertAuthority};
use crate::tls::leaf_cache::LeafCache;

/// The shipped demo config, for a demo run anywhere.
pub const BUILT_IN: &str = include_str!("../../config/examples/local.toml");
/// How messages name the built-in config.
pub const BUILT_IN_NAME: &str = "config/examples/local.toml (built in)";

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("{}: {message}", file.display())]
    Config { file: PathBuf, message: String },
    #[error("{}: {error}", path.display())]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("the stand-in for route {route} cannot listen on {addr}: {error}")]
    Listen {
        route: String,
        addr: SocketAddr,
        error: std::io::Error,
    },
    #[error(transparent)]
    Ca(#[from] CaError),
    #[error("no certificate for the Stripe stand-in's host {host}: {message}")]
    Leaf { host: String, message: String },
}

/// A provider the demo stands in for.
#[derive(Debug, Clone)]
pub struct StandIn {
    pub route: String,
    pub addr: SocketAddr,
    pub kind: Kind,
}

#[derive(Debug, Clone)]
pub enum Kind {
    /// Charges once per POST and counts (`GET /effects`).
    Counter,
    /// Stripe's API for `host`, over TLS with a certificate from the proxy's CA.
    Stripe { host: String },
}

/// A demo run: the config the proxy serves (a copy of the demo's with a fresh store and
/// absolute paths) in a directory of its own, which is removed when the run ends.
pub struct Run {
    pub dir: PathBuf,
    pub config: PathBuf,
    pub stand_ins: Vec<StandIn>,
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Run {
    /// Prepares a run of the config `text` (read from `source`), with paths in it relative
    /// to `cwd`.
    pub fn prepare(text: &str, source: &Path, cwd: &Path) -> Result<Run, DemoError> {
        let invalid = |message: String| DemoError::Config {
            file: source.to_path_buf(),
            message,
        };
        let mut cfg: toml::Table = text.parse().map_err(|e| invalid(format!("{e}")))?;
        let dir = std::env::temp_dir().join(format!("idemproxy-demo-{}", std::process::id()));
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |error| DemoError::Io { path, error }
        };
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        // From here on the directory goes when `run` does, also on an error.
        let mut run = Run {
            config: dir.join("demo.toml"),
            dir,
            stand_ins: Vec::new(),
        };
        let store = table(&mut cfg, "store");
        let db = run.dir.join("demo.db");
        store.insert("url".into(), format!("sqlite://{}", db.display()).into());
        let tls = table(&mut cfg, "tls");
        for field in ["ca_cert", "ca_key"] {
            absolute(tls, field, cwd);
        }
        if let Some(routes) = cfg.get_mut("routes").and_then(|r| r.as_array_mut()) {
            for route in routes.iter_mut().filter_map(|r| r.as_table_mut()) {
                absolute(route, "upstream_ca", cwd);
                if let Some(stand_in) = stand_in(route).map_err(invalid)? {
                    run.stand_ins.push(stand_in);
                }
            }
        }
        let text = toml::to_string(&cfg).map_err(|e| invalid(e.to_string()))?;
        std::fs::write(&run.config, text).map_err(io(&run.config))?;
        Ok(run)
    }

    /// Starts every stand-in; `ca`: the proxy's CA (`ca_cert`, `ca_key`), which signs the
    /// Stripe stand-in's certificate.
    pub async fn start_stand_ins(
        stand_ins: &[StandIn],
        ca: Option<(&Path, &Path)>,
    ) -> Result<(), DemoError> {
        let needs_tls = stand_ins
            .iter()
            .any(|s| matches!(s.kind, Kind::Stripe { .. }));
        let leaves = match ca {
            Some((cert, key)) if needs_tls => {
                Some(Arc::new(LeafCache::new(CertAuthority::load(cert, key)?)))
            }
            _ => None,
        };
        for s in stand_ins {
            let listener = std::net::TcpListener::bind(s.addr)
                .and_then(|l| l.set_nonblocking(true).map(|_| l))
                .and_then(tokio::net::TcpListener::from_std)
                .map_err(|error| DemoError::Listen {
                    route: s.route.clone(),
                    addr: s.addr,
                    error,
                })?;
            match &s.kind {
                Kind::Counter => {
                    tokio::spawn(counter::stand_in(listener));
                }
                Kind::Stripe { host } => {
                    let leaves = leaves.as_ref().ok_or_else(|| DemoError::Leaf {
                        host: host.clone(),
                        message: "the config has no [tls] CA to sign it".into(),
                    })?;
                    let tls = leaves
                        .server_config(host)
                        .await
                        .map_err(|e| DemoError::Leaf {
                            host: host.clone(),
                            message: e.to_string(),
                        })?;
                    tokio::spawn(stripe::stand_in(listener, tls));
                }
            }
        }
        Ok(())
    }
}

/// The section `name` of the config, made when missing.
fn table<'t>(cfg: &'t mut toml::Table, name: &str) -> &'t mut toml::Table {
    if !cfg.get(name).is_some_and(toml::Value::is_table) {
        cfg.insert(name.into(), toml::Value::Table(toml::Table::new()));
    }
    cfg.get_mut(name)
        .and_then(toml::Value::as_table_mut)
        .expect("a table is there: inserted just above when it was not")
}

/// A relative path in `t[field]` made absolute against `cwd`.
fn absolute(t: &mut toml::Table, field: &str, cwd: &Path) {
    if let Some(p) = t.get(field).and_then(|v| v.as_str()) {
        let path = cwd.join(p);
        t.insert(field.into(), path.display().to_string().into());
    }
}

/// The stand-in a route needs: one when its upstream is dialled on this machine.
fn stand_in(route: &toml::Table) -> Result<Option<StandIn>, String> {
    let text = |f: &str| route.get(f).and_then(|v| v.as_str());
    let name = text("name").unwrap_or("?").to_string();
    let upstream: http::Uri = text("upstream")
        .unwrap_or_default()
        .parse()
        .map_err(|e| format!("route {name}: upstream is not a URL: {e}"))?;
    let host = upstream.host().unwrap_or_default().to_string();
    let port = upstream
        .port_u16()
        .unwrap_or(if upstream.scheme_str() == Some("https") {
            443
        } else {
            80
        });
    let dialled = match text("connect_to") {
        Some(to) => to.to_string(),
        None => format!("{host}:{port}"),
    };
    let Ok(addr) = dialled.parse::<SocketAddr>() else {
        return Ok(None);
    };
    if !addr.ip().is_loopback() {
        return Ok(None);
    }
    let kind = match (text("provider"), upstream.scheme_str()) {
        (Some("stripe"), Some("https")) => Kind::Stripe { host },
        (_, Some("http")) => Kind::Counter,
        _ => {
            return Err(format!(
                "route {name}: the demo stands in for http:// upstreams, and for https:// ones with provider = \"stripe\""
            ))
        }
    };
    Ok(Some(StandIn {
        route: name,
        addr,
        kind,
    }))
}

/// What `idemproxy demo` prints once the proxy listens: the commands to run and what they
/// show.
pub fn instructions(proxy: SocketAddr, stand_ins: &[StandIn], shop_host: Option<&str>) -> String {
    let mut out = format!("\nidemproxy demo: idemproxy on http://{proxy}, in front of stand-in providers on this machine:\n");
    for s in stand_ins {
        match &s.kind {
            Kind::Counter => out.push_str(&format!(
                "  {}: http://{} (it counts what it does: GET /effects)\n",
                s.route, s.addr
            )),
            Kind::Stripe { host } => out.push_str(&format!(
                "  {}: https://{host} on {} (Stripe's API for sk_test_ keys, with a certificate from the CA in certs/)\n",
                s.route, s.addr
            )),
        }
    }
    out.push_str("Each demo run starts with an empty store; the stand-ins count from 0.\n");
    if let Some(counter) = stand_ins.iter().find(|s| matches!(s.kind, Kind::Counter)) {
        let (route, provider) = (&counter.route, counter.addr);
        out.push_str(&format!(
            "\nIn another terminal, charge twice with the same key, then ask the provider how often it charged:\n\n\
             \x20 curl -si http://{proxy}/{route}/v1/charges -H 'Idempotency-Key: order-1' -d amount=1500   # Idempotent-Replayed: false\n\
             \x20 curl -si http://{proxy}/{route}/v1/charges -H 'Idempotency-Key: order-1' -d amount=1500   # Idempotent-Replayed: true, same body\n\
             \x20 curl -s http://{provider}/effects                                                      # {{\"effects\":1}}\n"
        ));
        if let Some(host) = shop_host {
            out.push_str(&format!(
                "\nThe same through HTTPS_PROXY (the proxy intercepts {host} with the CA in certs/):\n\n\
                 \x20 curl -si --proxy http://{proxy} --cacert certs/ca.pem https://{host}/v1/charges -H 'Idempotency-Key: order-2' -d amount=900\n\
                 \x20 (twice: the second says Idempotent-Replayed: true)\n"
            ));
        }
    }
    if stand_ins
        .iter()
        .any(|s| matches!(s.kind, Kind::Stripe { .. }))
    {
        out.push_str(
            "\nThe official Stripe SDK through HTTPS_PROXY (README.md: \"The official Stripe SDK, no Stripe account needed\"):\n\n\
             \x20 eval \"$(idemproxy env --dir certs)\"   # the worker setup: proxy, CA, the SDK's start-up hook\n\
             \x20 python3 pay.py                         # stripe.api_key = \"sk_test_...\"; twice: the same charge\n",
        );
    }
    out.push_str("\nStop with Ctrl-C.\n");
    out
}
