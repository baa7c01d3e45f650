//! What a failed TLS handshake with an upstream most likely means, and what to do about it.
//! The advice goes into the 502's detail and the log line, so whoever sees either can act.

use std::net::IpAddr;
use std::time::{Duration, UNIX_EPOCH};

use rustls::{CertificateError, Error};
use rustls_pki_types::UnixTime;

/// Said wherever `upstream_ca` is advised: a changed file needs a reload to take effect.
const WHEN_READ: &str = "The proxy reads upstream_ca at start-up and when it reloads its config (SIGHUP, or POST /v1/reload on the admin listener).";

/// The likely cause of `error` on a handshake with `host`, and the fix.
pub fn advice(error: &Error, host: &str) -> String {
    match error {
        Error::InvalidCertificate(cert) => certificate(cert, host),
        Error::InvalidMessage(_) | Error::InappropriateMessage { .. } => format!(
            "{host} did not answer with TLS. If it serves plain HTTP, write the route's upstream as http://; if it serves TLS on another port, name that port."
        ),
        Error::AlertReceived(alert) => format!(
            "{host} refused the handshake ({alert:?}): it may want another TLS version or server name, or a client certificate."
        ),
        _ => check_by_hand(host),
    }
}

fn certificate(error: &CertificateError, host: &str) -> String {
    match error {
        CertificateError::Other(other) if other.0.to_string() == "CaUsedAsEndEntity" => {
            ca_used_as_leaf(host)
        }
        CertificateError::UnknownIssuer => format!(
            "The certificate of {host} is not signed by a CA the proxy trusts. For a private or self-run upstream, put the CA that signed it (PEM) in the route's upstream_ca. {WHEN_READ}"
        ),
        // rustls's own message already lists the names the certificate carries.
        CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => format!(
            "TLS clients match the subjectAltName, not the common name: issue the certificate with subjectAltName DNS:{host}, or make the route's upstream a name the certificate carries (connect_to dials another address and still verifies that name)."
        ),
        CertificateError::Expired => expired(host, ""),
        CertificateError::ExpiredContext { not_after, .. } => {
            expired(host, &format!(" on {}", date(*not_after)))
        }
        CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => format!(
            "The certificate of {host} is not valid yet: check the clock of this machine and of whoever issued it."
        ),
        CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. } => format!(
            "The certificate of {host} is not for TLS servers: issue it with extendedKeyUsage serverAuth (or without extendedKeyUsage)."
        ),
        _ => check_by_hand(host),
    }
}

/// `openssl req -x509` makes a CA certificate, and webpki (rightly) refuses one as a server's
/// own certificate. The commands make a CA and a leaf it signs; tests run them as written.
fn ca_used_as_leaf(host: &str) -> String {
    let san = match host.parse::<IpAddr>() {
        Ok(_) => format!("IP:{host}"),
        Err(_) => format!("DNS:{host}"),
    };
    format!(
        "The upstream presents a CA certificate (what openssl req -x509 makes) as its server certificate; TLS needs a leaf certificate signed by a CA. \
         Make a CA and a leaf for {host}, serve server.pem with server.key, and set the route's upstream_ca to ca.pem: \
         `openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj '/CN=upstream test CA' -keyout ca.key -out ca.pem \
         && openssl req -newkey rsa:2048 -nodes -subj '/CN={host}' -keyout server.key -out server.csr \
         && printf 'subjectAltName={san}\\n' > server.ext \
         && openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 365 -extfile server.ext -out server.pem`. \
         {WHEN_READ}"
    )
}

fn expired(host: &str, when: &str) -> String {
    format!(
        "The certificate of {host} expired{when}: renew it on the upstream (if it has not, check this machine's clock)."
    )
}

fn check_by_hand(host: &str) -> String {
    format!(
        "See what {host} presents with `openssl s_client -connect {host}:443 -servername {host} -showcerts` (use the port the route dials)."
    )
}

fn date(t: UnixTime) -> String {
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(t.as_secs())).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn each_certificate_failure_names_its_fix() {
        let ca_as_leaf = Error::InvalidCertificate(CertificateError::Other(rustls::OtherError(
            Arc::new(std::io::Error::other("CaUsedAsEndEntity")),
        )));
        let a = advice(&ca_as_leaf, "api.local.test");
        assert!(
            a.contains("leaf") && a.contains("DNS:api.local.test"),
            "{a}"
        );
        assert!(advice(&ca_as_leaf, "127.0.0.1").contains("IP:127.0.0.1"));
        let a = advice(
            &Error::InvalidCertificate(CertificateError::UnknownIssuer),
            "h",
        );
        assert!(a.contains("upstream_ca") && a.contains("SIGHUP"), "{a}");
        let a = advice(
            &Error::InvalidCertificate(CertificateError::ExpiredContext {
                time: UnixTime::since_unix_epoch(Duration::from_secs(1_800_000_000)),
                not_after: UnixTime::since_unix_epoch(Duration::from_secs(1_700_000_000)),
            }),
            "h",
        );
        assert!(a.contains("expired on 2023-11-14"), "{a}");
    }
}
