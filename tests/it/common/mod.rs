//! Test harness: real processes and sockets on loopback. A fake provider that counts the side
//! effects it performs, a redis-server per test, the idemproxy binary, and a plain HTTP client.

pub mod client;
pub mod connect;
pub mod fakes;
pub mod pki;
pub mod postgres;
pub mod provider;
pub mod proxy;
pub mod redis;

use std::net::{SocketAddr, TcpListener};

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
