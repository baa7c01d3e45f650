//! Test harness: real processes and sockets on loopback. A fake provider that counts the side
//! effects it performs, a redis-server per test, the idemproxy binary, and a plain HTTP client.

pub mod client;
pub mod connect;
pub mod edge;
pub mod fakes;
pub mod pay;
pub mod pki;
pub mod postgres;
pub mod provider;
pub mod proxy;
pub mod records;
pub mod redis;
pub mod worker;

use std::future::Future;
use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

/// Which store a proxy under test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Redis,
    /// `rediss://`, with mutual TLS.
    RedisTls,
    /// Three masters, no replicas.
    RedisCluster,
    /// A master, a replica and three sentinels.
    RedisSentinel,
    Postgres,
}

/// A port nobody listens on right now (for things that cannot bind port 0 themselves).
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local addr").port()
}

pub fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// How often `eventually` looks again.
const POLL: Duration = Duration::from_millis(20);

/// Waits until `check` returns `Some`, looking every 20 ms; panics naming `what` if it has not
/// within `within`. For waiting on something that happens in another process or task (a
/// request reaching the provider, a settle landing) instead of sleeping for a guess.
pub async fn eventually<T>(
    what: &str,
    within: Duration,
    mut check: impl FnMut() -> Option<T>,
) -> T {
    eventually_async(what, within, || std::future::ready(check())).await
}

/// `eventually` for a check that has to await (an HTTP request, a Redis command).
pub async fn eventually_async<T, F>(what: &str, within: Duration, mut check: impl FnMut() -> F) -> T
where
    F: Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(found) = check().await {
            return found;
        }
        assert!(started.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(POLL).await;
    }
}

/// The server side of the TCP connections on loopback `port`, from `/proc/net/tcp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerSockets {
    /// Connections the server has not closed yet (established, or closed by the client only).
    pub open: usize,
    /// Connections waiting in the listener's accept queue.
    pub queued: usize,
}

/// What the server on `port` holds open and has not accepted yet, so a test can wait for it
/// to notice a client's close or to accept a connection.
pub fn server_sockets(port: u16) -> ServerSockets {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("read /proc/net/tcp");
    let mut found = ServerSockets { open: 0, queued: 0 };
    for line in table.lines().skip(1) {
        // sl local_address rem_address st tx_queue:rx_queue ...
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(local), Some(state), Some(queues)) =
            (fields.get(1), fields.get(3), fields.get(4))
        else {
            continue;
        };
        let local_port = local
            .split_once(':')
            .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
        if local_port != Some(port) {
            continue;
        }
        match *state {
            // LISTEN: rx_queue is the accept queue's length.
            "0A" => {
                found.queued += queues
                    .split_once(':')
                    .and_then(|(_, rx)| usize::from_str_radix(rx, 16).ok())
                    .unwrap_or(0)
            }
            // ESTABLISHED, CLOSE_WAIT.
            "01" | "08" => found.open += 1,
            _ => {}
        }
    }
    found
}

/// Runs one async test body against both stores: `both_backends!(name);` expects
/// `async fn name(backend: Backend)` in the same file.
#[macro_export]
macro_rules! both_backends {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name($crate::common::Backend::Sqlite).await }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name($crate::common::Backend::Redis).await }
            )*
        }
    };
}

/// Runs one async test body on each kind of store — SQLite, Redis, PostgreSQL:
/// `three_stores!(name);` expects `async fn name(backend: Backend)` in the same file.
#[macro_export]
macro_rules! three_stores {
    ($($name:ident),* $(,)?) => {
        $crate::both_backends!($($name),*);
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name($crate::common::Backend::Postgres).await }
            )*
        }
    };
}

/// Runs one async test body against every store: `every_store!(name);` expects
/// `async fn name(backend: Backend)` in the same file.
#[macro_export]
macro_rules! every_store {
    ($($name:ident),* $(,)?) => {
        $crate::both_backends!($($name),*);
        mod redis_tls {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name($crate::common::Backend::RedisTls).await }
            )*
        }
        mod redis_cluster {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name($crate::common::Backend::RedisCluster).await }
            )*
        }
        mod redis_sentinel {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name($crate::common::Backend::RedisSentinel).await }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name($crate::common::Backend::Postgres).await }
            )*
        }
    };
}
