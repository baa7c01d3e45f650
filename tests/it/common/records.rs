//! Records as the store tests write them straight into a store.

use std::time::Duration;

use idemproxy::idempotency::record::{Receipt, Record, RecordBody, State, Token};
use idemproxy::store::Expiry;

pub const HOUR: Expiry = Expiry::After(Duration::from_secs(3600));

/// A record in `state` with a fresh token; a COMMITTED one carries a small receipt.
pub fn record(state: State) -> Record {
    Record {
        state,
        token: Token::random(),
        body: RecordBody {
            fingerprint: "fp".into(),
            route: "r".into(),
            created_ms: 1,
            lease_until_ms: 2,
            unknown_since_ms: 0,
            note: None,
            receipt: (state == State::Committed).then(|| Receipt {
                status: 201,
                headers: vec![("content-type".into(), "application/json".into())],
                body: bytes::Bytes::from_static(b"{\"id\":1}"),
            }),
            declined: false,
            attempt: 0,
            reconciled: false,
            derivation: 2,
            settled_ms: 0,
            resolved: None,
        },
    }
}
