//! The proxy under test, on a config of its own, in one of two tiers with one API:
//! - `Proxy::start`: the idemproxy binary as a real process, killed with SIGKILL, stopped with
//!   SIGTERM, restarted on the same store: for faults, restarts, signals and logs.
//! - `Proxy::in_process`: the same server the binary runs (`idemproxy::serve`), on a runtime
//!   of its own inside the test process, behind the same sockets: for what the pipeline does
//!   with a request, with no process started and no binary loaded.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::postgres::PostgresServer;
use super::redis::{tls_lines, RedisCluster, RedisSentinels, RedisServer, RedisTls};
use super::Backend;

/// A store for proxies under test: a SQLite file in a temp dir, or servers of its own.
pub struct StoreFixture {
    pub dir: tempfile::TempDir,
    /// Plain or TLS.
    pub redis: Option<RedisServer>,
    pub tls: Option<std::sync::Arc<RedisTls>>,
    pub cluster: Option<RedisCluster>,
    pub sentinels: Option<RedisSentinels>,
    pub postgres: Option<PostgresServer>,
}

impl StoreFixture {
    pub fn new(backend: Backend) -> StoreFixture {
        let tls = (backend == Backend::RedisTls).then(|| std::sync::Arc::new(RedisTls::new(true)));
        StoreFixture {
            dir: tempfile::tempdir().expect("tempdir"),
            redis: match (backend, &tls) {
                (Backend::Redis, _) => Some(RedisServer::start()),
                (Backend::RedisTls, Some(tls)) => Some(RedisServer::start_tls(tls.clone())),
                _ => None,
            },
            tls,
            cluster: (backend == Backend::RedisCluster).then(|| RedisCluster::start(3, 0)),
            sentinels: (backend == Backend::RedisSentinel).then(RedisSentinels::start),
            postgres: (backend == Backend::Postgres).then(PostgresServer::start),
        }
    }

    pub fn url(&self) -> String {
        if let Some(r) = &self.redis {
            return r.url();
        }
        if let Some(c) = &self.cluster {
            return c.url();
        }
        if let Some(s) = &self.sentinels {
            return s.url();
        }
        if let Some(p) = &self.postgres {
            return p.url();
        }
        format!("sqlite://{}", self.dir.path().join("claims.db").display())
    }

    /// The `[store]` lines naming this store: its URL, and the TLS files it needs.
    pub fn store_lines(&self) -> String {
        let tls = self.tls.as_deref().map(tls_lines).unwrap_or_default();
        format!("url = \"{}\"\n{tls}", self.url())
    }

    /// The same as the `[store]` section a proxy would read (op_timeout as `config` sets it).
    pub fn store_config(&self) -> idemproxy::config::StoreConfig {
        let (tls_ca, tls_cert, tls_key) = match self.tls.as_deref() {
            Some(tls) => {
                let (cert, key) = tls.client();
                (Some(tls.ca()), Some(cert), Some(key))
            }
            None => (None, None, None),
        };
        idemproxy::config::StoreConfig {
            url: self.url(),
            tls_ca,
            tls_cert,
            tls_key,
            ..Default::default()
        }
    }

    /// A Cluster of three masters with a replica each, so that a master can fail over.
    pub fn cluster_with_replicas() -> StoreFixture {
        StoreFixture {
            dir: tempfile::tempdir().expect("tempdir"),
            redis: None,
            tls: None,
            cluster: Some(RedisCluster::start(3, 1)),
            sentinels: None,
            postgres: None,
        }
    }

    /// The faults a chaos run may inflict on this store (none on SQLite: it is a file).
    pub fn faults(&self) -> &'static [&'static str] {
        if self.redis.is_some() {
            &["redis SIGKILL+restart", "redis SIGSTOP+SIGCONT"]
        } else if self.postgres.is_some() {
            &[
                "postgres crash+restart",
                "postgres SIGSTOP+SIGCONT",
                "postgres connections killed",
            ]
        } else if self.sentinels.is_some() {
            &["sentinel master SIGKILL+failover"]
        } else if self.cluster.is_some() {
            &["cluster master SIGKILL+failover"]
        } else {
            &[]
        }
    }

    /// Inflicts one of `faults()`, then lets the store recover (bounded waits).
    pub fn inflict(&mut self, fault: &str, rng: &mut impl rand::Rng) {
        let pause = |rng: &mut dyn rand::RngCore, lo: u64, hi: u64| {
            std::thread::sleep(Duration::from_millis(rand::Rng::random_range(rng, lo..hi)))
        };
        match fault {
            "redis SIGKILL+restart" => {
                self.redis().kill();
                pause(rng, 100, 1_000);
                self.redis().restart();
            }
            "redis SIGSTOP+SIGCONT" => {
                self.redis().pause();
                pause(rng, 300, 1_500);
                self.redis().resume();
            }
            "postgres crash+restart" => {
                self.postgres().crash();
                pause(rng, 100, 1_000);
                self.postgres().start_again();
            }
            "postgres SIGSTOP+SIGCONT" => {
                self.postgres().pause();
                pause(rng, 300, 1_500);
                self.postgres().resume();
            }
            "postgres connections killed" => {
                self.postgres().psql(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                     WHERE application_name = 'idemproxy'",
                );
            }
            "sentinel master SIGKILL+failover" => {
                let s = self.sentinels.as_mut().expect("sentinels");
                let old = s.master_port().expect("a master");
                s.master().kill();
                s.until_failed_over(old, Duration::from_secs(20));
                s.rejoin_as_replica(old);
                s.until_replicated(Duration::from_secs(20));
            }
            "cluster master SIGKILL+failover" => {
                let c = self.cluster.as_mut().expect("cluster");
                let masters: Vec<usize> = (0..c.nodes.len()).filter(|i| c.is_master(*i)).collect();
                let victim = masters[rand::Rng::random_range(rng, 0..masters.len())];
                c.kill_and_fail_over(victim, Duration::from_secs(20));
                c.nodes[victim].restart();
                c.until_healthy(Duration::from_secs(20));
            }
            other => panic!("no such store fault: {other}"),
        }
    }

    /// Makes the store unreachable for the proxy until the returned guard is dropped: Redis
    /// and a Cluster killed, PostgreSQL stopped, and SQLite's write lock held by another
    /// connection (the writer thread blocks, so every claim runs into `op_timeout`).
    pub fn make_unreachable(&mut self) -> Unreachable {
        if let Some(r) = self.redis.as_mut() {
            r.kill();
            return Unreachable { release: None };
        }
        if let Some(c) = self.cluster.as_mut() {
            for node in c.nodes.iter_mut() {
                node.kill();
            }
            return Unreachable { release: None };
        }
        if let Some(p) = self.postgres.as_mut() {
            p.stop();
            return Unreachable { release: None };
        }
        assert!(
            self.sentinels.is_none(),
            "make_unreachable: not written for Sentinel"
        );
        let db = self.dir.path().join("claims.db");
        let (locked_tx, locked_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let conn = rusqlite::Connection::open(&db).expect("open the proxy's database");
            conn.busy_timeout(Duration::from_secs(10))
                .expect("busy timeout");
            conn.execute_batch("BEGIN IMMEDIATE")
                .expect("take the write lock");
            locked_tx.send(()).expect("signal");
            // Held until the guard goes, at most a minute.
            let _ = release_rx.recv_timeout(Duration::from_secs(60));
            let _ = conn.execute_batch("COMMIT");
        });
        locked_rx.recv().expect("the write lock is held");
        Unreachable {
            release: Some((release_tx, holder)),
        }
    }

    pub fn redis(&mut self) -> &mut RedisServer {
        self.redis.as_mut().expect("this fixture runs on Redis")
    }

    pub fn postgres(&mut self) -> &mut PostgresServer {
        self.postgres
            .as_mut()
            .expect("this fixture runs on PostgreSQL")
    }
}

/// A store made unreachable by `StoreFixture::make_unreachable`; SQLite's lock is let go when
/// it is dropped (the servers stay down).
pub struct Unreachable {
    release: Option<(std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>)>,
}

impl Drop for Unreachable {
    fn drop(&mut self) {
        if let Some((tx, holder)) = self.release.take() {
            let _ = tx.send(());
            let _ = holder.join();
        }
    }
}

/// A config on `store` (its URL and TLS files) with the given `[[routes]]` blocks.
pub fn config_on(store: &StoreFixture, extra: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshutdown_grace = \"5s\"\n\n[store]\n{}{}\n\n{extra}\n",
        store.store_lines(),
        op_timeout_line(extra)
    )
}

/// The store deadline a test config gets: as long as its shortest lease allows (a lease must
/// outlast 1.5 × `op_timeout`), up to 2 s, never under 500 ms. A fixed 500 ms turned an
/// fsync stall on a busy 2-core machine into a 503 "store did not answer", a failure of
/// the harness's deadline rather than of the behaviour under test; suites about the
/// deadline itself (faults, chaos, topologies) write their own.
pub fn op_timeout_line(extra: &str) -> String {
    const MOST: Duration = Duration::from_secs(2);
    const LEAST: Duration = Duration::from_millis(500);
    let shortest_lease = extra
        .split('\n')
        .filter_map(|line| line.trim().strip_prefix("lease = \""))
        .filter_map(|rest| rest.split('"').next())
        .filter_map(|value| humantime::parse_duration(value).ok())
        .min();
    let deadline = match shortest_lease {
        // Whole 100 ms steps strictly below lease / 1.5.
        Some(lease) => Duration::from_millis((lease.as_millis() as u64 * 10 / 16) / 100 * 100),
        None => MOST,
    };
    format!(
        "op_timeout = \"{}ms\"",
        deadline.clamp(LEAST, MOST).as_millis()
    )
}

/// `text` with its `[store]` deadline replaced by `value` (e.g. `"5s"`).
pub fn with_op_timeout(text: &str, value: &str) -> String {
    text.lines()
        .map(|line| {
            if line.starts_with("op_timeout = ") {
                format!("op_timeout = \"{value}\"")
            } else {
                line.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A config with one store and the given `[[routes]]` blocks (and any extra top-level TOML).
pub fn config(store_url: &str, extra: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshutdown_grace = \"5s\"\n\n[store]\nurl = \"{store_url}\"\n{}\n\n{extra}\n",
        op_timeout_line(extra)
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
    running: Option<Running>,
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
            running: None,
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
        self.running = Some(Running::Process(child));
    }

    /// Starts the proxy inside this test process, in a temp dir of its own: the server the
    /// binary runs, on a runtime of its own (so a test that blocks never stalls it). Signals,
    /// kills, restarts and log files are a process's: use `start` for tests of those.
    pub fn in_process(config_text: &str) -> Proxy {
        Self::in_process_with_env(config_text, &[])
    }

    /// In-process, with environment variables of its own (admin token, tenant secrets,
    /// receipt key), set over the test process's for this proxy alone.
    /// `IDEMPROXY_TEST_PROCESSES=1` runs these as processes instead: the same tests on the
    /// other tier, to compare the two or to rule the tier out when one fails.
    pub fn in_process_with_env(config_text: &str, env: &[(&str, &str)]) -> Proxy {
        if std::env::var("IDEMPROXY_TEST_PROCESSES").is_ok_and(|v| v == "1") {
            return Self::start_with_env(config_text, env);
        }
        let tmp = tempfile::tempdir().expect("tempdir");
        let config_path = tmp.path().join("idemproxy.toml");
        std::fs::write(&config_path, config_text).expect("write config");
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let (server, addr, admin) = InProcess::start(config_path.clone(), env.clone());
        Proxy {
            addr,
            admin,
            env,
            running: Some(Running::InProcess(server)),
            dir: tmp.path().to_path_buf(),
            config_path,
            _tmp: Some(tmp),
        }
    }

    pub fn logs(&self) -> String {
        self.process_only("has no log file");
        std::fs::read_to_string(self.dir.join("proxy.log")).unwrap_or_default()
    }

    /// SIGKILL: no graceful anything.
    pub fn kill(&mut self) {
        self.process_only("cannot be killed");
        self.stop();
    }

    fn stop(&mut self) {
        match self.running.take() {
            Some(Running::Process(mut c)) => {
                let _ = c.kill();
                let _ = c.wait();
            }
            Some(Running::InProcess(server)) => server.stop(),
            None => {}
        }
    }

    /// SIGTERM, then wait for the process to exit.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut c = self.child().expect("proxy is running as a process");
        let _ = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status();
        c.wait().expect("wait for proxy")
    }

    /// SIGHUP: the proxy re-reads its config file (in-process: the reload SIGHUP runs).
    pub fn hangup(&self) {
        match self.running.as_ref().expect("proxy is running") {
            Running::Process(c) => {
                let status = Command::new("kill")
                    .args(["-HUP", &c.id().to_string()])
                    .status()
                    .expect("run kill");
                assert!(status.success(), "kill -HUP failed");
            }
            Running::InProcess(server) => {
                let _ = server.reloader.reload_logged("SIGHUP");
            }
        }
    }

    fn child(&mut self) -> Option<Child> {
        match self.running.take() {
            Some(Running::Process(c)) => Some(c),
            other => {
                self.running = other;
                None
            }
        }
    }

    /// Panics, naming what the test asked for, when this proxy runs in-process.
    fn process_only(&self, what: &str) {
        assert!(
            !matches!(self.running, Some(Running::InProcess(_))),
            "an in-process proxy {what}: start this test's proxy with Proxy::start"
        );
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
        self.stop();
    }
}

enum Running {
    Process(Child),
    InProcess(InProcess),
}

/// A proxy served on a thread of the test process, with a runtime of its own.
struct InProcess {
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
    reloader: std::sync::Arc<idemproxy::reload::Reloader>,
}

type Started = (
    SocketAddr,
    Option<SocketAddr>,
    std::sync::Arc<idemproxy::reload::Reloader>,
);

impl InProcess {
    /// Listening on the config at `path` (as `idemproxy serve --config path` would), or a
    /// panic with the error it would have exited with.
    fn start(
        path: PathBuf,
        env: Vec<(String, String)>,
    ) -> (InProcess, SocketAddr, Option<SocketAddr>) {
        let (ready, started) = std::sync::mpsc::channel::<Result<Started, String>>();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let mut config = match idemproxy::config::Config::load(&path) {
            Ok(config) => config,
            Err(e) => panic!("idemproxy did not start in-process: {e}"),
        };
        config.env = idemproxy::config::Environment::with(env);
        let thread = std::thread::Builder::new()
            .name("in-process-proxy".into())
            .spawn(move || {
                // The runtime the binary would run this config on.
                let runtime =
                    idemproxy::serve::runtime(&config).expect("a runtime for the in-process proxy");
                runtime.block_on(async move {
                    let listening = match idemproxy::serve::listen(path, config).await {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = ready.send(Err(e.to_string()));
                            return;
                        }
                    };
                    let _ = ready.send(Ok((
                        listening.proxy,
                        listening.admin,
                        listening.reloader.clone(),
                    )));
                    // Stopped when the test is over: nothing of it is left to settle.
                    tokio::select! {
                        () = listening.serve(std::future::pending()) => {}
                        _ = stopped => {}
                    }
                });
                runtime.shutdown_background();
            })
            .expect("spawn the in-process proxy's thread");
        match started.recv_timeout(Duration::from_secs(20)) {
            Ok(Ok((addr, admin, reloader))) => (
                InProcess {
                    stop,
                    thread,
                    reloader,
                },
                addr,
                admin,
            ),
            Ok(Err(e)) => panic!("idemproxy did not start in-process: {e}"),
            Err(_) => panic!("idemproxy did not start in-process within 20s"),
        }
    }

    fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.thread.join();
    }
}

/// The proxy's Prometheus text, from its admin listener.
pub async fn metrics(proxy: &Proxy) -> String {
    let admin = proxy.admin.expect("admin listener");
    super::client::send(admin, "GET", "/metrics", &[], "")
        .await
        .expect("GET /metrics")
        .text()
}

/// One sample of Prometheus text, 0 when the series is absent.
pub fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// One sample of the proxy's metrics now, 0 when the series is absent.
pub async fn metric(proxy: &Proxy, series: &str) -> f64 {
    sample(&metrics(proxy).await, series)
}
