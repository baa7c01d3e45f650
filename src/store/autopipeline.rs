//! Redis auto-pipelining: the claim and settle commands that requests issue in the same pass
//! of the scheduler travel to Redis in one write and come back in one read.
//!
//! Why: on loopback every socket write runs the whole TCP path, including the receiver's,
//! and profiles showed the two per-request writes to Redis costing more than the commands
//! themselves. Redis executes a pipeline's commands one by one in order, so batching changes
//! no command's meaning; each caller still gets its own command's reply (or error).
//!
//! The queue is drained after one `yield_now`: the scheduler runs every task that is ready
//! before it resumes us, so everything issued in this pass joins the batch, and a lone
//! command waits no longer than one pass.

use std::future::Future;
use std::pin::Pin;

use futures_util::stream::{FuturesUnordered, StreamExt as _};
use redis::aio::{ConnectionLike as _, ConnectionManager};
use redis::{Cmd, RedisError, RedisResult, Value};
use tokio::sync::{mpsc, oneshot};

/// Largest batch; a bigger backlog goes out in several writes.
const MAX_BATCH: usize = 256;

struct Queued {
    cmd: Cmd,
    reply: oneshot::Sender<RedisResult<Value>>,
}

#[derive(Clone)]
pub struct AutoPipeline {
    queue: mpsc::UnboundedSender<Queued>,
}

impl AutoPipeline {
    /// Starts the batching task on the current runtime; it ends when every handle is dropped.
    pub fn start(conn: ConnectionManager) -> AutoPipeline {
        let (queue, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(rx, conn));
        AutoPipeline { queue }
    }

    /// Sends `cmd` with the next batch and returns its own reply.
    pub async fn query(&self, cmd: Cmd) -> RedisResult<Value> {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(Queued { cmd, reply })
            .map_err(|_| stopped())?;
        answer.await.unwrap_or_else(|_| Err(stopped()))
    }
}

fn stopped() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::BrokenPipe,
        "the Redis pipeline task stopped",
    ))
}

type InFlight = Pin<Box<dyn Future<Output = ()> + Send>>;

async fn run(mut rx: mpsc::UnboundedReceiver<Queued>, conn: ConnectionManager) {
    // Batches already written whose replies are pending: the next batch does not wait for them.
    let mut in_flight: FuturesUnordered<InFlight> = FuturesUnordered::new();
    loop {
        let first = tokio::select! {
            queued = rx.recv() => match queued {
                Some(q) => q,
                None => break,
            },
            Some(()) = in_flight.next(), if !in_flight.is_empty() => continue,
        };
        tokio::task::yield_now().await;
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(q) => batch.push(q),
                Err(_) => break,
            }
        }
        // A caller that went away (its timeout, a dropped request) needs no reply; its
        // command is not sent at all if it has not been yet.
        batch.retain(|q| !q.reply.is_closed());
        if !batch.is_empty() {
            in_flight.push(Box::pin(send(conn.clone(), batch)));
        }
    }
    while in_flight.next().await.is_some() {}
}

async fn send(mut conn: ConnectionManager, mut batch: Vec<Queued>) {
    if batch.len() == 1 {
        if let Some(q) = batch.pop() {
            let result = conn.req_packed_command(&q.cmd).await.and_then(server_error);
            let _ = q.reply.send(result);
        }
        return;
    }
    let mut pipe = redis::pipe();
    let mut replies = Vec::with_capacity(batch.len());
    for q in batch {
        pipe.add_command(q.cmd);
        replies.push(q.reply);
    }
    pipe.ignore_errors();
    match pipe.query_async::<Vec<Value>>(&mut conn).await {
        Ok(values) if values.len() == replies.len() => {
            for (reply, value) in replies.into_iter().zip(values) {
                let _ = reply.send(server_error(value));
            }
        }
        Ok(values) => {
            let e = RedisError::from(std::io::Error::other(format!(
                "Redis answered {} replies to a pipeline of {}",
                values.len(),
                replies.len()
            )));
            for reply in replies {
                let _ = reply.send(Err(e.clone()));
            }
        }
        Err(e) => {
            for reply in replies {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
}

/// A command's error reply (NOSCRIPT, WRONGTYPE, …) as its error, as a lone command's would be.
fn server_error(value: Value) -> RedisResult<Value> {
    match value {
        Value::ServerError(e) => Err(RedisError::from(e)),
        v => Ok(v),
    }
}
