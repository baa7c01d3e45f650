//! Closed-loop HTTP/1.1 load generator for the benchmark: N keep-alive connections, each
//! sending the next request as soon as the previous answer is read, for a fixed time.
//! Optionally tunnels through `CONNECT` and speaks TLS, so the same tool measures direct
//! calls, reverse proxies, HTTPS interception and blind tunnels alike.
//!
//! Prints one JSON line: requests, rps, p50/p90/p99/p99.9/max latency (µs), errors, non-2xx.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rustls_pki_types::{pem::PemObject, CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Parser, Clone)]
struct Args {
    /// Address to open TCP connections to (the server, or the proxy).
    #[arg(long)]
    addr: SocketAddr,
    /// Request target: `/v1/charges`, or `http://host/v1/charges` for a forward proxy.
    #[arg(long, default_value = "/v1/charges")]
    path: String,
    /// Host header (and TLS server name).
    #[arg(long, default_value = "api.bench.test")]
    host: String,
    /// Send `CONNECT <this>` first (HTTPS_PROXY mode).
    #[arg(long)]
    connect: Option<String>,
    /// Speak TLS (after CONNECT, if any), trusting only this CA.
    #[arg(long)]
    cacert: Option<std::path::PathBuf>,
    /// `unique`: a new Idempotency-Key per request; `fixed`: one key for all; `none`.
    #[arg(long, default_value = "unique")]
    keys: String,
    #[arg(long, default_value_t = 32)]
    connections: usize,
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    warmup: Duration,
    /// Send MCP `tools/call` requests (JSON-RPC, with the headers an MCP client sends)
    /// instead of a form-encoded charge: `unique` keys make each call's arguments new,
    /// `fixed` repeats one call (a re-run), `none` is the same as `fixed`.
    #[arg(long)]
    mcp: bool,
    /// One request per connection (and per tunnel, with `--connect`): each request's time
    /// then counts from before the TCP connect, its CONNECT and TLS handshake included.
    #[arg(long)]
    fresh: bool,
    /// Instead of load: open this many idle keep-alive connections, hold them, then exit.
    #[arg(long)]
    idle: Option<usize>,
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    hold: Duration,
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

const BODY: &str =
    "amount=2000&currency=usd&source=tok_visa&description=benchmark+charge&metadata[order_id]=6735";

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(run(args))
}

async fn open(
    args: &Args,
    tls: &Option<tokio_rustls::TlsConnector>,
) -> anyhow::Result<Box<dyn Io>> {
    let mut tcp = TcpStream::connect(args.addr).await?;
    tcp.set_nodelay(true)?;
    if let Some(target) = &args.connect {
        tcp.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
            .await?;
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if tcp.read(&mut byte).await? == 0 {
                anyhow::bail!("proxy closed during CONNECT");
            }
            head.push(byte[0]);
        }
        if !head.starts_with(b"HTTP/1.1 200") {
            anyhow::bail!("CONNECT refused: {}", String::from_utf8_lossy(&head));
        }
    }
    match tls {
        Some(connector) => {
            let name = ServerName::try_from(args.host.clone())?;
            Ok(Box::new(connector.connect(name, tcp).await?))
        }
        None => Ok(Box::new(tcp)),
    }
}

fn tls_connector(args: &Args) -> anyhow::Result<Option<tokio_rustls::TlsConnector>> {
    let Some(path) = &args.cacert else {
        return Ok(None);
    };
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(path)? {
        roots.add(cert?)?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Some(tokio_rustls::TlsConnector::from(Arc::new(config))))
}

/// A `tools/call` as an MCP client (2025-11-25 revision, stateless server: no session) posts
/// it: JSON-RPC in the body, `Accept` for both framings, the protocol version header. The
/// JSON-RPC id is the same on every call, as every new client process starts it; a new call
/// differs in its arguments (MCP clients send no idempotency key).
fn mcp_call(
    req: http::request::Builder,
    keys: &str,
    unique: &str,
) -> http::Result<http::Request<Full<Bytes>>> {
    let reference = if keys == "unique" {
        unique
    } else {
        "bench-fixed"
    };
    let body = format!(
        r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"create_refund","arguments":{{"charge":"ch_3MmlLrLkdIwHu7ix0snN0B15","amount":2000,"reference":"{reference}"}},"_meta":{{"progressToken":1}}}}}}"#
    );
    req.header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2025-11-25")
        .body(Full::new(Bytes::from(body)))
}

struct ConnStats {
    hist: Histogram<u64>,
    /// Answered during the warm-up too: what the proxy and its store served in all.
    sent: u64,
    requests: u64,
    errors: u64,
    non2xx: u64,
}

async fn worker(
    args: Arc<Args>,
    tls: Option<tokio_rustls::TlsConnector>,
    id: usize,
    start: Instant,
) -> ConnStats {
    let mut stats = ConnStats {
        hist: Histogram::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds are valid"),
        sent: 0,
        requests: 0,
        errors: 0,
        non2xx: 0,
    };
    let run_id = std::process::id();
    let measure_from = start + args.warmup;
    let end = measure_from + args.duration;
    let mut seq: u64 = 0;
    'reconnect: while Instant::now() < end {
        let opened = Instant::now();
        let io = match open(&args, &tls).await {
            Ok(io) => io,
            Err(_) => {
                stats.errors += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok((mut sender, conn)) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await
        else {
            stats.errors += 1;
            continue;
        };
        tokio::spawn(conn);
        while Instant::now() < end {
            seq += 1;
            let req = http::Request::post(args.path.as_str())
                .header("host", args.host.as_str())
                .header("authorization", "Bearer sk_test_bench");
            let req = if args.mcp {
                mcp_call(req, &args.keys, &format!("bench-{run_id}-{id}-{seq}"))
            } else {
                let mut req = req.header("content-type", "application/x-www-form-urlencoded");
                match args.keys.as_str() {
                    "unique" => {
                        req = req.header("idempotency-key", format!("bench-{run_id}-{id}-{seq}"))
                    }
                    "fixed" => req = req.header("idempotency-key", "bench-fixed-key"),
                    _ => {}
                }
                req.body(Full::new(Bytes::from_static(BODY.as_bytes())))
            };
            let Ok(req) = req else {
                stats.errors += 1;
                continue;
            };
            let t0 = if args.fresh { opened } else { Instant::now() };
            let result = async {
                let resp = sender.send_request(req).await?;
                let status = resp.status();
                resp.into_body().collect().await?;
                Ok::<_, hyper::Error>(status)
            }
            .await;
            let elapsed = t0.elapsed();
            if result.is_ok() {
                stats.sent += 1;
            }
            if t0 < measure_from {
                if result.is_err() || args.fresh {
                    continue 'reconnect;
                }
                continue;
            }
            match result {
                Ok(status) => {
                    stats.requests += 1;
                    if !status.is_success() {
                        stats.non2xx += 1;
                    }
                    let _ = stats.hist.record(elapsed.as_micros().max(1) as u64);
                }
                Err(_) => {
                    stats.errors += 1;
                    continue 'reconnect;
                }
            }
            if args.fresh {
                continue 'reconnect;
            }
        }
    }
    stats
}

async fn run(args: Args) -> anyhow::Result<()> {
    let tls = tls_connector(&args)?;
    if let Some(n) = args.idle {
        let mut held = Vec::with_capacity(n);
        for _ in 0..n {
            let io = open(&args, &tls).await?;
            let (mut sender, conn) =
                hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
            tokio::spawn(conn);
            // One request each, so every connection is a real keep-alive HTTP connection.
            let req = http::Request::get(args.path.as_str())
                .header("host", args.host.as_str())
                .body(Full::new(Bytes::new()))?;
            sender
                .send_request(req)
                .await?
                .into_body()
                .collect()
                .await?;
            held.push(sender);
        }
        println!("{{\"idle_connections\":{}}}", held.len());
        tokio::time::sleep(args.hold).await;
        return Ok(());
    }
    let args = Arc::new(args);
    let start = Instant::now();
    let tasks: Vec<_> = (0..args.connections)
        .map(|id| tokio::spawn(worker(args.clone(), tls.clone(), id, start)))
        .collect();
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let (mut sent, mut requests, mut errors, mut non2xx) = (0u64, 0u64, 0u64, 0u64);
    for t in tasks {
        let s = t.await?;
        hist.add(&s.hist)?;
        sent += s.sent;
        requests += s.requests;
        errors += s.errors;
        non2xx += s.non2xx;
    }
    let secs = args.duration.as_secs_f64();
    println!(
        "{{\"sent\":{sent},\"requests\":{requests},\"rps\":{:.1},\"p50_us\":{},\"p90_us\":{},\"p99_us\":{},\"p999_us\":{},\"max_us\":{},\"errors\":{errors},\"non2xx\":{non2xx}}}",
        requests as f64 / secs,
        hist.value_at_quantile(0.50),
        hist.value_at_quantile(0.90),
        hist.value_at_quantile(0.99),
        hist.value_at_quantile(0.999),
        hist.max(),
    );
    Ok(())
}
