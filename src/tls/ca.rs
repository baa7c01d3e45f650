//! The proxy's own certificate authority: made once per installation (`idemproxy ca init`),
//! loaded at start-up, and used to sign a short-lived leaf certificate per intercepted host.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PublicKeyData, SanType, SerialNumber, PKCS_ECDSA_P256_SHA256,
};
use rustls_pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use time::OffsetDateTime;

/// The CA certificate lives ten years: replacing it means redeploying every worker's trust.
const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Leaves stay far below the 200-day limit browsers and some TLS stacks enforce.
pub const LEAF_VALIDITY: Duration = Duration::from_secs(30 * 24 * 3600);
/// Back-dating tolerates workers whose clocks run behind the proxy's.
const BACKDATE: Duration = Duration::from_secs(3600);

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("{}: cannot read: {error}", path.display())]
    Read {
        path: PathBuf,
        // Not `source`: the message says it already, and a source is printed again.
        error: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
    #[error("{} is not the private key of {}; configure the pair `idemproxy ca init` wrote together", key.display(), cert.display())]
    Mismatch { cert: PathBuf, key: PathBuf },
    #[error("cannot create the CA: {0}")]
    Generate(rcgen::Error),
}

impl CaError {
    /// The config field an operator has to fix.
    pub fn field(&self) -> &'static str {
        match self {
            CaError::Read { path, .. } | CaError::Invalid { path, .. }
                if path.extension().is_some_and(|e| e == "key") =>
            {
                "tls.ca_key"
            }
            CaError::Mismatch { .. } => "tls.ca_key",
            _ => "tls.ca_cert",
        }
    }
}

/// A freshly created CA, as the PEM text to write to disk.
pub struct NewCa {
    pub cert_pem: String,
    pub key_pem: String,
    pub not_after: OffsetDateTime,
}

/// A leaf certificate chain (leaf, CA) and its private key, ready for rustls.
pub struct Leaf {
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
}

pub struct CertAuthority {
    issuer: Issuer<'static, KeyPair>,
    cert: CertificateDer<'static>,
}

impl std::fmt::Debug for CertAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertAuthority").finish_non_exhaustive()
    }
}

impl CertAuthority {
    /// A new ECDSA P-256 CA that may sign leaf certificates only (path length 0).
    pub fn generate() -> Result<NewCa, CaError> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(CaError::Generate)?;
        let now = OffsetDateTime::now_utc();
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, "idemproxy interception CA");
        params
            .distinguished_name
            .push(DnType::OrganizationName, "idemproxy");
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.not_before = now - BACKDATE;
        params.not_after = now + CA_VALIDITY;
        params.serial_number = Some(random_serial());
        let cert = params.self_signed(&key).map_err(CaError::Generate)?;
        Ok(NewCa {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            not_after: params.not_after,
        })
    }

    /// Loads the pair from PEM files, refusing a certificate that is not a CA, has expired,
    /// or does not belong to the key.
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<CertAuthority, CaError> {
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|source| CaError::Read {
                path: path.to_path_buf(),
                error: source,
            })
        };
        let invalid = |path: &Path, message: String| CaError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        let cert_pem = read(cert_path)?;
        let key_pem = read(key_path)?;
        // A file holding a chain is fine: the first certificate is the one that signs.
        let cert = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
            .next()
            .ok_or_else(|| invalid(cert_path, "holds no PEM certificate".into()))?
            .map_err(|e| invalid(cert_path, format!("is not a PEM certificate: {e}")))?;
        let key = KeyPair::from_pem(&key_pem)
            .map_err(|e| invalid(key_path, format!("is not a PEM private key: {e}")))?;

        let (_, parsed) = x509_parser::parse_x509_certificate(&cert)
            .map_err(|e| invalid(cert_path, format!("is not an X.509 certificate: {e}")))?;
        if !parsed.is_ca() {
            return Err(invalid(
                cert_path,
                "is not a CA certificate (no basicConstraints CA:TRUE); create one with `idemproxy ca init`".into(),
            ));
        }
        if parsed.validity().not_after.timestamp() <= OffsetDateTime::now_utc().unix_timestamp() {
            return Err(invalid(
                cert_path,
                "has expired; create a new CA with `idemproxy ca init --force` and give workers the new certificate".into(),
            ));
        }
        if parsed.public_key().raw != key.subject_public_key_info().as_slice() {
            return Err(CaError::Mismatch {
                cert: cert_path.to_path_buf(),
                key: key_path.to_path_buf(),
            });
        }
        let issuer = Issuer::from_ca_cert_der(&cert, key)
            .map_err(|e| invalid(cert_path, format!("cannot sign with this CA: {e}")))?;
        Ok(CertAuthority {
            issuer,
            cert: cert.into_owned(),
        })
    }

    pub fn cert(&self) -> &CertificateDer<'static> {
        &self.cert
    }

    /// When the CA's certificate expires.
    pub fn not_after(&self) -> Option<OffsetDateTime> {
        let (_, parsed) = x509_parser::parse_x509_certificate(&self.cert).ok()?;
        OffsetDateTime::from_unix_timestamp(parsed.validity().not_after.timestamp()).ok()
    }

    /// A leaf for `host` (a DNS name or an IP address) with a fresh P-256 key.
    pub fn issue(&self, host: &str) -> Result<Leaf, rcgen::Error> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
        let now = OffsetDateTime::now_utc();
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        // CN is limited to 64 characters; the SAN is what clients check anyway.
        if host.len() < 64 {
            params.distinguished_name.push(DnType::CommonName, host);
        }
        params.subject_alt_names = vec![match host.parse::<IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(host.to_string().try_into()?),
        }];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        params.not_before = now - BACKDATE;
        params.not_after = now + LEAF_VALIDITY;
        params.serial_number = Some(random_serial());
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Leaf {
            chain: vec![cert.der().clone(), self.cert.clone()],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        })
    }
}

/// 16 random bytes, positive (top bit clear), as RFC 5280 asks.
fn random_serial() -> SerialNumber {
    let mut bytes: [u8; 16] = rand::random();
    bytes[0] &= 0x7f;
    SerialNumber::from_slice(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_pair(dir: &Path, ca: &NewCa) -> (PathBuf, PathBuf) {
        let cert = dir.join("ca.pem");
        let key = dir.join("ca.key");
        std::fs::write(&cert, &ca.cert_pem).expect("test setup");
        std::fs::write(&key, &ca.key_pem).expect("test setup");
        (cert, key)
    }

    #[test]
    fn generated_ca_loads_and_issues_a_short_lived_leaf_for_its_host() {
        let dir = tempfile::tempdir().expect("test setup");
        let (cert, key) = write_pair(dir.path(), &CertAuthority::generate().expect("test setup"));
        let ca = CertAuthority::load(&cert, &key).expect("test setup");
        let leaf = ca.issue("api.example.com").expect("test setup");
        assert_eq!(leaf.chain.len(), 2);
        let (_, parsed) = x509_parser::parse_x509_certificate(&leaf.chain[0]).expect("test setup");
        assert!(!parsed.is_ca());
        let validity = parsed.validity();
        let now = OffsetDateTime::now_utc().unix_timestamp();
        assert!(validity.not_before.timestamp() <= now - 3000, "back-dated");
        let days = (validity.not_after.timestamp() - now) / 86400;
        assert!((29..=30).contains(&days), "valid for {days} days");
        let san = parsed
            .subject_alternative_name()
            .expect("test setup")
            .expect("test setup");
        assert_eq!(
            format!("{:?}", san.value.general_names),
            "[DNSName(\"api.example.com\")]"
        );

        let ip_leaf = ca.issue("127.0.0.1").expect("test setup");
        let (_, parsed) =
            x509_parser::parse_x509_certificate(&ip_leaf.chain[0]).expect("test setup");
        let san = parsed
            .subject_alternative_name()
            .expect("test setup")
            .expect("test setup");
        assert_eq!(
            format!("{:?}", san.value.general_names),
            "[IPAddress([127, 0, 0, 1])]"
        );
    }

    #[test]
    fn a_key_from_another_ca_is_refused_naming_the_key_field() {
        let dir = tempfile::tempdir().expect("test setup");
        let (cert, _) = write_pair(dir.path(), &CertAuthority::generate().expect("test setup"));
        let other = CertAuthority::generate().expect("test setup");
        let key = dir.path().join("other.key");
        std::fs::write(&key, &other.key_pem).expect("test setup");
        let err = CertAuthority::load(&cert, &key).unwrap_err();
        assert!(matches!(err, CaError::Mismatch { .. }), "{err}");
        assert_eq!(err.field(), "tls.ca_key");
    }

    #[test]
    fn missing_and_garbage_files_are_clear_errors() {
        let dir = tempfile::tempdir().expect("test setup");
        let (cert, key) = write_pair(dir.path(), &CertAuthority::generate().expect("test setup"));
        let err = CertAuthority::load(&dir.path().join("nope.pem"), &key).unwrap_err();
        assert_eq!(err.field(), "tls.ca_cert");
        assert!(err.to_string().contains("nope.pem: cannot read"), "{err}");
        std::fs::write(&key, "not a key").expect("test setup");
        let err = CertAuthority::load(&cert, &key).unwrap_err();
        assert_eq!(err.field(), "tls.ca_key");
        // A leaf is not a CA.
        let leaf = rcgen::generate_simple_self_signed(vec!["x.test".into()]).expect("test setup");
        std::fs::write(&cert, leaf.cert.pem()).expect("test setup");
        std::fs::write(&key, leaf.signing_key.serialize_pem()).expect("test setup");
        let err = CertAuthority::load(&cert, &key).unwrap_err();
        assert!(err.to_string().contains("is not a CA certificate"), "{err}");
    }
}
