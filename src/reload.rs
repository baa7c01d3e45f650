//! Reloading the config without a restart (SIGHUP, or `POST /v1/reload` on the admin
//! listener). The file is read and checked exactly as `check-config` and `serve` check it;
//! its routes, with the upstream CAs they name, then replace the running ones. Requests
//! under way keep the route they started with, and claims are untouched: the store is not
//! reopened. Every other section is read only at start-up, so a file that changes one is
//! refused, naming it, and the running config is kept.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use http::StatusCode;

use crate::admin::Reload;
use crate::app::{self, Parts};
use crate::config::{Config, ConfigError};
use crate::http::problem::Problem;
use crate::proxy::App;

#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error(transparent)]
    Invalid(#[from] ConfigError),
    #[error("{}: {} changed, and only a restart applies {}", file.display(), sections.join(", "), if sections.len() == 1 { "it" } else { "them" })]
    NeedsRestart {
        file: PathBuf,
        sections: Vec<&'static str>,
    },
}

impl ReloadError {
    /// The metric label.
    fn result(&self) -> &'static str {
        match self {
            ReloadError::Invalid(_) => "invalid",
            ReloadError::NeedsRestart { .. } => "needs_restart",
        }
    }
}

/// Re-reads one config file into one running proxy.
pub struct Reloader {
    path: PathBuf,
    app: Arc<App>,
    /// The config in effect; held while a reload runs, so two never interleave.
    running: Mutex<Config>,
}

impl Reloader {
    /// `config` is what the proxy started with, read from `path`.
    pub fn new(path: PathBuf, app: Arc<App>, config: Config) -> Reloader {
        Reloader {
            path,
            app,
            running: Mutex::new(config),
        }
    }

    /// Reads, checks and applies the file; returns the names of the routes now in effect.
    pub fn reload(&self) -> Result<Vec<String>, ReloadError> {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let mut config = Config::load(&self.path)?;
        // The environment is the one the proxy started in, as a process's would be.
        config.env = running.env.clone();
        let parts = Parts::check(&config)?;
        let sections = restart_only_changes(&running, &config);
        if !sections.is_empty() {
            return Err(ReloadError::NeedsRestart {
                file: self.path.clone(),
                sections,
            });
        }
        app::spend_metrics(&self.app.metrics, &parts.routes);
        self.app.routes.replace(parts.routes);
        if let Some(warning) = app::interception_warning(&config, self.app.connect.leaves.is_some())
        {
            tracing::warn!("{warning}");
        }
        let names = config.routes.iter().map(|r| r.name.clone()).collect();
        *running = config;
        Ok(names)
    }

    /// [`Reloader::reload`], logged and counted: what SIGHUP and the admin API both run.
    /// `by` says which asked.
    pub fn reload_logged(&self, by: &str) -> Result<Vec<String>, ReloadError> {
        let result = self.reload();
        match &result {
            Ok(routes) => {
                self.app.metrics.config_reload("applied");
                tracing::info!(by, routes = %routes.join(", "), "config reloaded");
            }
            Err(e) => {
                self.app.metrics.config_reload(e.result());
                tracing::warn!(by, "config reload refused; the running config is kept: {e}");
            }
        }
        result
    }
}

impl Reload for Reloader {
    fn reload(&self) -> Result<Vec<String>, Problem> {
        self.reload_logged("admin API").map_err(|e| {
            let (status, slug, title) = match e {
                ReloadError::Invalid(_) => (
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "config-invalid",
                    "Config not valid",
                ),
                ReloadError::NeedsRestart { .. } => (
                    StatusCode::CONFLICT,
                    "reload-needs-restart",
                    "Restart needed",
                ),
            };
            Problem::new(
                status,
                slug,
                format!("{e}. Nothing was reloaded: the running config is kept."),
            )
            .titled(title)
        })
    }
}

/// The sections of `new` that differ from `old` and that only a restart applies: everything
/// but `[[routes]]`. Compared as parsed, so a default written out is no change.
fn restart_only_changes(old: &Config, new: &Config) -> Vec<&'static str> {
    type Section = (&'static str, fn(&Config) -> String);
    let sections: [Section; 8] = [
        ("[server]", |c| format!("{:?}", c.server)),
        ("[store]", |c| format!("{:?}", c.store)),
        ("[tls]", |c| format!("{:?}", c.tls)),
        ("[admin]", |c| format!("{:?}", c.admin)),
        ("[[tenants]]", |c| format!("{:?}", c.tenants)),
        ("[egress]", |c| format!("{:?}", c.egress)),
        ("[encryption]", |c| format!("{:?}", c.encryption)),
        ("[approvals]", |c| format!("{:?}", c.approvals)),
    ];
    let mut changed: Vec<&'static str> = sections
        .iter()
        .filter(|(_, of)| of(old) != of(new))
        .map(|(name, _)| *name)
        .collect();
    // A section added to the config later and not listed above is caught here.
    if changed.is_empty() && all_but_routes(old) != all_but_routes(new) {
        changed.push("a section other than [[routes]]");
    }
    changed
}

fn all_but_routes(config: &Config) -> String {
    let mut c = config.clone();
    c.routes.clear();
    c.source = PathBuf::new();
    format!("{c:?}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn parse(text: &str) -> Config {
        Config::parse(text, Path::new("t.toml")).expect("config")
    }

    #[test]
    fn only_sections_besides_routes_need_a_restart() {
        let old = parse("[store]\nurl = \"sqlite://a.db\"\n[[routes]]\nname = \"a\"\nupstream = \"http://a.test\"\n");
        let routes_only = parse("[store]\nurl = \"sqlite://a.db\"\n[[routes]]\nname = \"b\"\nupstream = \"http://b.test\"\n");
        assert!(restart_only_changes(&old, &routes_only).is_empty());
        let default_written_out =
            parse("[server]\nlisten = \"127.0.0.1:8080\"\n[store]\nurl = \"sqlite://a.db\"\n");
        assert!(restart_only_changes(&old, &default_written_out).is_empty());
        let moved = parse("[server]\nlisten = \"127.0.0.1:9\"\n[store]\nurl = \"sqlite://b.db\"\n");
        assert_eq!(
            restart_only_changes(&old, &moved),
            vec!["[server]", "[store]"]
        );
    }
}
