//! Approvals on a store that reads and writes one in separate steps (Redis, PostgreSQL):
//! read the stored bytes, decide with the port's rules (`opening`, `updating`), and write
//! compare-and-set against exactly the bytes read. Two proxies opening or deciding the same
//! approval at once: one write lands, the other reads again (opening) or is refused
//! (deciding). SQLite and the in-memory store decide inside one transaction or lock instead.

use std::future::Future;

use crate::idempotency::store::StoreError;
use crate::spend::port::{opening, updating, Approval, Opened};

/// How often an opening reads again after another proxy wrote first.
const ATTEMPTS: usize = 5;

/// One approval cell of a store: its bytes, and a write fenced on them.
pub(super) trait Cells: Sync {
    /// The stored bytes of approval `id`; `None` when there is none.
    fn load(&self, id: &str) -> impl Future<Output = Result<Option<Vec<u8>>, StoreError>> + Send;

    /// Writes `new` over `seen` (the bytes `load` read; `None`: none was there) unless they
    /// changed since: `false` then, and nothing written.
    fn swap(
        &self,
        seen: Option<&[u8]>,
        new: &Approval,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
}

/// `SpendStore::approval` over `cells`.
pub(super) async fn get(cells: &impl Cells, id: &str) -> Result<Option<Approval>, StoreError> {
    cells
        .load(id)
        .await?
        .map(|raw| Approval::decode(&raw))
        .transpose()
}

/// `SpendStore::open_approval` over `cells`.
pub(super) async fn open(
    cells: &impl Cells,
    a: &Approval,
    now_ms: u64,
) -> Result<(Approval, Opened), StoreError> {
    for _ in 0..ATTEMPTS {
        let raw = cells.load(&a.id).await?;
        let found = raw.as_deref().map(Approval::decode).transpose()?;
        let opened = opening(found.as_ref(), now_ms);
        if let (Opened::Existing, Some(found)) = (opened, found) {
            return Ok((found, opened));
        }
        if cells.swap(raw.as_deref(), a).await? {
            return Ok((a.clone(), opened));
        }
    }
    Err(StoreError::Unavailable(format!(
        "approval {} kept changing while it was opened",
        a.id
    )))
}

/// `SpendStore::update_approval` over `cells`.
pub(super) async fn update(cells: &impl Cells, a: &Approval) -> Result<bool, StoreError> {
    let Some(raw) = cells.load(&a.id).await? else {
        return Ok(false);
    };
    match updating(&Approval::decode(&raw)?, a) {
        Some(next) => cells.swap(Some(&raw), &next).await,
        None => Ok(false),
    }
}
