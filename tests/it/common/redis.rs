//! A redis-server of the test's own, on a free port, that the test can stop, kill, pause
//! and restart; the same over TLS; a local Redis Cluster; a master, a replica and three
//! sentinels.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::pki::TestPki;

/// TLS files a server (and its clients) use: one CA, a server leaf for 127.0.0.1, and a
/// client leaf for mutual TLS.
pub struct RedisTls {
    pub pki: TestPki,
    dir: tempfile::TempDir,
    /// The server asks clients for a certificate signed by the CA.
    pub require_client_cert: bool,
}

impl RedisTls {
    pub fn new(require_client_cert: bool) -> RedisTls {
        let pki = TestPki::new("redis test CA");
        let dir = tempfile::tempdir().expect("tempdir");
        pki.write_leaf(&["127.0.0.1", "localhost"], &dir.path().join("server"));
        pki.write_leaf(&["idemproxy-client"], &dir.path().join("client"));
        RedisTls {
            pki,
            dir,
            require_client_cert,
        }
    }

    pub fn ca(&self) -> PathBuf {
        self.pki.ca_path()
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The client certificate and key (PEM).
    pub fn client(&self) -> (PathBuf, PathBuf) {
        (self.file("client.pem"), self.file("client.key"))
    }

    /// redis-cli's TLS flags, with the client certificate.
    fn cli_args(&self) -> Vec<String> {
        let (cert, key) = self.client();
        vec![
            "--tls".into(),
            "--cacert".into(),
            self.ca().display().to_string(),
            "--cert".into(),
            cert.display().to_string(),
            "--key".into(),
            key.display().to_string(),
        ]
    }
}

pub struct RedisServer {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    appendonly: bool,
    tls: Option<std::sync::Arc<RedisTls>>,
    /// Further redis-server arguments (cluster mode, replication).
    extra: Vec<String>,
}

impl RedisServer {
    /// Starts with AOF on (`appendfsync always`), so a restart keeps what was acknowledged.
    pub fn start() -> RedisServer {
        Self::start_with(true)
    }

    pub fn start_with(appendonly: bool) -> RedisServer {
        Self::start_full(appendonly, None, Vec::new())
    }

    /// Only a TLS port (AOF on), with the certificates of `tls`.
    pub fn start_tls(tls: std::sync::Arc<RedisTls>) -> RedisServer {
        Self::start_full(true, Some(tls), Vec::new())
    }

    /// AOF on, with further arguments (`--cluster-enabled yes`, `--replicaof …`).
    pub fn start_args(extra: Vec<String>) -> RedisServer {
        Self::start_full(true, None, extra)
    }

    fn start_full(
        appendonly: bool,
        tls: Option<std::sync::Arc<RedisTls>>,
        extra: Vec<String>,
    ) -> RedisServer {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut server = RedisServer {
            port: super::free_port(),
            dir,
            child: None,
            appendonly,
            tls,
            extra,
        };
        server.spawn();
        server
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://127.0.0.1:{}/0", self.port)
    }

    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    fn spawn(&mut self) {
        let mut ports = vec!["--port".to_string(), self.port.to_string()];
        if let Some(tls) = &self.tls {
            ports = vec![
                "--port".into(),
                "0".into(),
                "--tls-port".into(),
                self.port.to_string(),
            ];
            for (flag, file) in [
                ("--tls-cert-file", "server.pem"),
                ("--tls-key-file", "server.key"),
            ] {
                ports.extend([flag.to_string(), tls.file(file).display().to_string()]);
            }
            ports.extend([
                "--tls-ca-cert-file".to_string(),
                tls.ca().display().to_string(),
                "--tls-auth-clients".to_string(),
                if tls.require_client_cert { "yes" } else { "no" }.to_string(),
                "--tls-replication".to_string(),
                "yes".to_string(),
            ]);
        }
        let child = Command::new("redis-server")
            .args(&ports)
            .args([
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                if self.appendonly { "yes" } else { "no" },
                "--appendfsync",
                "always",
                "--dir",
                &self.dir.path().to_string_lossy(),
                "--logfile",
                "redis.log",
            ])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (the test command installs it)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.ping() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server on port {} did not come up", self.port);
    }

    pub fn ping(&self) -> bool {
        use std::io::{Read, Write};
        if self.tls.is_some() {
            return self.cli(&["PING"]).is_some_and(|out| out == "PONG");
        }
        let Ok(mut s) = std::net::TcpStream::connect(super::loopback(self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        if s.write_all(b"PING\r\n").is_err() {
            return false;
        }
        let mut buf = [0u8; 7];
        s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
    }

    /// Runs one command through redis-cli; its output, or `None` when it failed.
    pub fn cli(&self, args: &[&str]) -> Option<String> {
        let mut cmd = Command::new("redis-cli");
        cmd.args(["-h", "127.0.0.1", "-p", &self.port.to_string()]);
        if let Some(tls) = &self.tls {
            cmd.args(tls.cli_args());
        }
        let out = cmd.args(args).stderr(Stdio::null()).output().ok()?;
        let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
        (out.status.success() && !text.starts_with("ERR") && !text.contains("Could not connect"))
            .then_some(text)
    }

    /// SIGKILL: nothing is flushed beyond what AOF already fsynced.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// SIGSTOP / SIGCONT: a Redis that accepts connections but never answers.
    pub fn pause(&self) {
        self.signal("STOP");
    }

    pub fn resume(&self) {
        self.signal("CONT");
    }

    fn signal(&self, sig: &str) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill")
                .args([&format!("-{sig}"), &c.id().to_string()])
                .status();
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.resume();
        self.kill();
    }
}

/// A local Redis Cluster on loopback: `masters` masters, each with `replicas` replicas,
/// made by `redis-cli --cluster create`.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Bounded: `redis-cli --cluster create` waits for the nodes to meet for as long as it
    /// takes, and on a loaded machine a join can stall (seen: 14 minutes); each try gets
    /// `JOIN_WITHIN`, then its nodes are stopped and a fresh set is made, at most three times.
    pub fn start(masters: usize, replicas: usize) -> RedisCluster {
        const JOIN_WITHIN: Duration = Duration::from_secs(45);
        let mut last = String::new();
        for _ in 0..3 {
            match Self::try_start(masters, replicas, JOIN_WITHIN) {
                Ok(cluster) => return cluster,
                Err(why) => last = why,
            }
        }
        panic!("no Redis Cluster after three tries: {last}");
    }

    fn try_start(
        masters: usize,
        replicas: usize,
        within: Duration,
    ) -> Result<RedisCluster, String> {
        let nodes: Vec<RedisServer> = (0..masters * (1 + replicas))
            .map(|_| {
                // The cluster bus on a port of its own, free now: by default it is the client
                // port + 10000, which another test's server may hold.
                let bus = crate::common::free_port().to_string();
                RedisServer::start_args(
                    [
                        "--cluster-port",
                        bus.as_str(),
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "1000",
                        "--cluster-allow-replica-migration",
                        "no",
                        // A replica takes over however long it has been since it last heard
                        // from its master (an idle test cluster is "stale" otherwise).
                        "--cluster-replica-validity-factor",
                        "0",
                    ]
                    .map(String::from)
                    .to_vec(),
                )
            })
            .collect();
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for n in &nodes {
            create.arg(format!("127.0.0.1:{}", n.port));
        }
        let mut child = create
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("redis-cli must be installed");
        let deadline = Instant::now() + within;
        loop {
            match child.try_wait() {
                Ok(Some(status)) if status.success() => break,
                Ok(Some(status)) => return Err(format!("redis-cli --cluster create: {status}")),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                Ok(None) | Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!("the nodes did not join within {within:?}"));
                }
            }
        }
        let cluster = RedisCluster { nodes };
        cluster.until_healthy(Duration::from_secs(20));
        Ok(cluster)
    }

    /// `redis+cluster://` naming every node.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// Until every running node says the cluster is ok with all 16384 slots served.
    pub fn until_healthy(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let healthy = self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
                n.cli(&["CLUSTER", "INFO"]).is_some_and(|info| {
                    info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384")
                })
            });
            if healthy {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster never became healthy"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The node serving `key`'s slot as master, by index, and the slot.
    pub fn master_of(&self, key: &str) -> (usize, u16) {
        let slot: u16 = self.nodes[0]
            .cli(&["CLUSTER", "KEYSLOT", key])
            .expect("keyslot")
            .parse()
            .expect("slot number");
        let owner = self
            .nodes
            .iter()
            .position(|n| n.owns_slot(slot))
            .expect("some master serves the slot");
        (owner, slot)
    }

    /// Node `i` is running and a master now.
    pub fn is_master(&self, i: usize) -> bool {
        self.nodes[i].child.is_some()
            && self.nodes[i]
                .cli(&["ROLE"])
                .is_some_and(|r| r.starts_with("master"))
    }

    /// SIGKILLs node `i`, waits until the others flag it failed, then until a replica has
    /// taken over its slots.
    pub fn kill_and_fail_over(&mut self, i: usize, within: Duration) {
        let me = format!("127.0.0.1:{}@", self.nodes[i].port);
        self.nodes[i].kill();
        let deadline = Instant::now() + within;
        while !self.nodes.iter().filter(|n| n.child.is_some()).any(|n| {
            n.cli(&["CLUSTER", "NODES"]).is_some_and(|nodes| {
                nodes
                    .lines()
                    .any(|l| l.contains(&me) && l.contains("fail") && !l.contains("fail?"))
            })
        }) {
            assert!(
                Instant::now() < deadline,
                "the cluster never noticed the dead master"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        self.until_healthy(deadline.saturating_duration_since(Instant::now()));
    }

    /// Some record's key (for a test that stored exactly one so far: that one).
    pub fn any_key(&self) -> String {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some())
            .filter_map(|n| n.cli(&["--scan", "--pattern", "idem:*"]))
            .flat_map(|keys| keys.lines().map(String::from).collect::<Vec<_>>())
            .find(|k| !k.is_empty())
            .expect("a stored record")
    }

    /// Moves `slot` from its master to another master, key by key, as an operator's
    /// resharding does (MIGRATING/IMPORTING, then MIGRATE, then SETSLOT NODE).
    pub fn migrate_slot(&self, slot: u16) -> (usize, usize) {
        let from = self
            .nodes
            .iter()
            .position(|n| n.owns_slot(slot))
            .expect("the slot's owner");
        let to = self
            .nodes
            .iter()
            .position(|n| {
                n.child.is_some()
                    && !n.owns_slot(slot)
                    && n.cli(&["ROLE"]).is_some_and(|r| r.starts_with("master"))
            })
            .expect("another master");
        let (source, target) = (&self.nodes[from], &self.nodes[to]);
        let (source_id, target_id) = (source.node_id(), target.node_id());
        let s = slot.to_string();
        target
            .cli(&["CLUSTER", "SETSLOT", &s, "IMPORTING", &source_id])
            .expect("importing");
        source
            .cli(&["CLUSTER", "SETSLOT", &s, "MIGRATING", &target_id])
            .expect("migrating");
        loop {
            let keys = source
                .cli(&["CLUSTER", "GETKEYSINSLOT", &s, "100"])
                .expect("keys in slot");
            let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
            if keys.is_empty() {
                break;
            }
            let port = target.port.to_string();
            let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
            args.extend(keys);
            source.cli(&args).expect("migrate keys");
        }
        for n in self.nodes.iter().filter(|n| n.child.is_some()) {
            let _ = n.cli(&["CLUSTER", "SETSLOT", &s, "NODE", &target_id]);
        }
        (from, to)
    }
}

impl RedisServer {
    fn node_id(&self) -> String {
        self.cli(&["CLUSTER", "MYID"]).expect("cluster myid")
    }

    fn owns_slot(&self, slot: u16) -> bool {
        if self.child.is_none() {
            return false;
        }
        let Some(nodes) = self.cli(&["CLUSTER", "NODES"]) else {
            return false;
        };
        nodes
            .lines()
            .filter(|l| l.contains("myself") && l.contains("master"))
            .flat_map(|l| {
                l.split_whitespace()
                    .skip(8)
                    .map(String::from)
                    .collect::<Vec<_>>()
            })
            .any(|range| {
                if range.starts_with('[') {
                    return false;
                }
                match range.split_once('-') {
                    Some((a, b)) => {
                        a.parse::<u16>().is_ok_and(|a| a <= slot)
                            && b.parse::<u16>().is_ok_and(|b| slot <= b)
                    }
                    None => range.parse::<u16>() == Ok(slot),
                }
            })
    }
}

/// One master, one replica and three sentinels watching them, on loopback.
pub struct RedisSentinels {
    /// Index 0 starts as the master, 1 as its replica.
    pub servers: Vec<RedisServer>,
    sentinels: Vec<(u16, tempfile::TempDir, Child)>,
}

pub const SENTINEL_MASTER: &str = "idem";

impl RedisSentinels {
    pub fn start() -> RedisSentinels {
        let master = RedisServer::start();
        let replica = RedisServer::start_args(vec![
            "--replicaof".into(),
            "127.0.0.1".into(),
            master.port.to_string(),
        ]);
        let sentinels = (0..3)
            .map(|_| {
                let port = super::free_port();
                let dir = tempfile::tempdir().expect("tempdir");
                let conf = dir.path().join("sentinel.conf");
                std::fs::write(
                    &conf,
                    format!(
                        "port {port}\nbind 127.0.0.1\ndir {}\nlogfile sentinel.log\n\
                         sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {} 2\n\
                         sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n\
                         sentinel failover-timeout {SENTINEL_MASTER} 4000\n\
                         sentinel parallel-syncs {SENTINEL_MASTER} 1\n",
                        dir.path().display(),
                        master.port
                    ),
                )
                .expect("sentinel.conf");
                let child = Command::new("redis-server")
                    .arg(&conf)
                    .arg("--sentinel")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start a sentinel");
                (port, dir, child)
            })
            .collect();
        let setup = RedisSentinels {
            servers: vec![master, replica],
            sentinels,
        };
        setup.until_replicated(Duration::from_secs(15));
        setup
    }

    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|(port, _, _)| format!("127.0.0.1:{port}"))
            .collect();
        format!("redis+sentinel://{}/{SENTINEL_MASTER}/0", hosts.join(","))
    }

    /// The port the sentinels name as master, once they agree on one that answers.
    pub fn master_port(&self) -> Option<u16> {
        let answers: Vec<u16> = self
            .sentinels
            .iter()
            .filter_map(|(port, _, _)| {
                let out = Command::new("redis-cli")
                    .args(["-p", &port.to_string()])
                    .args(["SENTINEL", "get-master-addr-by-name", SENTINEL_MASTER])
                    .output()
                    .ok()?;
                String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .nth(1)?
                    .trim()
                    .parse()
                    .ok()
            })
            .collect();
        let first = *answers.first()?;
        (answers.len() >= 2 && answers.iter().all(|p| *p == first)).then_some(first)
    }

    pub fn master(&mut self) -> &mut RedisServer {
        let port = self.master_port().expect("the sentinels agree on a master");
        self.servers
            .iter_mut()
            .find(|s| s.port == port)
            .expect("the master is one of ours")
    }

    /// Until the sentinels know the master and its replica is in sync with it.
    pub fn until_replicated(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let synced = self.master_port().and_then(|port| {
                let master = self.servers.iter().find(|s| s.port == port)?;
                let info = master.cli(&["INFO", "replication"])?;
                Some(info.contains("connected_slaves:1") && info.contains("state=online"))
            });
            let sentinels_see_replica = self.sentinels.iter().all(|(port, _, _)| {
                Command::new("redis-cli")
                    .args([
                        "-p",
                        &port.to_string(),
                        "SENTINEL",
                        "replicas",
                        SENTINEL_MASTER,
                    ])
                    .output()
                    .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("slave"))
            });
            if synced == Some(true) && sentinels_see_replica {
                return;
            }
            assert!(Instant::now() < deadline, "master and replica never synced");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Until the sentinels name a master other than `old`.
    pub fn until_failed_over(&self, old: u16, within: Duration) -> u16 {
        let deadline = Instant::now() + within;
        loop {
            if let Some(port) = self.master_port().filter(|p| *p != old) {
                let answers = self
                    .servers
                    .iter()
                    .find(|s| s.port == port)
                    .and_then(|s| s.cli(&["ROLE"]))
                    .is_some_and(|r| r.starts_with("master"));
                if answers {
                    return port;
                }
            }
            assert!(Instant::now() < deadline, "the sentinels never failed over");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts the master that was killed again, as a replica of the one the sentinels
    /// promoted (as the sentinels would reconfigure it, without waiting for them).
    pub fn rejoin_as_replica(&mut self, old: u16) {
        let new = self.master_port().expect("a master");
        let server = self.server(old);
        server.extra = vec!["--replicaof".into(), "127.0.0.1".into(), new.to_string()];
        server.restart();
    }

    pub fn server(&mut self, port: u16) -> &mut RedisServer {
        self.servers
            .iter_mut()
            .find(|s| s.port == port)
            .expect("one of ours")
    }
}

impl Drop for RedisSentinels {
    fn drop(&mut self) {
        for (_, _, child) in &mut self.sentinels {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Where a test's TLS files are, for a `[store]` section.
pub fn tls_lines(tls: &RedisTls) -> String {
    let (cert, key) = tls.client();
    format!(
        "tls_ca = {:?}\ntls_cert = {:?}\ntls_key = {:?}\n",
        path_str(&tls.ca()),
        path_str(&cert),
        path_str(&key)
    )
}

fn path_str(p: &Path) -> String {
    p.display().to_string()
}
