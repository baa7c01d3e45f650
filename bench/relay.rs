//! The benchmark's reference for a blind tunnel: a bare `CONNECT` relay that reads the
//! request's head, dials the target, answers 200 and splices both ways, nothing else (no
//! ClientHello peek, no routes, no egress rules). Beside idemproxy's blind tunnel it shows what
//! the proxy adds to a tunnel's first bytes.
//!
//!   relay --listen 127.0.0.1:0      # prints `relay listening ADDR`

use std::net::SocketAddr;

use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let listener = TcpListener::bind(args.listen).await?;
        println!("relay listening {}", listener.local_addr()?);
        loop {
            let (client, _) = listener.accept().await?;
            tokio::spawn(async move {
                let _ = tunnel(client).await;
            });
        }
    })
}

async fn tunnel(mut client: TcpStream) -> anyhow::Result<()> {
    client.set_nodelay(true)?;
    let mut head = Vec::with_capacity(256);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = client.read(&mut buf).await?;
        anyhow::ensure!(n > 0 && head.len() < 8192, "no CONNECT head");
        head.extend_from_slice(&buf[..n]);
    }
    let end = head
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| p + 4)
        .unwrap_or(head.len());
    let line = std::str::from_utf8(&head[..end])?
        .lines()
        .next()
        .unwrap_or("");
    let mut words = line.split(' ');
    anyhow::ensure!(words.next() == Some("CONNECT"), "not a CONNECT");
    let target = words.next().unwrap_or("");
    let mut upstream = TcpStream::connect(target).await?;
    upstream.set_nodelay(true)?;
    client.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await?;
    // Bytes the client sent after its head go on first.
    upstream.write_all(&head[end..]).await?;
    tokio::io::copy_bidirectional(&mut client, &mut upstream).await?;
    Ok(())
}
