//! A worker as the setup `idemproxy env` prints it, in front of a proxy running a shipped
//! example config whose routes are dialled to local fakes (only `connect_to` and `upstream_ca`
//! change): what the SDK suites (`sdk_matrix`, `sdk_examples`) drive tools through.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use super::client::send;
use super::fakes::signed::{Fake, Ses, SES_HOST};
use super::pki::{ProxyCa, TestPki};
use super::proxy::{Proxy, StoreFixture};
use super::Backend;

pub fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// A proxy on a shipped example config, with a CA from `ca init`, and the worker setup
/// `idemproxy env` printed for it.
pub struct Worker {
    pub ca: ProxyCa,
    /// Exactly the `NAME=value` lines `idemproxy env --format env-file` printed.
    pub env: Vec<(String, String)>,
    pub proxy: Proxy,
    /// The proxy's store (SQLite unless `start_on` said otherwise).
    pub store: StoreFixture,
}

impl Worker {
    /// `example` (a file in config/examples) with each of `routes` (name, fake's port) dialled
    /// to its fake, which serves a certificate signed by `pki`.
    pub fn start(example: &str, routes: &[(&str, u16)], pki: &TestPki) -> Worker {
        Self::start_as(example, routes, pki, None)
    }

    /// The same, with a tenant (name, secret): the proxy requires Proxy-Authorization and the
    /// printed HTTPS_PROXY carries the credentials.
    pub fn start_as(
        example: &str,
        routes: &[(&str, u16)],
        pki: &TestPki,
        tenant: Option<(&str, &str)>,
    ) -> Worker {
        Self::start_edited(example, routes, pki, tenant, &|_| {})
    }

    /// The same, with `edit` applied to the example's TOML first (a setting the example
    /// leaves at its default, turned on for one test).
    pub fn start_edited(
        example: &str,
        routes: &[(&str, u16)],
        pki: &TestPki,
        tenant: Option<(&str, &str)>,
        edit: &dyn Fn(&mut toml::Table),
    ) -> Worker {
        Self::start_on(Backend::Sqlite, example, routes, pki, tenant, edit)
    }

    /// The same, on a store of `backend` (a test that stops the store).
    pub fn start_on(
        backend: Backend,
        example: &str,
        routes: &[(&str, u16)],
        pki: &TestPki,
        tenant: Option<(&str, &str)>,
        edit: &dyn Fn(&mut toml::Table),
    ) -> Worker {
        let store = StoreFixture::new(backend);
        let listen = crate::common::loopback(crate::common::free_port());
        let proxy_url = match tenant {
            Some((name, secret)) => format!("http://{name}:{secret}@{listen}"),
            None => format!("http://{listen}"),
        };
        let ca = ProxyCa::init(&proxy_url);
        let ca_dir = ca.cert.parent().expect("CA directory").to_path_buf();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemproxy"))
            .args([
                "env",
                "--format",
                "env-file",
                "--proxy-url",
                &proxy_url,
                "--dir",
            ])
            .arg(&ca_dir)
            .output()
            .expect("run idemproxy env");
        let printed = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "idemproxy env: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let env = env_file_lines(&printed);

        let mut cfg: toml::Table =
            std::fs::read_to_string(repo(&format!("config/examples/{example}")))
                .expect("read the example")
                .parse()
                .expect("the example is TOML");
        edit(&mut cfg);
        let table = |cfg: &mut toml::Table, name: &str| -> toml::Table {
            cfg.get(name)
                .and_then(|t| t.as_table())
                .cloned()
                .unwrap_or_default()
        };
        let mut server = table(&mut cfg, "server");
        server.insert("listen".into(), listen.to_string().into());
        server.insert("admin_listen".into(), "127.0.0.1:0".into());
        cfg.insert("server".into(), server.into());
        let mut store_table = table(&mut cfg, "store");
        store_table.insert("url".into(), store.url().into());
        cfg.insert("store".into(), store_table.into());
        let mut tls = toml::Table::new();
        tls.insert("ca_cert".into(), ca.cert.display().to_string().into());
        tls.insert("ca_key".into(), ca.key.display().to_string().into());
        cfg.insert("tls".into(), tls.into());
        if let Some((name, secret)) = tenant {
            use sha2::Digest as _;
            let mut t = toml::Table::new();
            t.insert("name".into(), name.into());
            t.insert(
                "secret_sha256".into(),
                hex::encode(sha2::Sha256::digest(secret.as_bytes())).into(),
            );
            cfg.insert("tenants".into(), toml::Value::Array(vec![t.into()]));
        }
        let all = cfg
            .get_mut("routes")
            .and_then(|r| r.as_array_mut())
            .expect("the example has routes");
        for (name, port) in routes {
            let route = all
                .iter_mut()
                .filter_map(|r| r.as_table_mut())
                .find(|r| r.get("name").and_then(|n| n.as_str()) == Some(name))
                .unwrap_or_else(|| panic!("{example} has no route {name}"));
            route.insert("connect_to".into(), format!("127.0.0.1:{port}").into());
            route.insert(
                "upstream_ca".into(),
                pki.ca_path().display().to_string().into(),
            );
        }
        // An admin token, as an operator deploying the example sets one: examples with
        // approvals refuse to start without a token that may approve.
        let proxy = Proxy::start_with_env(
            &toml::to_string(&cfg).expect("serialise config"),
            &[("IDEMPROXY_ADMIN_TOKEN", "worker-test-admin-token")],
        );
        assert_eq!(proxy.addr, listen);
        Worker {
            ca,
            env,
            proxy,
            store,
        }
    }

    pub fn var(&self, name: &str) -> &str {
        self.env
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("idemproxy env printed no {name}: {:?}", self.env))
    }

    /// One run of a tool with the printed setup.
    pub async fn run(&self, program: &str, args: &[&str], creds: &[(&str, &str)]) -> Value {
        tool(program, args, &self.env, creds).await
    }

    /// The same run with only the usual variables, as `idemproxy ca init` prints them.
    pub async fn run_with_usual_variables(
        &self,
        program: &str,
        args: &[&str],
        creds: &[(&str, &str)],
    ) -> Value {
        tool(program, args, &self.ca.worker_env(), creds).await
    }

    /// The value of one series on the admin listener's `/metrics` (0 when absent).
    pub async fn metric(&self, series: &str) -> f64 {
        let admin = self.proxy.admin.expect("admin listener");
        let r = send(admin, "GET", "/metrics", &[], "")
            .await
            .expect("GET /metrics");
        r.text()
            .lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0.0)
    }

    pub async fn replays(&self, route: &str) -> f64 {
        let admin = self.proxy.admin.expect("admin listener");
        let r = send(admin, "GET", "/metrics", &[], "")
            .await
            .expect("GET /metrics");
        let series = format!("idemproxy_requests_total{{route=\"{route}\",outcome=\"replayed\"}}");
        r.text()
            .lines()
            .find_map(|l| l.strip_prefix(&series)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0.0)
    }
}

/// `NAME=value` lines of a Docker env file (comments and blank lines skipped).
pub fn env_file_lines(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Runs a tool as a new worker process with exactly `env` + `creds` (and PATH, HOME), and
/// returns the JSON line it printed last.
pub async fn tool(
    program: &str,
    args: &[&str],
    env: &[(String, String)],
    creds: &[(&str, &str)],
) -> Value {
    let out = tokio::process::Command::new(program)
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", std::env::var("HOME").unwrap_or_default())
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .envs(creds.iter().copied())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(90), out)
        .await
        .unwrap_or_else(|_| panic!("{program} {args:?} finished within 90 s"))
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("{program} {args:?}: no JSON line ({e}):\n{stdout}\n{stderr}"))
}

pub fn failed(out: &Value) -> bool {
    out.get("error").is_some()
}

pub fn python_script(name: &str) -> String {
    repo(&format!("tests/python/{name}")).display().to_string()
}

/// An SES account for boto3: the fake (SigV4 checked) and the worker's AWS variables, nothing
/// read from files or instance metadata.
pub async fn ses_account(pki: &TestPki) -> (Fake<Ses>, [(&'static str, &'static str); 6]) {
    const AKID: &str = "AKIAWORKERAAAAAAAAAA";
    const SECRET: &str = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEYW";
    let fake = Fake::start_https(
        Ses::new(SES_HOST, "us-east-1", &[(AKID, SECRET)]),
        pki.server_config(&[SES_HOST]),
    )
    .await;
    let creds = [
        ("AWS_ACCESS_KEY_ID", AKID),
        ("AWS_SECRET_ACCESS_KEY", SECRET),
        ("AWS_DEFAULT_REGION", "us-east-1"),
        ("AWS_CONFIG_FILE", "/dev/null"),
        ("AWS_SHARED_CREDENTIALS_FILE", "/dev/null"),
        ("AWS_EC2_METADATA_DISABLED", "true"),
    ];
    (fake, creds)
}
