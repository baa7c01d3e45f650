//! One TLS server configuration per intercepted host, generated once and cached. A burst of
//! connections to a new host waits on the one generation under way instead of starting its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use moka::future::Cache;
use rustls::ServerConfig;

use super::ca::{CertAuthority, LEAF_VALIDITY};

/// Enough for every provider host a deployment talks to, many times over.
const CAPACITY: u64 = 10_000;
/// Well inside the leaf's validity, so a cached certificate never expires while served.
const TTL: Duration = Duration::from_secs(24 * 3600);
const _: () = assert!(TTL.as_secs() * 7 < LEAF_VALIDITY.as_secs());

#[derive(Debug, thiserror::Error)]
pub enum LeafError {
    #[error("cannot issue a certificate for {host}: {source}")]
    Issue { host: String, source: rcgen::Error },
    #[error("cannot build the TLS configuration for {host}: {source}")]
    Rustls { host: String, source: rustls::Error },
}

pub struct LeafCache {
    ca: CertAuthority,
    cache: Cache<String, Arc<ServerConfig>>,
    generated: AtomicU64,
}

impl LeafCache {
    pub fn new(ca: CertAuthority) -> LeafCache {
        LeafCache {
            ca,
            cache: Cache::builder()
                .max_capacity(CAPACITY)
                .time_to_live(TTL)
                .build(),
            generated: AtomicU64::new(0),
        }
    }

    pub fn ca(&self) -> &CertAuthority {
        &self.ca
    }

    /// The server configuration for `host` (lowercase DNS name or IP address); ALPN offers
    /// `h2` and `http/1.1`.
    pub async fn server_config(&self, host: &str) -> Result<Arc<ServerConfig>, Arc<LeafError>> {
        let host = host.to_ascii_lowercase();
        self.get_or_generate(&host, async { self.build(&host) })
            .await
    }

    /// Callers asking for a host whose generation is under way wait for it, rather than
    /// starting their own (moka resolves one init future per key).
    async fn get_or_generate(
        &self,
        host: &str,
        generate: impl std::future::Future<Output = Result<ServerConfig, LeafError>>,
    ) -> Result<Arc<ServerConfig>, Arc<LeafError>> {
        self.cache
            .try_get_with_by_ref(host, async {
                self.generated.fetch_add(1, Ordering::Relaxed);
                generate.await.map(Arc::new)
            })
            .await
    }

    /// How many leaf certificates are cached now (for the `cert_cache_entries` gauge).
    pub async fn entries(&self) -> u64 {
        self.cache.run_pending_tasks().await;
        self.cache.entry_count()
    }

    /// How many leaf certificates this cache has generated.
    pub fn generated(&self) -> u64 {
        self.generated.load(Ordering::Relaxed)
    }

    fn build(&self, host: &str) -> Result<ServerConfig, LeafError> {
        let leaf = self.ca.issue(host).map_err(|source| LeafError::Issue {
            host: host.to_string(),
            source,
        })?;
        let rustls_err = |source| LeafError::Rustls {
            host: host.to_string(),
            source,
        };
        let mut config =
            ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(rustls_err)?
                .with_no_client_auth()
                .with_single_cert(leaf.chain, leaf.key)
                .map_err(rustls_err)?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache() -> LeafCache {
        let dir = tempfile::tempdir().expect("test setup");
        let new = CertAuthority::generate().expect("test setup");
        let (cert, key) = (dir.path().join("ca.pem"), dir.path().join("ca.key"));
        std::fs::write(&cert, new.cert_pem).expect("test setup");
        std::fs::write(&key, new.key_pem).expect("test setup");
        LeafCache::new(CertAuthority::load(&cert, &key).expect("test setup"))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_burst_for_one_new_host_generates_once() {
        let cache = Arc::new(cache());
        // Every caller asks while the first generation is still running (it is made slow
        // here), which is exactly when a get-then-insert cache would generate again.
        let tasks: Vec<_> = (0..50)
            .map(|_| {
                let cache = cache.clone();
                tokio::spawn(async move {
                    let slow = async {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        cache.build("api.burst.test")
                    };
                    cache
                        .get_or_generate("api.burst.test", slow)
                        .await
                        .expect("test setup")
                })
            })
            .collect();
        let mut configs = Vec::new();
        for t in tasks {
            configs.push(t.await.expect("test setup"));
        }
        assert_eq!(cache.generated(), 1);
        assert!(configs.iter().all(|c| Arc::ptr_eq(c, &configs[0])));
        // Case does not make a new certificate; another host does.
        cache
            .server_config("API.BURST.TEST")
            .await
            .expect("test setup");
        assert_eq!(cache.generated(), 1);
        cache.server_config("other.test").await.expect("test setup");
        assert_eq!(cache.generated(), 2);
    }
}
