//! A shared TLS edge, as a CDN's front end is: one address that terminates TLS for several
//! names, picks the certificate by the ClientHello's SNI, and hands each name's traffic to its
//! own origin. Behind a real edge an LLM API and a payment provider can share an address; a
//! tunnel opened for one then reaches the other by the name its ClientHello sends.

use std::net::SocketAddr;
use std::sync::Arc;

use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::LazyConfigAcceptor;

/// What the edge does with one name's decrypted traffic.
#[derive(Clone)]
pub enum Origin {
    /// Answers every connection's first request with these bytes and closes.
    Answer(&'static [u8]),
    /// Opens TLS to `addr` for `name` (trusting `client`'s roots) and copies both ways.
    Forward {
        addr: SocketAddr,
        name: String,
        client: Arc<rustls::ClientConfig>,
    },
}

/// One name the edge serves: its certificate and its origin.
#[derive(Clone)]
pub struct Site {
    pub name: String,
    pub tls: Arc<rustls::ServerConfig>,
    pub origin: Origin,
}

pub struct Edge {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Edge {
    pub async fn start(sites: Vec<Site>) -> Edge {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind edge");
        let addr = listener.local_addr().expect("edge addr");
        let sites = Arc::new(sites);
        let task = tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                tokio::spawn(serve(sock, sites.clone()));
            }
        });
        Edge { addr, task }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }
}

impl Drop for Edge {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(sock: TcpStream, sites: Arc<Vec<Site>>) {
    let acceptor = LazyConfigAcceptor::new(rustls::server::Acceptor::default(), sock);
    let Ok(start) = acceptor.await else { return };
    let sni = start
        .client_hello()
        .server_name()
        .map(|s| s.to_ascii_lowercase());
    let Some(site) = sites.iter().find(|s| Some(&s.name) == sni.as_ref()) else {
        return;
    };
    let Ok(mut tls) = start.into_stream(site.tls.clone()).await else {
        return;
    };
    match &site.origin {
        Origin::Answer(answer) => {
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match tls.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let _ = tls.write_all(answer).await;
            let _ = tls.shutdown().await;
        }
        Origin::Forward { addr, name, client } => {
            let Ok(tcp) = TcpStream::connect(addr).await else {
                return;
            };
            let Ok(name) = ServerName::try_from(name.clone()) else {
                return;
            };
            let connector = tokio_rustls::TlsConnector::from(client.clone());
            let Ok(mut upstream) = connector.connect(name, tcp).await else {
                return;
            };
            let _ = tokio::io::copy_bidirectional(&mut tls, &mut upstream).await;
        }
    }
}
