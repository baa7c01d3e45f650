//! `idemproxy env`: everything a worker needs so that provider SDKs, as shipped, go through the
//! proxy and trust its CA, for every runtime, with no change to the tools' code.
//!
//! The usual variables (`HTTPS_PROXY`, `SSL_CERT_FILE`, …) are not enough: the stripe Python
//! SDK pins its own CA bundle, aiohttp ignores proxy variables unless `trust_env=True`,
//! botocore reads `AWS_CA_BUNDLE`, Node's https agents and (before 22.21) its built-in fetch
//! ignore `HTTPS_PROXY`, and Java reads neither variables nor PEM files. So besides the
//! variables, this writes a few files next to the CA (in `<dir>/worker/`) that workers mount
//! read-only with `ca.pem` and `ca-bundle.pem`, never `ca.key` (this never reads it):
//!
//! - `worker.env`: the variables, in Docker's `--env-file` format (also read by the Python hook
//!   in processes started with a cleaned environment);
//! - `python/`: a start-up hook (`sitecustomize.py` for `PYTHONPATH`, `idemproxy-worker.pth`
//!   for site-packages) that points stripe's pinned bundle at the proxy's and makes aiohttp
//!   trust the environment;
//! - `node/idemproxy-worker.cjs`: a `--require` preload that tunnels every `https.Agent`
//!   through `HTTPS_PROXY` and gives built-in fetch undici's `EnvHttpProxyAgent`;
//! - `java/truststore.jks`: the system roots plus the CA, for `javax.net.ssl.trustStore`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use rustls_pki_types::{pem::PemObject, CertificateDer};

use crate::tls::init::{BUNDLE_FILE, CERT_FILE, KEY_FILE};

/// The subdirectory of the CA directory that holds the worker files.
pub const WORKER_SUBDIR: &str = "worker";
/// Password of the Java trust store: Java's conventional one. It guards integrity only; the
/// store holds public certificates.
pub const TRUSTSTORE_PASSWORD: &str = "changeit";

const PYTHON_HOOK: &str = include_str!("files/idemproxy_worker.py");
const PYTHON_SITECUSTOMIZE: &str = include_str!("files/sitecustomize.py");
const NODE_PRELOAD: &str = include_str!("files/idemproxy-worker.cjs");

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// `export NAME='value'` lines for a shell (`eval "$(idemproxy env)"`).
    Shell,
    /// `NAME=value` lines for `docker run --env-file` (no quotes, no expansion).
    EnvFile,
    /// The `environment:` and `volumes:` blocks of a compose service.
    Compose,
}

#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    #[error("{}: missing: run `idemproxy ca init --dir {}` first", path.display(), dir.display())]
    NoCa { path: PathBuf, dir: PathBuf },
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: cannot write: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
    #[error("--proxy-url {url}: {message}")]
    ProxyUrl { url: String, message: String },
}

/// `idemproxy env`'s arguments.
#[derive(Debug, clap::Args)]
pub struct EnvArgs {
    /// The CA directory `idemproxy ca init` wrote (ca.pem, ca-bundle.pem; ca.key is never read).
    #[arg(long, default_value = "certs")]
    pub dir: PathBuf,
    /// The proxy as workers reach it (printed as HTTPS_PROXY).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub proxy_url: String,
    /// Where workers see --dir (a read-only volume mount); default: --dir itself.
    #[arg(long)]
    pub worker_dir: Option<PathBuf>,
    /// Hosts workers reach directly, not through the proxy.
    #[arg(long, default_value = "localhost,127.0.0.1,::1")]
    pub no_proxy: String,
    /// shell: export lines; env-file: `docker run --env-file`; compose: a service's
    /// `environment:` and `volumes:`.
    #[arg(long, value_enum, default_value = "shell")]
    pub format: Format,
}

/// Writes the worker files and returns what to print.
pub fn run(args: &EnvArgs) -> Result<String, EnvError> {
    let setup = write(&EnvOptions {
        dir: args.dir.clone(),
        proxy_url: args.proxy_url.clone(),
        worker_dir: args.worker_dir.clone(),
        no_proxy: args.no_proxy.clone(),
    })?;
    Ok(instructions(&setup, args.format))
}

pub struct EnvOptions {
    /// The CA directory `ca init` wrote (`ca.pem`, `ca-bundle.pem`).
    pub dir: PathBuf,
    /// The proxy as workers reach it (`http://[user:secret@]host:port`).
    pub proxy_url: String,
    /// Where workers see `dir`; defaults to `dir` itself.
    pub worker_dir: Option<PathBuf>,
    /// Hosts workers reach directly (comma-separated, curl's `NO_PROXY` syntax).
    pub no_proxy: String,
}

/// One variable of the worker environment, and which runtime reads it.
pub struct Var {
    pub name: &'static str,
    pub value: String,
    pub runtime: Runtime,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runtime {
    All,
    Python,
    Node,
    Java,
}

impl Runtime {
    fn heading(self) -> &'static str {
        match self {
            Runtime::All => "Every runtime: the proxy, and the CA for OpenSSL (Python ssl/urllib/httpx/aiohttp, curl, Go, Ruby, PHP)",
            Runtime::Python => "Python: requests (twilio, alpaca-py), botocore (boto3), and the start-up hook (stripe's pinned CA bundle, aiohttp's trust_env)",
            Runtime::Node => "Node.js: the CA (added to Node's own roots), and the preload (stripe's https.Agent, built-in fetch)",
            Runtime::Java => "Java (java.net.http, HttpURLConnection): proxy and trust store as system properties",
        }
    }
}

/// What `write` produced: the variables and the files workers mount.
pub struct Setup {
    pub vars: Vec<Var>,
    /// (path on this host, path in the worker): mount each read-only.
    pub mounts: Vec<(PathBuf, PathBuf)>,
    /// The worker files just written.
    pub written: Vec<PathBuf>,
    pub worker_dir: PathBuf,
    /// The proxy URL carries credentials (a tenant): Java cannot send them from properties.
    pub proxy_has_credentials: bool,
}

impl Setup {
    pub fn var(&self, name: &str) -> Option<&str> {
        self.vars
            .iter()
            .find(|v| v.name == name)
            .map(|v| v.value.as_str())
    }
}

/// Reads the CA directory (never the key), writes `<dir>/worker/`, and returns the setup.
pub fn write(opts: &EnvOptions) -> Result<Setup, EnvError> {
    let ca = read_ca(&opts.dir)?;
    let proxy = ProxyUrl::parse(&opts.proxy_url)?;
    let worker_dir = match &opts.worker_dir {
        Some(d) => d.clone(),
        None => std::fs::canonicalize(&opts.dir).map_err(read_err(&opts.dir))?,
    };
    let files = WorkerFiles::under(&opts.dir.join(WORKER_SUBDIR));
    let worker_files = WorkerFiles::under(&worker_dir.join(WORKER_SUBDIR));
    let vars = worker_vars(opts, &proxy, &worker_dir, &worker_files);
    let written = write_files(&files, &worker_files, &vars, &ca)?;
    let host_worker = opts.dir.join(WORKER_SUBDIR);
    let mounts = vec![
        (ca.cert, worker_dir.join(CERT_FILE)),
        (ca.bundle, worker_dir.join(BUNDLE_FILE)),
        (host_worker, worker_dir.join(WORKER_SUBDIR)),
    ];
    Ok(Setup {
        vars,
        mounts,
        written,
        worker_dir,
        proxy_has_credentials: proxy.has_credentials,
    })
}

fn read_err(path: &Path) -> impl FnOnce(std::io::Error) -> EnvError {
    let path = path.to_path_buf();
    move |source| EnvError::Read { path, source }
}

/// The CA as `ca init` left it: its certificate, and the bundle of system roots plus it.
struct Ca {
    cert: PathBuf,
    bundle: PathBuf,
    der: CertificateDer<'static>,
    roots: Vec<CertificateDer<'static>>,
}

/// Reads `ca.pem` and `ca-bundle.pem` from `dir`, and checks that the bundle holds the CA.
fn read_ca(dir: &Path) -> Result<Ca, EnvError> {
    let cert = dir.join(CERT_FILE);
    let bundle = dir.join(BUNDLE_FILE);
    if !cert.exists() {
        return Err(EnvError::NoCa {
            path: cert,
            dir: dir.to_path_buf(),
        });
    }
    if !bundle.exists() {
        return Err(EnvError::Invalid {
            path: bundle,
            message: format!(
                "missing (`ca init` found no system roots to combine with the CA): write the \
                 system's PEM roots followed by {} to it",
                cert.display()
            ),
        });
    }
    let ca_pem = std::fs::read(&cert).map_err(read_err(&cert))?;
    let bundle_pem = std::fs::read(&bundle).map_err(read_err(&bundle))?;
    let der = CertificateDer::pem_slice_iter(&ca_pem)
        .next()
        .and_then(Result::ok)
        .ok_or_else(|| EnvError::Invalid {
            path: cert.clone(),
            message: "no PEM certificate".into(),
        })?;
    let roots: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&bundle_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| EnvError::Invalid {
            path: bundle.clone(),
            message: format!("not a PEM bundle: {e}"),
        })?;
    if !roots.contains(&der) {
        return Err(EnvError::Invalid {
            path: bundle.clone(),
            message: format!(
                "does not contain {} (a bundle from an older CA?): run `idemproxy ca init --force`",
                cert.display()
            ),
        });
    }
    Ok(Ca {
        cert,
        bundle,
        der,
        roots,
    })
}

/// The variables, with every path as the worker sees it.
fn worker_vars(
    opts: &EnvOptions,
    proxy: &ProxyUrl,
    worker_dir: &Path,
    worker_files: &WorkerFiles,
) -> Vec<Var> {
    let at_worker = |rel: &str| worker_dir.join(rel).display().to_string();
    let trust = at_worker(BUNDLE_FILE);
    let mut vars = vec![
        var("HTTPS_PROXY", &opts.proxy_url, Runtime::All),
        var("https_proxy", &opts.proxy_url, Runtime::All),
        var("NO_PROXY", &opts.no_proxy, Runtime::All),
        var("no_proxy", &opts.no_proxy, Runtime::All),
        var("SSL_CERT_FILE", &trust, Runtime::All),
        var("CURL_CA_BUNDLE", &trust, Runtime::All),
        var("REQUESTS_CA_BUNDLE", &trust, Runtime::Python),
        var("AWS_CA_BUNDLE", &trust, Runtime::Python),
        var("IDEMPROXY_CA_BUNDLE", &trust, Runtime::Python),
        var(
            "PYTHONPATH",
            &worker_files.python.display().to_string(),
            Runtime::Python,
        ),
        var("NODE_EXTRA_CA_CERTS", &at_worker(CERT_FILE), Runtime::Node),
        var(
            "NODE_OPTIONS",
            &format!("--require={}", worker_files.node_preload.display()),
            Runtime::Node,
        ),
        var("NODE_USE_ENV_PROXY", "1", Runtime::Node),
    ];
    vars.push(var(
        "JAVA_TOOL_OPTIONS",
        &[
            format!("-Dhttps.proxyHost={}", proxy.host),
            format!("-Dhttps.proxyPort={}", proxy.port),
            format!(
                "-Dhttp.nonProxyHosts={}",
                java_non_proxy_hosts(&opts.no_proxy)
            ),
            format!(
                "-Djavax.net.ssl.trustStore={}",
                worker_files.truststore.display()
            ),
            "-Djavax.net.ssl.trustStoreType=JKS".to_string(),
            format!("-Djavax.net.ssl.trustStorePassword={TRUSTSTORE_PASSWORD}"),
        ]
        .join(" "),
        Runtime::Java,
    ));
    vars
}

/// Writes `contents` to `path` with mode 0600, also over a file that was there with a wider
/// one: created so (never readable by others for a moment), then narrowed if it existed.
fn write_private(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    #[cfg(unix)]
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    options.mode(0o600);
    let mut file = options.open(path)?;
    #[cfg(unix)]
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    file.write_all(contents)?;
    file.sync_all()
}

/// Writes the worker files at `files` (the `.pth` names the Python hook's directory as the
/// worker sees it) and returns what it wrote.
fn write_files(
    files: &WorkerFiles,
    worker_files: &WorkerFiles,
    vars: &[Var],
    ca: &Ca,
) -> Result<Vec<PathBuf>, EnvError> {
    let env_file = render(
        vars,
        Format::EnvFile,
        "Written by `idemproxy env`: the worker environment (docker run --env-file). The Python\n\
         # hook reads it in processes started without these variables.",
    );
    let mut written = Vec::new();
    let mut put = |path: &Path, contents: &[u8], private: bool| -> Result<(), EnvError> {
        let failed = |source| EnvError::Write {
            path: path.to_path_buf(),
            source,
        };
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|source| EnvError::Write {
                path: parent.to_path_buf(),
                source,
            })?;
        }
        if private {
            write_private(path, contents).map_err(failed)?;
        } else {
            std::fs::write(path, contents).map_err(failed)?;
        }
        written.push(path.to_path_buf());
        Ok(())
    };
    // The env file holds the proxy URL with the tenant's secret: readable by its owner only.
    put(&files.env_file, env_file.as_bytes(), true)?;
    put(
        &files.python.join("idemproxy_worker.py"),
        PYTHON_HOOK.as_bytes(),
        false,
    )?;
    put(
        &files.python.join("sitecustomize.py"),
        PYTHON_SITECUSTOMIZE.as_bytes(),
        false,
    )?;
    put(
        &files.python.join(PTH_FILE),
        format!(
            "{}\nimport idemproxy_worker\n",
            worker_files.python.display()
        )
        .as_bytes(),
        false,
    )?;
    put(&files.node_preload, NODE_PRELOAD.as_bytes(), false)?;
    put(
        &files.truststore,
        &jks_truststore(&ca.roots, &ca.der, TRUSTSTORE_PASSWORD, now_ms()),
        false,
    )?;
    Ok(written)
}

/// The `.pth` file an image copies (or links) into site-packages.
pub const PTH_FILE: &str = "idemproxy-worker.pth";

struct WorkerFiles {
    env_file: PathBuf,
    python: PathBuf,
    node_preload: PathBuf,
    truststore: PathBuf,
}

impl WorkerFiles {
    fn under(dir: &Path) -> WorkerFiles {
        WorkerFiles {
            env_file: dir.join("worker.env"),
            python: dir.join("python"),
            node_preload: dir.join("node").join("idemproxy-worker.cjs"),
            truststore: dir.join("java").join("truststore.jks"),
        }
    }
}

fn var(name: &'static str, value: &str, runtime: Runtime) -> Var {
    Var {
        name,
        value: value.to_string(),
        runtime,
    }
}

struct ProxyUrl {
    host: String,
    port: u16,
    has_credentials: bool,
}

impl ProxyUrl {
    /// `http://[user:secret@]host[:port][/]`. The credentials are kept as written (a compose
    /// file's `${SECRET}` stays for compose to fill in); only the host and port are read.
    fn parse(url: &str) -> Result<ProxyUrl, EnvError> {
        let err = |message: &str| EnvError::ProxyUrl {
            url: url.to_string(),
            message: message.to_string(),
        };
        let rest = url.strip_prefix("http://").ok_or_else(|| {
            err("workers reach the proxy as http://host:port (HTTPS to the provider goes through CONNECT)")
        })?;
        let authority = rest.split('/').next().unwrap_or_default();
        let (credentials, host_port) = match authority.rsplit_once('@') {
            Some((user, host)) => (Some(user), host),
            None => (None, authority),
        };
        let parsed: http::uri::Authority =
            host_port.parse().map_err(|_| err("no valid host:port"))?;
        if parsed.host().is_empty() {
            return Err(err("no host"));
        }
        Ok(ProxyUrl {
            host: parsed.host().to_string(),
            port: parsed.port_u16().unwrap_or(80),
            has_credentials: credentials.is_some(),
        })
    }
}

/// `NO_PROXY` as Java's `http.nonProxyHosts`: `|`-separated, `*.` for a domain's subdomains.
fn java_non_proxy_hosts(no_proxy: &str) -> String {
    no_proxy
        .split([',', ' '])
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(|h| match h.strip_prefix('.') {
            Some(domain) => format!("*.{domain}"),
            None if h.contains(':') && !h.starts_with('[') => format!("[{h}]"),
            None => h.to_string(),
        })
        .collect::<Vec<_>>()
        .join("|")
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A Java KeyStore (JKS, which every JDK reads) holding `roots` as trusted certificates: the
/// format of `sun.security.provider.JavaKeyStore`, version 2, with its SHA-1 integrity digest
/// over the password (UTF-16BE), the phrase "Mighty Aphrodite" and the store.
fn jks_truststore(
    roots: &[CertificateDer<'_>],
    ca: &CertificateDer<'_>,
    password: &str,
    created_ms: u64,
) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&0xFEED_FEEDu32.to_be_bytes());
    out.extend_from_slice(&2u32.to_be_bytes());
    out.extend_from_slice(&(roots.len() as u32).to_be_bytes());
    let mut n = 0;
    for cert in roots {
        let alias = if cert == ca {
            "idemproxy-ca".to_string()
        } else {
            n += 1;
            format!("root-{n}")
        };
        out.extend_from_slice(&2u32.to_be_bytes()); // a trusted certificate entry
        write_java_utf(&mut out, &alias);
        out.extend_from_slice(&created_ms.to_be_bytes());
        write_java_utf(&mut out, "X.509");
        out.extend_from_slice(&(cert.len() as u32).to_be_bytes());
        out.extend_from_slice(cert);
    }
    let mut sha1 = sha1_smol::Sha1::new();
    for unit in password.encode_utf16() {
        sha1.update(&unit.to_be_bytes());
    }
    sha1.update(b"Mighty Aphrodite");
    sha1.update(&out);
    out.extend_from_slice(&sha1.digest().bytes());
    out
}

/// `DataOutputStream.writeUTF` for ASCII text: a 16-bit length, then the bytes.
fn write_java_utf(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(&(text.len() as u16).to_be_bytes());
    out.extend_from_slice(text.as_bytes());
}

/// The variables in `format`, grouped by runtime, under a comment.
pub fn render(vars: &[Var], format: Format, header: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# {header}");
    if format == Format::Compose {
        let _ = writeln!(out, "    environment:");
    }
    let mut last = None;
    for v in vars {
        if last != Some(v.runtime) {
            last = Some(v.runtime);
            let indent = if format == Format::Compose {
                "      "
            } else {
                ""
            };
            let _ = writeln!(out, "{indent}# {}", v.runtime.heading());
        }
        let _ = match format {
            Format::Shell => writeln!(out, "export {}={}", v.name, shell_quote(&v.value)),
            Format::EnvFile => writeln!(out, "{}={}", v.name, v.value),
            Format::Compose => writeln!(out, "      {}: {}", v.name, yaml_quote(&v.value)),
        };
    }
    out
}

/// A bind mount's source as Docker and compose read it: a relative path starts with `./`
/// (compose takes a bare name for a named volume).
fn bind_source(path: &Path) -> String {
    let text = path.display().to_string();
    if path.is_relative() && !text.starts_with('.') {
        format!("./{text}")
    } else {
        text
    }
}

fn shell_quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', r#"'\''"#))
}

/// A YAML double-quoted scalar (JSON string syntax is valid YAML).
fn yaml_quote(value: &str) -> String {
    serde_json::Value::String(value.to_string()).to_string()
}

/// What `idemproxy env` prints: the variables in `format`, what to mount, and the optional
/// image steps.
pub fn instructions(setup: &Setup, format: Format) -> String {
    let header = format!(
        "idemproxy worker setup (idemproxy env). Workers see the CA directory at {}:\n\
         # mount ca.pem, ca-bundle.pem and worker/ read-only, never {KEY_FILE}.",
        setup.worker_dir.display()
    );
    let mut out = render(&setup.vars, format, &header);
    let mounts: Vec<String> = setup
        .mounts
        .iter()
        .map(|(host, worker)| format!("{}:{}:ro", bind_source(host), worker.display()))
        .collect();
    match format {
        Format::Compose => {
            let _ = writeln!(out, "    volumes:");
            for m in &mounts {
                let _ = writeln!(out, "      - {}", yaml_quote(m));
            }
        }
        Format::Shell | Format::EnvFile => {
            let _ = writeln!(
                out,
                "# Mounts (docker run -v …, or the same paths on the worker's host):"
            );
            for m in &mounts {
                let _ = writeln!(out, "#   -v {m}");
            }
        }
    }
    let pth = setup
        .worker_dir
        .join(WORKER_SUBDIR)
        .join("python")
        .join(PTH_FILE);
    let _ = writeln!(
        out,
        "# Optional image step, for Python processes started with a cleaned environment (CrewAI's\n\
         # MCP stdio servers get only HOME, PATH, SHELL, TERM, USER, LOGNAME): load the hook from\n\
         # site-packages, so it restores this environment from worker/worker.env:\n\
         #   RUN ln -s {} \"$(python3 -c 'import sysconfig; print(sysconfig.get_path(\"purelib\"))')/\"",
        pth.display()
    );
    if setup.proxy_has_credentials {
        let _ = writeln!(
            out,
            "# Java: system properties cannot carry the proxy's credentials; a Java worker needs an\n\
             # Authenticator in code and -Djdk.http.auth.tunneling.disabledSchemes= (see docs/workers.md)."
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn java_non_proxy_hosts_converts_no_proxy() {
        assert_eq!(
            java_non_proxy_hosts("localhost,127.0.0.1,::1,.internal"),
            "localhost|127.0.0.1|[::1]|*.internal"
        );
    }

    #[test]
    fn proxy_urls_keep_credentials_as_written() {
        let p = ProxyUrl::parse("http://worker:${SECRET:?set it}@idemproxy:8080").expect("url");
        assert_eq!(
            (p.host.as_str(), p.port, p.has_credentials),
            ("idemproxy", 8080, true)
        );
        let p = ProxyUrl::parse("http://[::1]").expect("url");
        assert_eq!(
            (p.host.as_str(), p.port, p.has_credentials),
            ("[::1]", 80, false)
        );
        assert!(ProxyUrl::parse("https://idemproxy:8443").is_err());
    }

    #[test]
    fn shell_quoting_survives_quotes() {
        assert_eq!(shell_quote("a'b"), r#"'a'\''b'"#);
    }
}
