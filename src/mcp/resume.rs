//! Calls whose POST stream closed before their result (SSE polling, 2025-11-25): the server
//! stored the events, the client resumes with a GET carrying `Last-Event-ID`, and the result
//! arrives there. A claim waits for it here, keyed by account, session and JSON-RPC id — never
//! by id alone (ids restart in every process), and never without a session: another client's
//! result must never settle this call.

use std::collections::HashMap;
use std::sync::Mutex;

use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;

/// At most this many calls wait at once; more are held as before (never a second execution).
const MAX_WAITING: usize = 10_000;

/// The calls waiting for a resumed stream, per route.
#[derive(Default)]
pub struct Resumptions {
    waiting: Mutex<HashMap<String, oneshot::Sender<Vec<u8>>>>,
}

/// Where a call's result is awaited.
pub fn key(account: &str, session: &str, id: &Value) -> String {
    let mut h = Sha256::new();
    for part in [account, session, &id.to_string()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    crate::hex::lower(&h.finalize())
}

impl Resumptions {
    /// Waits for the result under `key`; `None` when too many calls wait already.
    pub fn wait(&self, key: &str) -> Option<oneshot::Receiver<Vec<u8>>> {
        let mut waiting = self.waiting.lock().ok()?;
        waiting.retain(|_, tx| !tx.is_closed());
        if waiting.len() >= MAX_WAITING {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        waiting.insert(key.to_string(), tx);
        Some(rx)
    }

    /// Hands a result seen on a resumed stream to the call waiting for it, if any.
    pub fn deliver(&self, key: &str, message: Vec<u8>) -> bool {
        let tx = self.waiting.lock().ok().and_then(|mut w| w.remove(key));
        tx.is_some_and(|tx| tx.send(message).is_ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[tokio::test]
    async fn a_result_reaches_only_the_call_of_its_account_session_and_id() {
        let r = Resumptions::default();
        let rx = r.wait(&key("acct", "s1", &json!(1))).expect("waits");
        assert!(!r.deliver(&key("acct", "s2", &json!(1)), b"other session".to_vec()));
        assert!(!r.deliver(&key("other", "s1", &json!(1)), b"other account".to_vec()));
        assert!(!r.deliver(&key("acct", "s1", &json!("1")), b"a string id".to_vec()));
        assert!(r.deliver(&key("acct", "s1", &json!(1)), b"it".to_vec()));
        assert_eq!(rx.await.expect("delivered"), b"it".to_vec());
    }
}
