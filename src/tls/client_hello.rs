//! Reading the name a TLS client asks for out of the first bytes of a connection, without
//! taking part in the handshake: the ClientHello's `server_name` (SNI) and whether it carries
//! an Encrypted ClientHello. The bytes are only looked at; whoever reads them replays them.
//!
//! The ClientHello may be split across TLS records and the records across reads; [`parse`] is
//! given everything read so far and says whether it needs more. Anything that is not a
//! well-formed ClientHello within [`MAX_HELLO_BYTES`] is reported as such, never guessed at,
//! and no input can make it panic: every length is checked before it is used.

/// The most bytes read while looking for a ClientHello. Real ones are a few hundred bytes to
/// a few KiB (post-quantum key shares, many extensions); a handshake message may be up to
/// 16 MiB on paper, but no client sends a ClientHello near this.
pub const MAX_HELLO_BYTES: usize = 64 * 1024;

const RECORD_HANDSHAKE: u8 = 22;
const HANDSHAKE_CLIENT_HELLO: u8 = 1;
const EXT_SERVER_NAME: u16 = 0;
/// `encrypted_client_hello` (RFC 9849), and the draft ESNI's code point.
const EXT_ECH: [u16; 2] = [0xfe0d, 0xffce];
/// TLSPlaintext.length must not exceed 2^14.
const MAX_RECORD: usize = 1 << 14;

/// What the first bytes of a tunnel are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hello {
    /// A ClientHello may follow: read more.
    Incomplete,
    ClientHello(ClientHello),
    /// The first byte is not a TLS handshake record.
    NotTls,
    /// A TLS handshake record that is not a well-formed ClientHello (or a larger one than
    /// [`MAX_HELLO_BYTES`]).
    Malformed(&'static str),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientHello {
    /// The `host_name` the client asked for, lowercase, without a trailing dot.
    pub server_name: Option<String>,
    /// The hello carries an Encrypted ClientHello: its real name is hidden, and
    /// `server_name` is only the outer, public one.
    pub ech: bool,
}

/// Looks at `buf`, everything the client has sent so far.
pub fn parse(buf: &[u8]) -> Hello {
    match buf.first() {
        None => return Hello::Incomplete,
        Some(&b) if b != RECORD_HANDSHAKE => return Hello::NotTls,
        Some(_) => {}
    }
    let message = match handshake_message(buf) {
        Ok(Some(m)) => m,
        Ok(None) if buf.len() >= MAX_HELLO_BYTES => {
            return Hello::Malformed("no whole ClientHello within the bound")
        }
        Ok(None) => return Hello::Incomplete,
        Err(why) => return Hello::Malformed(why),
    };
    match client_hello(&message) {
        Ok(hello) => Hello::ClientHello(hello),
        Err(why) => Hello::Malformed(why),
    }
}

/// The first handshake message, reassembled from as many records as it spans; `None` until
/// all of it has arrived.
fn handshake_message(mut buf: &[u8]) -> Result<Option<Vec<u8>>, &'static str> {
    let mut message = Vec::new();
    loop {
        if buf.len() < 5 {
            return Ok(None);
        }
        if buf[0] != RECORD_HANDSHAKE {
            return Err("a record that is not a handshake record interrupts the ClientHello");
        }
        if buf[1] != 3 || buf[2] > 4 {
            return Err("the record's version is not TLS");
        }
        let len = usize::from(u16::from_be_bytes([buf[3], buf[4]]));
        if len == 0 || len > MAX_RECORD {
            return Err("a handshake record with an impossible length");
        }
        let Some(payload) = buf.get(5..5 + len) else {
            return Ok(None);
        };
        message.extend_from_slice(payload);
        buf = &buf[5 + len..];
        if message.len() >= 4 {
            if message[0] != HANDSHAKE_CLIENT_HELLO {
                return Err("the first handshake message is not a ClientHello");
            }
            let body = usize::from(message[1]) << 16
                | usize::from(message[2]) << 8
                | usize::from(message[3]);
            if body + 4 > MAX_HELLO_BYTES {
                return Err("the ClientHello is larger than the bound");
            }
            if message.len() >= body + 4 {
                message.truncate(body + 4);
                message.drain(..4);
                return Ok(Some(message));
            }
        }
    }
}

/// A cursor over bytes where every read is checked.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        if self.0.len() < n {
            return Err("the ClientHello is cut short");
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, &'static str> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, &'static str> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    /// A vector with a one- or two-byte length prefix.
    fn vec8(&mut self) -> Result<&'a [u8], &'static str> {
        let n = self.u8()?;
        self.take(usize::from(n))
    }

    fn vec16(&mut self) -> Result<&'a [u8], &'static str> {
        let n = self.u16()?;
        self.take(usize::from(n))
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The ClientHello body (RFC 8446 §4.1.2; RFC 5246 §7.4.1.2 for the optional extensions).
fn client_hello(body: &[u8]) -> Result<ClientHello, &'static str> {
    let mut r = Reader(body);
    let version = r.u16()?;
    if version >> 8 != 3 {
        return Err("the ClientHello's version is not TLS");
    }
    r.take(32)?; // random
    if r.vec8()?.len() > 32 {
        return Err("a session id longer than 32 bytes");
    }
    let suites = r.vec16()?;
    if suites.is_empty() || suites.len() % 2 != 0 {
        return Err("no cipher suites, or half of one");
    }
    if r.vec8()?.is_empty() {
        return Err("no compression methods");
    }
    let mut hello = ClientHello {
        server_name: None,
        ech: false,
    };
    if r.is_empty() {
        return Ok(hello);
    }
    let mut extensions = Reader(r.vec16()?);
    if !r.is_empty() {
        return Err("bytes after the extensions");
    }
    let mut seen = Vec::new();
    while !extensions.is_empty() {
        let kind = extensions.u16()?;
        let data = extensions.vec16()?;
        // Two extensions of one type are a malformed hello (RFC 8446 §4.2): otherwise the
        // proxy and the server could each read another one.
        if seen.contains(&kind) {
            return Err("an extension appears twice");
        }
        seen.push(kind);
        if kind == EXT_SERVER_NAME {
            hello.server_name = server_name(data)?;
        } else if EXT_ECH.contains(&kind) {
            hello.ech = true;
        }
    }
    Ok(hello)
}

/// The `server_name` extension's `host_name` (RFC 6066 §3): one name, letters, digits,
/// hyphens, underscores and dots.
fn server_name(data: &[u8]) -> Result<Option<String>, &'static str> {
    let mut r = Reader(data);
    let mut list = Reader(r.vec16()?);
    if !r.is_empty() {
        return Err("bytes after the server name list");
    }
    let mut found = None;
    while !list.is_empty() {
        let kind = list.u8()?;
        let name = list.vec16()?;
        if kind != 0 {
            continue;
        }
        if found.is_some() {
            return Err("two host names in one server_name extension");
        }
        let valid = !name.is_empty()
            && name
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
        if !valid {
            return Err("a host name that is not a DNS name");
        }
        let name = String::from_utf8_lossy(name).to_ascii_lowercase();
        let name = name.trim_end_matches('.');
        if name.is_empty() {
            return Err("a host name that is not a DNS name");
        }
        found = Some(name.to_string());
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A real ClientHello as rustls sends it (TLS 1.3 and 1.2 offered, ALPN, key shares).
    fn rustls_hello(name: &str) -> Vec<u8> {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let server = rustls_pki_types::ServerName::try_from(name.to_string()).expect("name");
        let mut conn = rustls::ClientConnection::new(Arc::new(config), server).expect("client");
        let mut out = Vec::new();
        conn.write_tls(&mut out).expect("hello");
        out
    }

    /// `flight`'s handshake payload re-cut into records of `size` bytes.
    fn refragment(flight: &[u8], size: usize) -> Vec<u8> {
        let payload = &flight[5..];
        payload
            .chunks(size)
            .flat_map(|c| {
                let mut rec = vec![22, 3, 1];
                rec.extend_from_slice(&(c.len() as u16).to_be_bytes());
                rec.extend_from_slice(c);
                rec
            })
            .collect()
    }

    fn named(buf: &[u8]) -> Option<String> {
        match parse(buf) {
            Hello::ClientHello(h) => h.server_name,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn reads_the_name_of_a_real_hello() {
        let hello = rustls_hello("API.Stripe.com");
        assert_eq!(named(&hello).as_deref(), Some("api.stripe.com"));
        // Bytes after the hello (early data, the next flight) change nothing.
        let mut more = hello.clone();
        more.extend_from_slice(&[23, 3, 3, 0, 5, 1, 2, 3, 4, 5]);
        assert_eq!(named(&more).as_deref(), Some("api.stripe.com"));
    }

    #[test]
    fn an_address_sends_no_name() {
        let hello = rustls_hello("127.0.0.1");
        assert_eq!(
            parse(&hello),
            Hello::ClientHello(ClientHello {
                server_name: None,
                ech: false
            })
        );
    }

    #[test]
    fn every_prefix_is_incomplete_and_every_split_reassembles() {
        let hello = rustls_hello("api.stripe.com");
        for cut in 0..hello.len() {
            assert_eq!(parse(&hello[..cut]), Hello::Incomplete, "cut at {cut}");
        }
        for size in [1, 2, 3, 7, 64, 100, 511] {
            let split = refragment(&hello, size);
            assert_eq!(named(&split).as_deref(), Some("api.stripe.com"), "{size}");
            for cut in 0..split.len() {
                assert_eq!(parse(&split[..cut]), Hello::Incomplete, "{size} at {cut}");
            }
        }
    }

    #[test]
    fn not_tls_and_garbage_are_told_apart() {
        assert_eq!(parse(b"GET / HTTP/1.1\r\n"), Hello::NotTls);
        assert_eq!(parse(b"SSH-2.0-OpenSSH_9.6\r\n"), Hello::NotTls);
        assert_eq!(parse(&[0x80, 0x2e, 0x01]), Hello::NotTls, "SSLv2 hello");
        for bad in [
            &[22u8, 9, 9, 0, 5][..],                // not TLS's version
            &[22, 3, 1, 0, 0],                      // an empty record
            &[22, 3, 1, 0x40, 0x01],                // longer than 2^14
            &[22, 3, 1, 0, 4, 2, 0, 0, 0],          // a ServerHello
            &[22, 3, 1, 0, 4, 1, 0xff, 0xff, 0xff], // larger than the bound
        ] {
            assert!(matches!(parse(bad), Hello::Malformed(_)), "{bad:?}");
        }
        // A handshake record followed by another kind before the hello is whole.
        let hello = rustls_hello("a.test");
        let mut cut = refragment(&hello, 50)[..55].to_vec();
        cut.extend_from_slice(&[23, 3, 3, 0, 1, 0]);
        assert!(matches!(parse(&cut), Hello::Malformed(_)));
    }

    /// Edits the first hello's body through `edit` and re-frames it as one record.
    fn edited(name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let flight = rustls_hello(name);
        let mut body = flight[9..].to_vec();
        edit(&mut body);
        let mut msg = vec![1, 0, (body.len() >> 8) as u8, body.len() as u8];
        msg.extend_from_slice(&body);
        let mut rec = vec![22, 3, 1];
        rec.extend_from_slice(&(msg.len() as u16).to_be_bytes());
        rec.extend_from_slice(&msg);
        rec
    }

    /// Where the extensions block starts in a ClientHello body.
    fn extensions_at(body: &[u8]) -> usize {
        let mut at = 2 + 32;
        at += 1 + usize::from(body[at]);
        at += 2 + usize::from(u16::from_be_bytes([body[at], body[at + 1]]));
        at + 1 + usize::from(body[at])
    }

    fn append_extension(body: &mut Vec<u8>, kind: u16, data: &[u8]) {
        let at = extensions_at(body);
        let len = u16::from_be_bytes([body[at], body[at + 1]]) as usize + 4 + data.len();
        body[at..at + 2].copy_from_slice(&(len as u16).to_be_bytes());
        body.extend_from_slice(&kind.to_be_bytes());
        body.extend_from_slice(&(data.len() as u16).to_be_bytes());
        body.extend_from_slice(data);
    }

    #[test]
    fn ech_and_duplicate_extensions() {
        let ech = edited("public.example", |b| {
            append_extension(b, 0xfe0d, &[0, 1, 2])
        });
        assert_eq!(
            parse(&ech),
            Hello::ClientHello(ClientHello {
                server_name: Some("public.example".into()),
                ech: true
            })
        );
        // A second server_name: which one would the server read?
        let sni = [0u8, 8, 0, 0, 5, b'e', b'v', b'i', b'l', b'x'];
        let twice = edited("api.stripe.com", |b| append_extension(b, 0, &sni));
        assert!(matches!(parse(&twice), Hello::Malformed(_)));
        let odd_name = [0u8, 6, 0, 0, 3, b'a', b' ', b'b'];
        let bad = edited("127.0.0.1", |b| append_extension(b, 0, &odd_name));
        assert!(matches!(parse(&bad), Hello::Malformed(_)));
        let trailing = edited("a.test", |b| b.push(0));
        assert!(matches!(parse(&trailing), Hello::Malformed(_)));
    }

    /// Random bytes, bit flips and truncations of real hellos: an answer, never a panic.
    #[test]
    fn garbage_never_panics() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let hello = rustls_hello("api.stripe.com");
        for _ in 0..20_000 {
            let mut buf = if next() % 2 == 0 {
                hello.clone()
            } else {
                let n = (next() % 600) as usize;
                let mut b: Vec<u8> = (0..n).map(|_| next() as u8).collect();
                if let Some(first) = b.first_mut() {
                    *first = 22;
                }
                b
            };
            for _ in 0..(next() % 4) {
                if !buf.is_empty() {
                    let i = (next() as usize) % buf.len();
                    buf[i] ^= 1 << (next() % 8);
                }
            }
            let cut = (next() as usize) % (buf.len() + 1);
            let _ = parse(&buf[..cut]);
            let _ = parse(&buf);
        }
    }
}
