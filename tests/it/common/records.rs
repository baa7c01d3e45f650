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
            sealed_receipt: None,
            declined: false,
            attempt: 0,
            reconciled: false,
            derivation: 2,
            settled_ms: 0,
            resolved: None,
            priced: None,
            lookup_target: None,
            lookup_credentials: None,
            passed_down_sha256: None,
            awaiting_until_ms: 0,
            presented: None,
        },
    }
}

/// `r` with its receipt sealed the way proxies wrote sealed receipts before a sealed receipt
/// had a type of its own: a "receipt" with status 0, one `idemproxy-sealed: aes-256-gcm/v1`
/// header, and `nonce || AES-256-GCM(receipt as JSON)` as its body, bound to `scope` and the
/// fingerprint. Written here with `ring`, apart from the proxy's own sealing code, so stores
/// written by those proxies are what the tests read back.
pub fn sealed_the_old_way(scope: &str, r: &Record, key: &[u8; 32]) -> Record {
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
    let receipt = r.body.receipt.as_ref().expect("a record with a receipt");
    let mut data = serde_json::to_vec(receipt).expect("receipt JSON");
    let nonce = [7u8; 12];
    let aad = [scope.as_bytes(), b"\0", r.body.fingerprint.as_bytes()].concat();
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, key).expect("key"))
        .seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(&aad[..]),
            &mut data,
        )
        .expect("seal");
    let mut old = r.clone();
    old.body.receipt = Some(Receipt {
        status: 0,
        headers: vec![("idemproxy-sealed".into(), "aes-256-gcm/v1".into())],
        body: bytes::Bytes::from([&nonce[..], &data].concat()),
    });
    old
}

/// Every record in the SQLite file at `path` in its plain encoding (JSON after the header):
/// what a scan of a store's files for a secret appends, so that it also looks inside records
/// the store wrote compact (deflated). Nothing for a file without a records table.
pub fn sqlite_records_plain(path: &std::path::Path) -> Vec<u8> {
    let Ok(conn) =
        rusqlite::Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
    else {
        return Vec::new();
    };
    let Ok(mut stmt) = conn.prepare("SELECT value FROM records") else {
        return Vec::new();
    };
    let values = stmt
        .query_map([], |r| r.get::<_, Vec<u8>>(0))
        .and_then(|rows| rows.collect::<rusqlite::Result<Vec<_>>>())
        .expect("read the records");
    values
        .iter()
        .flat_map(|v| Record::decode(v).expect("a readable record").encode())
        .collect()
}

/// Every byte under `dir`, as a scan of a store's files for a secret reads them: each file's
/// bytes, and for a SQLite file its records decoded to plain ([`sqlite_records_plain`]).
pub fn files_bytes(dir: &std::path::Path) -> Vec<u8> {
    fn collect(dir: &std::path::Path, out: &mut Vec<u8>) {
        for entry in std::fs::read_dir(dir).expect("read store dir").flatten() {
            let p = entry.path();
            if p.is_dir() {
                collect(&p, out);
            } else if let Ok(bytes) = std::fs::read(&p) {
                out.extend_from_slice(&bytes);
                if p.extension().is_some_and(|e| e == "db") {
                    out.extend(sqlite_records_plain(&p));
                }
            }
        }
    }
    let mut out = Vec::new();
    collect(dir, &mut out);
    out
}
