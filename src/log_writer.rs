//! Where log lines go: a queue that a background thread drains into stderr (or any writer),
//! so a request never waits on a log write, and the thread wakes a few hundred times a second
//! at most, not once per line.
//!
//! `tracing_appender`'s non-blocking writer did the same through a channel whose receiver
//! spins and yields before it sleeps: with the proxy pinned to one CPU that thread took 12
//! to 29 % of the process's CPU time and thousands of context switches a second (`perf stat
//! --per-thread` during `bench/run.sh`). Waking the thread for every line instead was slower
//! still (each line a futex wake and a context switch). So the first line
//! into an empty queue wakes the thread, which then lets lines gather for [`GATHER`] (or
//! until [`WRITE_AT`] bytes wait) and writes them all at once: a line reaches stderr at most
//! a few milliseconds after it was logged.
//!
//! Lines are never dropped: a caller that finds more than [`MAX_QUEUED`] bytes waiting blocks
//! until the thread has taken them (back-pressure, as the writer before). The guard writes
//! what is left when it is dropped.
//!
//! The thread puts every line through the one redactor (`redact::log`) before it writes
//! it, except the protected request's own line (logged whole only outside any span): it is
//! composed by `proxy::log_line` from config names, the proxy's own words, numbers and
//! caller-derived values it has already redacted, and scanning it again cost more CPU
//! than the rest of a replay but SHA-256.

use std::borrow::Cow;
use std::io::Write;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use tracing_subscriber::fmt::MakeWriter;

/// Bytes waiting beyond which a caller waits for the writer thread.
pub const MAX_QUEUED: usize = 4 << 20;

/// How long the thread lets lines gather after the first one arrives.
pub const GATHER: Duration = Duration::from_millis(5);

/// Bytes waiting that end the gathering early.
pub const WRITE_AT: usize = 64 << 10;

#[derive(Default)]
struct Queue {
    bytes: Vec<u8>,
    /// Where in `bytes` lines already redacted at their source lie (in order, apart).
    redacted: Vec<Range<usize>>,
    /// The writer thread is asleep waiting for bytes: the next append wakes it.
    idle: bool,
    /// The writer thread is letting lines gather: an append that fills the queue past
    /// [`WRITE_AT`] wakes it early.
    gathering: bool,
    closed: bool,
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    /// Signalled when bytes arrive in an empty queue, or at close.
    filled: Condvar,
    /// Signalled when the thread has taken the queue's bytes.
    taken: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // A panic while holding the lock leaves at worst a partly appended line: keep logging.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn append(&self, bytes: &[u8], redacted: bool) {
        let mut q = self.lock();
        while q.bytes.len() >= MAX_QUEUED && !q.closed {
            q = self.taken.wait(q).unwrap_or_else(PoisonError::into_inner);
        }
        let start = q.bytes.len();
        q.bytes.extend_from_slice(bytes);
        if redacted {
            let end = q.bytes.len();
            match q.redacted.last_mut() {
                Some(last) if last.end == start => last.end = end,
                _ => q.redacted.push(start..end),
            }
        }
        let wake = std::mem::take(&mut q.idle)
            || (q.bytes.len() >= WRITE_AT && std::mem::take(&mut q.gathering));
        drop(q);
        if wake {
            self.filled.notify_one();
        }
    }
}

/// The writer half: what `tracing_subscriber` formats each event into.
#[derive(Clone)]
pub struct LogWriter {
    shared: Arc<Shared>,
    /// What this writer gets was redacted where it was composed (see the module's doc).
    redacted: bool,
}

/// Owns the writer thread: dropping it writes what is queued and stops the thread.
pub struct LogGuard {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// Starts the thread that writes queued lines to `out`.
pub fn spawn<W: Write + Send + 'static>(out: W) -> std::io::Result<(LogWriter, LogGuard)> {
    let shared = Arc::new(Shared::default());
    let drained = shared.clone();
    let thread = std::thread::Builder::new()
        .name("log-writer".into())
        .spawn(move || drain(&drained, out))?;
    Ok((
        LogWriter {
            shared: shared.clone(),
            redacted: false,
        },
        LogGuard {
            shared,
            thread: Some(thread),
        },
    ))
}

fn drain<W: Write>(shared: &Shared, mut out: W) {
    let mut batch = Vec::new();
    let mut redacted = Vec::new();
    loop {
        let mut q = shared.lock();
        while q.bytes.is_empty() && !q.closed {
            q.idle = true;
            q = shared
                .filled
                .wait(q)
                .unwrap_or_else(PoisonError::into_inner);
        }
        q.idle = false;
        if !q.closed && q.bytes.len() < WRITE_AT {
            q.gathering = true;
            q = shared
                .filled
                .wait_timeout(q, GATHER)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            q.gathering = false;
        }
        if q.bytes.is_empty() {
            return; // closed, and nothing left
        }
        std::mem::swap(&mut q.bytes, &mut batch);
        std::mem::swap(&mut q.redacted, &mut redacted);
        drop(q);
        shared.taken.notify_all();
        // A log that cannot be written has nowhere to report it; the lines are dropped.
        // Off the request path: every line not redacted at its source is redacted here,
        // whichever part logged it.
        let _ = out
            .write_all(&redact_rest(&batch, &redacted))
            .and_then(|()| out.flush());
        batch.clear();
        redacted.clear();
    }
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.filled.notify_one();
        self.shared.taken.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.shared.append(buf, self.redacted);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = LogWriter;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> Self::Writer {
        // `proxy::log_line` logs its whole line with this field only outside any span (a
        // span's fields would join the line unredacted); this runs inside the subscriber's
        // dispatch, where the current span cannot be asked.
        let redacted = meta
            .fields()
            .field(crate::redact::REDACTED_LINE_FIELD)
            .is_some();
        LogWriter {
            shared: self.shared.clone(),
            redacted,
        }
    }
}

/// The batch with every line not redacted at its source put through the redactor.
fn redact_rest<'b>(batch: &'b [u8], redacted: &[Range<usize>]) -> Cow<'b, [u8]> {
    let mut out: Option<Vec<u8>> = None;
    let mut at = 0;
    let end = batch.len()..batch.len();
    for done in redacted.iter().chain(std::iter::once(&end)) {
        match crate::redact::log(&batch[at..done.start]) {
            Cow::Owned(changed) => {
                let o = out.get_or_insert_with(|| batch[..at].to_vec());
                o.extend_from_slice(&changed);
            }
            Cow::Borrowed(same) => {
                if let Some(o) = out.as_mut() {
                    o.extend_from_slice(same);
                }
            }
        }
        if let Some(o) = out.as_mut() {
            o.extend_from_slice(&batch[done.clone()]);
        }
        at = done.end;
    }
    out.map_or(Cow::Borrowed(batch), Cow::Owned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A writer that keeps what it got and counts its writes.
    #[derive(Clone, Default)]
    struct Sink {
        got: Arc<Mutex<Vec<u8>>>,
        writes: Arc<AtomicUsize>,
    }

    impl Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.writes.fetch_add(1, Ordering::SeqCst);
            self.got
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn every_line_arrives_whole_and_in_order_from_many_threads() {
        let sink = Sink::default();
        let (writer, guard) = spawn(sink.clone()).expect("thread");
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let mut w = writer.clone();
                std::thread::spawn(move || {
                    for i in 0..2000 {
                        w.write_all(format!("t{t} line {i}\n").as_bytes())
                            .expect("append");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("writer thread");
        }
        drop(guard);
        let got = String::from_utf8(sink.got.lock().expect("sink").clone()).expect("utf-8");
        let mut next = [0usize; 8];
        for line in got.lines() {
            let (t, i) = line
                .strip_prefix('t')
                .and_then(|l| l.split_once(" line "))
                .expect("a whole line");
            let (t, i): (usize, usize) = (t.parse().expect("t"), i.parse().expect("i"));
            assert_eq!(i, next[t], "thread {t}'s lines in order");
            next[t] += 1;
        }
        assert_eq!(next, [2000; 8], "no line lost");
    }

    #[test]
    fn lines_logged_in_a_burst_share_writes_and_still_arrive_promptly() {
        let sink = Sink::default();
        let (mut writer, guard) = spawn(sink.clone()).expect("thread");
        for i in 0..50 {
            writer
                .write_all(format!("burst {i}\n").as_bytes())
                .expect("append");
        }
        // Without the guard's final flush: the thread writes them by itself, soon.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while sink.got.lock().expect("sink").len() < 50 * 8 {
            assert!(std::time::Instant::now() < deadline, "lines never written");
            std::thread::sleep(Duration::from_millis(1));
        }
        let writes = sink.writes.load(Ordering::SeqCst);
        // One write per line is what this writer exists to avoid (a scheduler that stalls
        // this thread mid-burst may split it in a few).
        assert!(writes < 10, "{writes} writes for 50 lines");
        drop(guard);
    }

    #[test]
    fn lines_queued_together_go_out_in_one_write() {
        // The thread is held inside its first write (the sink blocks on a lock) while more
        // lines queue; they must then go out as one write, not one each.
        let sink = Sink::default();
        let hold = sink.got.lock().expect("sink");
        let (mut writer, guard) = spawn(sink.clone()).expect("thread");
        writer.write_all(b"first\n").expect("append");
        while sink.writes.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        for i in 0..100 {
            writer
                .write_all(format!("queued {i}\n").as_bytes())
                .expect("append");
        }
        drop(hold);
        drop(guard);
        assert_eq!(sink.writes.load(Ordering::SeqCst), 2);
        let got = sink.got.lock().expect("sink").clone();
        assert_eq!(got.iter().filter(|&&b| b == b'\n').count(), 101);
    }

    #[test]
    fn a_full_queue_makes_the_caller_wait_instead_of_dropping_lines() {
        let sink = Sink::default();
        let hold = sink.got.lock().expect("sink");
        let (mut writer, guard) = spawn(sink.clone()).expect("thread");
        writer.write_all(b"x\n").expect("append");
        while sink.writes.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        // The thread is stuck in its first write: fill the queue past its bound.
        let chunk = vec![b'y'; MAX_QUEUED];
        writer.write_all(&chunk).expect("append");
        let done = Arc::new(AtomicUsize::new(0));
        let waiter = {
            let (mut w, done) = (writer.clone(), done.clone());
            std::thread::spawn(move || {
                w.write_all(b"z\n").expect("append");
                done.store(1, Ordering::SeqCst);
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_eq!(
            done.load(Ordering::SeqCst),
            0,
            "waits while the queue is full"
        );
        drop(hold);
        waiter.join().expect("waiter");
        drop(guard);
        assert_eq!(sink.got.lock().expect("sink").len(), 2 + MAX_QUEUED + 2);
    }

    #[test]
    fn a_line_redacted_at_its_source_is_not_scanned_again() {
        assert_eq!(
            crate::redact::REDACTED_LINE_FIELD,
            "idemproxy_protected_request"
        );
        let sink = Sink::default();
        let (writer, guard) = spawn(sink.clone()).expect("thread");
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(writer)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            // What only the marked line's composer may do: the writer passes it as it is.
            tracing::info!(idemproxy_protected_request = %"note=sk_live_unscanned");
            tracing::info!(other = %"sk_live_scannedone", "any other line");
        });
        drop(guard);
        let got = String::from_utf8(sink.got.lock().expect("sink").clone()).expect("utf-8");
        assert_eq!(got.lines().count(), 2, "{got}");
        assert!(got.contains("sk_live_unscanned"), "{got}");
        assert!(!got.contains("sk_live_scannedone"), "{got}");
    }

    #[test]
    fn lines_around_a_redacted_one_are_each_redacted_in_place() {
        let batch = b"a key=sk_live_first\nmarked sk_live_kept\nb key=sk_live_last\n";
        let marked = 20..40;
        assert_eq!(&batch[marked.clone()], b"marked sk_live_kept\n");
        let out = String::from_utf8(redact_rest(batch, &[marked]).into_owned()).expect("utf-8");
        assert!(out.contains("marked sk_live_kept\n"), "{out}");
        assert!(
            !out.contains("sk_live_first") && !out.contains("sk_live_last"),
            "{out}"
        );
        assert_eq!(out.lines().count(), 3, "{out}");
        let whole = std::slice::from_ref(&(0..6));
        assert!(matches!(redact_rest(b"plain\n", whole), Cow::Borrowed(_)));
    }
}
