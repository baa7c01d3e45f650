//! The held (UNKNOWN) claims as the console lists them, kept for two seconds: on Redis the
//! list is a SCAN of the whole namespace, and every open console tab asks for it every few
//! seconds. A resolution made here clears it, so the page after an action is current.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::idempotency::record::{Record, State};
use crate::idempotency::store::{Store, StoreError};

const FRESH: Duration = Duration::from_secs(2);

type Held = Vec<(String, Record)>;

#[derive(Default)]
pub struct HeldCache {
    last: Mutex<Option<(Instant, Held)>>,
}

impl HeldCache {
    pub async fn list(&self, store: &dyn Store, limit: usize) -> Result<Held, StoreError> {
        if let Some((at, held)) = &*self.lock() {
            if at.elapsed() < FRESH {
                return Ok(held.clone());
            }
        }
        let held = store.list(State::Unknown, limit).await?;
        *self.lock() = Some((Instant::now(), held.clone()));
        Ok(held)
    }

    pub fn clear(&self) {
        *self.lock() = None;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(Instant, Held)>> {
        self.last.lock().unwrap_or_else(|e| e.into_inner())
    }
}
