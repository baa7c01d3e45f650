//! Bounds on protected requests being forwarded. A forward outlives its client (a client that
//! hangs up must not cancel a call the provider may be executing), so without a bound a
//! client that resets its requests can pile up upstream calls and buffered bodies without end.
//! A request over a bound is refused with 503 before anything is claimed.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::metrics::Metrics;
use crate::proxy::error::ProxyError;

/// Bodies are counted in KiB: a semaphore holds at most `u32::MAX` permits per acquire.
const UNIT: u64 = 1024;

pub struct ForwardLimit {
    forwards: Arc<Semaphore>,
    bytes: Arc<Semaphore>,
    max_body_bytes: usize,
}

/// Held until the forward ends (moved into the task that runs it).
#[derive(Debug)]
pub struct Admitted {
    _forward: OwnedSemaphorePermit,
    _bytes: OwnedSemaphorePermit,
}

impl ForwardLimit {
    pub fn new(max_forwards: usize, max_forward_bytes: u64, max_body_bytes: usize) -> ForwardLimit {
        ForwardLimit {
            forwards: Arc::new(Semaphore::new(max_forwards)),
            bytes: Arc::new(Semaphore::new(
                (max_forward_bytes / UNIT).min(Semaphore::MAX_PERMITS as u64) as usize,
            )),
            max_body_bytes,
        }
    }

    /// Admits a protected request whose body declares `declared` bytes (`None`: chunked, so
    /// the largest body allowed is reserved), or refuses it at once.
    pub fn admit(&self, declared: Option<u64>, metrics: &Metrics) -> Result<Admitted, ProxyError> {
        let forward = self.forwards.clone().try_acquire_owned().map_err(|_| {
            metrics.forward_refused("max_forwards");
            ProxyError::Busy {
                limit: "server.max_forwards",
            }
        })?;
        let size = declared
            .unwrap_or(self.max_body_bytes as u64)
            .min(self.max_body_bytes as u64);
        let units = u32::try_from(size.div_ceil(UNIT).max(1)).unwrap_or(u32::MAX);
        let bytes = self
            .bytes
            .clone()
            .try_acquire_many_owned(units)
            .map_err(|_| {
                metrics.forward_refused("max_forward_bytes");
                ProxyError::Busy {
                    limit: "server.max_forward_bytes",
                }
            })?;
        Ok(Admitted {
            _forward: forward,
            _bytes: bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_bytes_are_bounded_and_given_back() {
        let m = Metrics::new();
        let a = ForwardLimit::new(2, 10 * 1024, 4 * 1024);
        let one = a.admit(Some(100), &m).expect("first");
        let _two = a.admit(Some(100), &m).expect("second");
        assert!(matches!(
            a.admit(Some(1), &m),
            Err(ProxyError::Busy {
                limit: "server.max_forwards"
            })
        ));
        drop(one);
        let b = ForwardLimit::new(10, 10 * 1024, 4 * 1024);
        let _x = b.admit(None, &m).expect("4 KiB reserved");
        let _y = b.admit(Some(4096), &m).expect("4 KiB");
        assert!(matches!(
            b.admit(Some(4096), &m),
            Err(ProxyError::Busy {
                limit: "server.max_forward_bytes"
            })
        ));
        assert!(m
            .encode()
            .contains("idemproxy_forwards_refused_total{limit=\"max_forward_bytes\"} 1"));
    }
}
