//! A PostgreSQL server of the test's own (Debian's package), on a free port with its socket
//! in its own directory, that the test can crash, stop, pause and restart.
//!
//! `initdb` runs once per test process into a template; each server starts on a copy of it.
//! As root, the server runs as the `postgres` user (Postgres refuses to run as root).

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Where Debian's package puts the server binaries (version 15 here; any other found too).
fn bin(name: &str) -> PathBuf {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    versions.sort();
    versions
        .into_iter()
        .rev()
        .map(|v| v.join("bin").join(name))
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from(name))
}

/// The uid and gid to run as: `postgres` when we are root, else ourselves.
fn owner() -> Option<(u32, u32)> {
    let out = Command::new("id").arg("-u").output().ok()?;
    if String::from_utf8_lossy(&out.stdout).trim() != "0" {
        return None;
    }
    let id = |flag: &str| -> Option<u32> {
        let out = Command::new("id").args([flag, "postgres"]).output().ok()?;
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    };
    Some((
        id("-u").expect("a `postgres` user (the postgresql package creates it)"),
        id("-g").expect("the postgres group"),
    ))
}

fn as_owner(cmd: &mut Command) -> &mut Command {
    if let Some((uid, gid)) = owner() {
        cmd.uid(uid).gid(gid);
    }
    cmd
}

fn chown_tree(path: &Path) {
    if let Some((uid, gid)) = owner() {
        let status = Command::new("chown")
            .arg("-R")
            .arg(format!("{uid}:{gid}"))
            .arg(path)
            .status()
            .expect("chown");
        assert!(status.success(), "chown {}", path.display());
    }
}

/// A data directory `initdb` made once for this process; servers start on copies.
fn template() -> &'static Path {
    static TEMPLATE: OnceLock<tempfile::TempDir> = OnceLock::new();
    TEMPLATE
        .get_or_init(|| {
            let dir = tempfile::tempdir().expect("tempdir");
            chown_tree(dir.path());
            let data = dir.path().join("data");
            let out = as_owner(&mut Command::new(bin("initdb")))
                .args(["-D"])
                .arg(&data)
                .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"])
                .env("LC_ALL", "C")
                .output()
                .expect("initdb must be installed (the test command installs postgresql)");
            assert!(
                out.status.success(),
                "initdb failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            dir
        })
        .path()
}

pub struct PostgresServer {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl PostgresServer {
    pub fn start() -> PostgresServer {
        let dir = tempfile::tempdir().expect("tempdir");
        let status = Command::new("cp")
            .arg("-a")
            .arg(template().join("data"))
            .arg(dir.path().join("data"))
            .status()
            .expect("cp");
        assert!(status.success(), "copy the template cluster");
        chown_tree(dir.path());
        let mut server = PostgresServer {
            port: super::free_port(),
            dir,
            child: None,
        };
        server.spawn();
        server
    }

    /// As the superuser `postgres`, database `postgres`, no TLS.
    pub fn url(&self) -> String {
        self.url_as("postgres")
    }

    pub fn url_as(&self, role: &str) -> String {
        format!(
            "postgres://{role}@127.0.0.1:{}/postgres?sslmode=disable",
            self.port
        )
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("postgres.log"))
            .expect("open log");
        chown_tree(&self.dir.path().join("postgres.log"));
        // Crash-safe against a process crash (what the tests inflict); `fsync = off` only
        // gives up safety against the host losing power, which no test simulates.
        let child = as_owner(&mut Command::new(bin("postgres")))
            .arg("-D")
            .arg(self.data())
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!(
                "unix_socket_directories={}",
                self.dir.path().display()
            ))
            .args(["-c", "fsync=off", "-c", "full_page_writes=off"])
            .args(["-c", "shared_buffers=16MB", "-c", "max_connections=60"])
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start postgres");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if self.ready() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "postgres on port {} did not come up:\n{}",
            self.port,
            self.logs()
        );
    }

    fn ready(&self) -> bool {
        Command::new(bin("pg_isready"))
            .args(["-q", "-h", "127.0.0.1", "-p", &self.port.to_string()])
            .status()
            .is_ok_and(|s| s.success())
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }

    /// Runs SQL as the superuser through psql; panics on an error.
    pub fn psql(&self, sql: &str) -> String {
        let out = Command::new("psql")
            .args(["-X", "-q", "-t", "-A", "-v", "ON_ERROR_STOP=1"])
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-U", "postgres", "-d", "postgres", "-c", sql])
            .output()
            .expect("psql must be installed");
        assert!(
            out.status.success(),
            "psql `{sql}`: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    fn signal(&self, sig: &str) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill")
                .args([&format!("-{sig}"), &c.id().to_string()])
                .status();
        }
    }

    /// Every process of the server: the postmaster and its backends.
    fn processes(&self) -> Vec<String> {
        let Some(c) = &self.child else { return vec![] };
        let mut pids = vec![c.id().to_string()];
        if let Ok(out) = Command::new("pgrep")
            .args(["-P", &c.id().to_string()])
            .output()
        {
            pids.extend(
                String::from_utf8_lossy(&out.stdout)
                    .split_whitespace()
                    .map(String::from),
            );
        }
        pids
    }

    /// A crash: SIGQUIT, the "immediate" shutdown, which ends every backend at once with no
    /// checkpoint. The next start recovers from the WAL: whatever was committed is there.
    pub fn crash(&mut self) {
        self.signal("QUIT");
        self.reap();
    }

    /// A clean stop (SIGINT, "fast" shutdown: clients are disconnected, then a checkpoint).
    pub fn stop(&mut self) {
        self.signal("INT");
        self.reap();
    }

    fn reap(&mut self) {
        if let Some(mut c) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(15);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn restart(&mut self) {
        self.crash();
        self.spawn();
    }

    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "the server is running");
        self.spawn();
    }

    /// SIGSTOP on every process: a database that accepts connections and never answers.
    pub fn pause(&self) {
        for pid in self.processes() {
            let _ = Command::new("kill")
                .args(["-STOP", &pid])
                .stderr(Stdio::null())
                .status();
        }
    }

    pub fn resume(&self) {
        for pid in self.processes() {
            let _ = Command::new("kill")
                .args(["-CONT", &pid])
                .stderr(Stdio::null())
                .status();
        }
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.resume();
        self.crash();
    }
}
