//! The console's login rate limit: failed logins per client address per minute. Kept in
//! memory per process (a replica behind a load balancer counts its own); enough to turn
//! guessing a 128-bit token from hopeless into hopeless and slow, and to keep the hashing
//! cheap under a flood.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;

const WINDOW_MS: u64 = 60_000;
/// Addresses remembered at most; beyond it the oldest windows are forgotten first.
const MAX_TRACKED: usize = 10_000;

pub struct Throttle {
    per_minute: u32,
    failures: Mutex<HashMap<IpAddr, (u64, u32)>>,
}

impl Throttle {
    pub fn new(per_minute: u32) -> Throttle {
        Throttle {
            per_minute,
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// `Err(seconds to wait)` when `ip` has used up its failed attempts this minute.
    pub fn check(&self, ip: IpAddr, now_ms: u64) -> Result<(), u64> {
        let map = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        match map.get(&ip) {
            Some((start, n)) if now_ms < start + WINDOW_MS && *n >= self.per_minute => {
                Err((start + WINDOW_MS - now_ms).div_ceil(1000))
            }
            _ => Ok(()),
        }
    }

    pub fn failed(&self, ip: IpAddr, now_ms: u64) {
        let mut map = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() >= MAX_TRACKED {
            map.retain(|_, (start, _)| now_ms < *start + WINDOW_MS);
        }
        let entry = map.entry(ip).or_insert((now_ms, 0));
        if now_ms >= entry.0 + WINDOW_MS {
            *entry = (now_ms, 0);
        }
        entry.1 += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_beyond_the_limit_wait_for_the_window() {
        let t = Throttle::new(3);
        let ip: IpAddr = [127, 0, 0, 1].into();
        let other: IpAddr = [127, 0, 0, 2].into();
        for _ in 0..3 {
            assert!(t.check(ip, 1_000).is_ok());
            t.failed(ip, 1_000);
        }
        assert_eq!(t.check(ip, 1_000), Err(60));
        assert_eq!(t.check(ip, 30_500), Err(31));
        assert!(t.check(other, 1_000).is_ok());
        assert!(t.check(ip, 61_000).is_ok());
    }
}
