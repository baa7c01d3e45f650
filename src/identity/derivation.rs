//! Versions of how a request's account, fingerprint and operation are computed. A new version
//! changes the scope some requests claim under (a Stripe key sent as Basic is now the same
//! account as the key sent as Bearer); a retry made after an upgrade must still find what the
//! first attempt claimed before it, or the upgrade turns the retry into a second execution.
//! So every record keeps the version it was derived with, and for a stated window a request
//! whose scope the other version computes differently also looks there (`Claims`, with the
//! other derivation's scope and fingerprint).
//!
//! - **1**: up to and including the release before this one: the account hashed from the
//!   credential headers as sent, the fingerprint over the path as the client spelled it.
//! - **2**: the account from the provider's notion of the key (`Bearer K` = Basic `K:` where
//!   a profile documents both; Plaid's credentials from headers or the body alike), the
//!   fingerprint and endpoint over the path in the one grammar (`request::path`).

use std::time::{Duration, Instant};

/// One way of computing scopes, accounts and fingerprints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Derivation {
    V1,
    V2,
}

impl Derivation {
    /// What this build computes by default.
    pub const CURRENT: Derivation = Derivation::V2;

    pub fn number(self) -> u8 {
        match self {
            Derivation::V1 => 1,
            Derivation::V2 => 2,
        }
    }

    pub fn from_number(n: u8) -> Option<Derivation> {
        match n {
            1 => Some(Derivation::V1),
            2 => Some(Derivation::V2),
            _ => None,
        }
    }

    /// The version a rolling upgrade (or its rollback) shares the store with.
    pub fn other(self) -> Derivation {
        match self {
            Derivation::V1 => Derivation::V2,
            Derivation::V2 => Derivation::V1,
        }
    }
}

/// Which derivation a proxy claims under, and until when it also looks under the other one.
#[derive(Debug, Clone, Copy)]
pub struct Derivations {
    pub primary: Derivation,
    /// `None`: the other derivation is never looked at.
    other_until: Option<Instant>,
}

impl Derivations {
    /// Claims under `primary`; looks under the other derivation for `window` from now (zero:
    /// never).
    pub fn new(primary: Derivation, window: Duration) -> Derivations {
        Derivations {
            primary,
            other_until: (!window.is_zero()).then(|| Instant::now() + window),
        }
    }

    /// The derivation to look under too, while the window lasts.
    pub fn other(&self) -> Option<Derivation> {
        self.other_until
            .filter(|until| Instant::now() < *until)
            .map(|_| self.primary.other())
    }
}

impl Default for Derivations {
    fn default() -> Derivations {
        Derivations::new(Derivation::CURRENT, DEFAULT_WINDOW)
    }
}

/// Seven days: the longest default retention (money and trading profiles), so a first attempt
/// made just before an upgrade is found by every retry while its record lives.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_opens_and_can_be_closed() {
        let d = Derivations::new(Derivation::V2, Duration::from_secs(60));
        assert_eq!(d.other(), Some(Derivation::V1));
        assert_eq!(
            Derivations::new(Derivation::V1, Duration::from_secs(60)).other(),
            Some(Derivation::V2)
        );
        assert_eq!(
            Derivations::new(Derivation::V2, Duration::ZERO).other(),
            None
        );
        for n in [1, 2] {
            assert_eq!(Derivation::from_number(n).map(Derivation::number), Some(n));
        }
        assert_eq!(Derivation::from_number(3), None);
    }
}
