//! The idemproxy binary under test, as a real process: started on a config, killed with
//! SIGKILL, stopped with SIGTERM, restarted on the same store.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::redis::RedisServer;
use super::Backend;

/// A store for proxies under test: a SQLite file in a temp dir, or a redis-server of its own.
pub struct StoreFixture {
    pub dir: tempfile::TempDir,
    pub redis: Option<RedisServer>,
}

impl StoreFixture {
    pub fn new(backend: Backend) -> StoreFixture {
        StoreFixture {
            dir: tempfile::tempdir().expect("tempdir"),
            redis: (backend == Backend::Redis).then(RedisServer::start),
        }
    }

    pub fn url(&self) -> String {
        match &self.redis {
            Some(r) => r.url(),
            None => format!("sqlite://{}", self.dir.path().join("claims.db").display()),
        }
    }

    pub fn redis(&mut self) -> &mut RedisServer {
        self.redis.as_mut().expect("this fixture runs on Redis")
    }
}

/// A config with one store and the given `[[routes]]` blocks (and any extra top-level TOML).
pub fn config(store_url: &str, extra: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshutdown_grace = \"5s\"\n\n[store]\nurl = \"{store_url}\"\nop_timeout = \"500ms\"\n\n{extra}\n"
    )
}

/// A route to the fake provider at `port`, reachable as `/{name}` and as host `{name}.test`.
pub fn route(name: &str, port: u16, options: &str) -> String {
    format!(
        "[[routes]]\nname = \"{name}\"\nhost = \"{name}.test\"\nprefix = \"/{name}\"\nupstream = \"http://{name}.test\"\nconnect_to = \"127.0.0.1:{port}\"\n{options}\n"
    )
}

pub struct Proxy {
    pub addr: SocketAddr,
    /// The admin listener, when the config sets `server.admin_listen`.
    pub admin: Option<SocketAddr>,
    /// Extra environment for the process (tokens, secrets, keys).
    env: Vec<(String, String)>,
    child: Option<Child>,
    dir: PathBuf,
    config_path: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

impl Proxy {
    /// Starts idemproxy on this config text, in a temp dir of its own.
    pub fn start(config_text: &str) -> Proxy {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut p = Self::start_in(tmp.path(), config_text);
        p._tmp = Some(tmp);
        p
    }

    pub fn start_in(dir: &Path, config_text: &str) -> Proxy {
        Self::start_in_with_env(dir, config_text, &[])
    }

    /// Starts with extra environment variables (admin token, tenant secrets, receipt key).
    pub fn start_with_env(config_text: &str, env: &[(&str, &str)]) -> Proxy {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut p = Self::start_in_with_env(tmp.path(), config_text, env);
        p._tmp = Some(tmp);
        p
    }

    pub fn start_in_with_env(dir: &Path, config_text: &str, env: &[(&str, &str)]) -> Proxy {
        let config_path = dir.join("idemproxy.toml");
        std::fs::write(&config_path, config_text).expect("write config");
        let mut p = Proxy {
            addr: super::loopback(0),
            admin: None,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            child: None,
            dir: dir.to_path_buf(),
            config_path,
            _tmp: None,
        };
        p.spawn();
        p
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("proxy.log"))
            .expect("open proxy log");
        let mut child = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .arg("serve")
            .arg("--config")
            .arg(&self.config_path)
            .current_dir(&self.dir)
            .env("IDEMPROXY_LOG", "info,idemproxy=debug")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawn idemproxy");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("idemproxy listening proxy=") {
                    let mut words = rest.split_whitespace();
                    let addr = words.next().unwrap_or_default().to_string();
                    let admin = words
                        .find_map(|w| w.strip_prefix("admin="))
                        .map(String::from);
                    let _ = tx.send((addr, admin));
                }
            }
        });
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok((addr, admin)) => {
                self.addr = addr.parse().expect("listen address");
                self.admin = admin.map(|a| a.parse().expect("admin address"));
            }
            Err(_) => {
                let _ = child.kill();
                panic!("idemproxy did not start; log:\n{}", self.logs());
            }
        }
        self.child = Some(child);
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(self.dir.join("proxy.log")).unwrap_or_default()
    }

    /// SIGKILL: no graceful anything.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then wait for the process to exit.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("proxy is running");
        let _ = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status();
        c.wait().expect("wait for proxy")
    }

    /// SIGHUP: the proxy re-reads its config file.
    pub fn hangup(&self) {
        let c = self.child.as_ref().expect("proxy is running");
        let status = Command::new("kill")
            .args(["-HUP", &c.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -HUP failed");
    }

    /// Replaces the config file the proxy was started on (for a reload or a restart).
    pub fn write_config(&self, text: &str) {
        std::fs::write(&self.config_path, text).expect("write config");
    }

    /// Starts again on the same config and store (on a new port).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// `http://ADMIN` for the admin listener.
    pub fn admin_url(&self) -> String {
        format!(
            "http://{}",
            self.admin.expect("this proxy has an admin listener")
        )
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.kill();
    }
}
