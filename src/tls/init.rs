//! `idemproxy ca init`: writes a new CA into a directory and tells the operator exactly what
//! the proxy and each worker must set to use it.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use super::ca::{CaError, CertAuthority};

pub const CERT_FILE: &str = "ca.pem";
pub const KEY_FILE: &str = "ca.key";
/// System roots plus the proxy's CA: for clients whose CA setting replaces their trust store
/// (OpenSSL's `SSL_CERT_FILE`, requests, curl), so tunnelled hosts still verify.
pub const BUNDLE_FILE: &str = "ca-bundle.pem";

/// Where distributions keep their PEM bundle of trusted roots.
const SYSTEM_BUNDLES: [&str; 3] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
];

#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("{} already exists; pass --force to replace the CA (every worker must then be given the new certificate)", .0.display())]
    Exists(PathBuf),
    #[error("{}: cannot write: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Ca(#[from] CaError),
}

pub struct InitOptions {
    pub dir: PathBuf,
    pub force: bool,
    /// The proxy as workers reach it, e.g. `http://idemproxy:8080`.
    pub proxy_url: String,
    /// Where workers see `dir` (a volume mount); defaults to `dir` itself.
    pub worker_dir: Option<PathBuf>,
    /// PEM bundle of system roots to combine with the CA; found automatically when unset.
    pub system_bundle: Option<PathBuf>,
}

pub struct Written {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub bundle: Option<PathBuf>,
    pub not_after: time::OffsetDateTime,
    /// False: the CA was there already and was kept (no `--force`).
    pub created: bool,
}

pub fn init(opts: &InitOptions) -> Result<Written, InitError> {
    let write_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| InitError::Write { path, source }
    };
    std::fs::create_dir_all(&opts.dir).map_err(write_err(&opts.dir))?;
    let dir = std::fs::canonicalize(&opts.dir).map_err(write_err(&opts.dir))?;
    let cert = dir.join(CERT_FILE);
    let key = dir.join(KEY_FILE);
    let bundle = dir.join(BUNDLE_FILE);
    if !opts.force {
        // A whole, valid CA is kept and its settings printed again: the step after `ca init`
        // needs them. Half of one, or a broken one, is an error.
        if cert.exists() && key.exists() {
            let ca = CertAuthority::load(&cert, &key)?;
            return Ok(Written {
                not_after: ca.not_after().unwrap_or_else(time::OffsetDateTime::now_utc),
                bundle: bundle.exists().then_some(bundle),
                cert,
                key,
                created: false,
            });
        }
        if let Some(existing) = [&cert, &key].into_iter().find(|p| p.exists()) {
            return Err(InitError::Exists(existing.clone()));
        }
    }
    let system_roots = match &opts.system_bundle {
        Some(path) => Some(
            std::fs::read_to_string(path).map_err(|source| CaError::Read {
                path: path.clone(),
                error: source,
            })?,
        ),
        None => SYSTEM_BUNDLES
            .iter()
            .find_map(|p| std::fs::read_to_string(p).ok()),
    };

    let ca = CertAuthority::generate()?;
    // The key goes first: a cert without its key is useless, a key without its cert is
    // harmless, and `--force` must never leave a new cert next to the old key.
    write_file(&key, &ca.key_pem, 0o600).map_err(write_err(&key))?;
    write_file(&cert, &ca.cert_pem, 0o644).map_err(write_err(&cert))?;
    let bundle = match system_roots {
        Some(roots) => {
            let mut text = roots;
            if !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str("# idemproxy interception CA\n");
            text.push_str(&ca.cert_pem);
            write_file(&bundle, &text, 0o644).map_err(write_err(&bundle))?;
            Some(bundle)
        }
        None => {
            // A stale bundle from an earlier CA would silently distrust the new one.
            let _ = std::fs::remove_file(&bundle);
            None
        }
    };
    Ok(Written {
        cert,
        key,
        bundle,
        not_after: ca.not_after,
        created: true,
    })
}

/// Writes through a temporary file and a rename, created with `mode` from the start so the
/// key is never readable by others, not even for a moment.
fn write_file(path: &Path, contents: &str, mode: u32) -> std::io::Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(
        ".{}.tmp-{}",
        name.unwrap_or_default(),
        std::process::id()
    ));
    let _ = std::fs::remove_file(&tmp);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(mode);
    }
    #[cfg(not(unix))]
    let _ = mode;
    let result = (|| {
        let mut f = options.open(&tmp)?;
        f.write_all(contents.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// What `ca init` prints: the files, the proxy's `[tls]` block and the worker environment.
pub fn instructions(written: &Written, opts: &InitOptions) -> String {
    let worker_dir = opts
        .worker_dir
        .clone()
        .or_else(|| written.cert.parent().map(Path::to_path_buf))
        .unwrap_or_default();
    let at_worker = |file: &str| worker_dir.join(file).display().to_string();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} the idemproxy CA (ECDSA P-256, valid until {}):",
        if written.created {
            "Created"
        } else {
            "Kept (it exists; --force replaces it)"
        },
        written.not_after.date()
    );
    let _ = writeln!(
        out,
        "  {}  certificate: give it to workers",
        written.cert.display()
    );
    let _ = writeln!(
        out,
        "  {}  private key (mode 0600): keep it on the proxy; never share or commit it",
        written.key.display()
    );
    let trust_file = match &written.bundle {
        Some(bundle) => {
            let _ = writeln!(
                out,
                "  {}  this machine's trusted roots + the CA, for workers",
                bundle.display()
            );
            at_worker(BUNDLE_FILE)
        }
        None => {
            let _ = writeln!(
                out,
                "  (no system root bundle found: build one on the worker with\n   cat /etc/ssl/certs/ca-certificates.crt {} > {})",
                at_worker(CERT_FILE),
                at_worker(BUNDLE_FILE)
            );
            at_worker(BUNDLE_FILE)
        }
    };
    let _ = writeln!(out, "\n# 1. Proxy config (idemproxy.toml):\n");
    let _ = writeln!(out, "[tls]");
    let _ = writeln!(out, "ca_cert = {:?}", written.cert.display().to_string());
    let _ = writeln!(out, "ca_key = {:?}", written.key.display().to_string());
    let _ = writeln!(
        out,
        "\n# 2. Worker environment. Workers see {CERT_FILE} and {BUNDLE_FILE} in {}:\n#    mount those two files read-only, never {KEY_FILE}.\n",
        worker_dir.display()
    );
    for (name, value) in [
        ("HTTPS_PROXY", opts.proxy_url.clone()),
        ("https_proxy", opts.proxy_url.clone()),
        ("NO_PROXY", "localhost,127.0.0.1,::1".to_string()),
        ("no_proxy", "localhost,127.0.0.1,::1".to_string()),
        ("SSL_CERT_FILE", trust_file.clone()),
        ("REQUESTS_CA_BUNDLE", trust_file.clone()),
        ("CURL_CA_BUNDLE", trust_file),
        ("NODE_EXTRA_CA_CERTS", at_worker(CERT_FILE)),
    ] {
        let _ = writeln!(out, "{name}={value}");
    }
    let _ = writeln!(
        out,
        "\n# 3. These are enough for curl, Go, requests, httpx and urllib, not for every SDK (the\n#    stripe Python SDK pins its own CA bundle; stripe-node, Node's fetch, aiohttp and Java\n#    ignore HTTPS_PROXY): `idemproxy env` prints the whole worker setup (docs/workers.md)."
    );
    out
}
