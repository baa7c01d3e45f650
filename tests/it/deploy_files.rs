//! No Docker engine runs where the tests run, so the Dockerfile and docker-compose.yml are
//! checked statically: they must agree with each other and with config/docker.toml (ports,
//! paths, services, secrets), and the config must pass `idemproxy check-config`.

use std::path::Path;
use std::process::Command;

use idemproxy::config::{parse_listen, Config};

fn repo(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// docker-compose.yml as JSON, parsed by PyYAML (what the test command installs).
fn compose() -> serde_json::Value {
    let out = Command::new("python3")
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))",
        ])
        .arg(repo("docker-compose.yml"))
        .output()
        .expect("python3 (installed by scripts/test.sh)");
    assert!(
        out.status.success(),
        "docker-compose.yml does not parse: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

fn strs(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

const ENV: [(&str, &str); 3] = [
    ("IDEMPROXY_ADMIN_TOKEN", "t"),
    (
        "IDEMPROXY_RECEIPT_KEY",
        "5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a",
    ),
    ("IDEMPROXY_WORKER_SECRET", "s"),
];

/// config/docker.toml with its CA paths pointing at a CA made by `idemproxy ca init` in a
/// temp dir (the container mounts one at /etc/idemproxy/certs).
fn docker_config_with_a_ca() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["ca", "init", "--dir"])
        .arg(dir.path().join("certs"))
        .output()
        .expect("ca init");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(repo("config/docker.toml"))
        .expect("config/docker.toml")
        .replace(
            "/etc/idemproxy/certs",
            &dir.path().join("certs").display().to_string(),
        );
    let path = dir.path().join("docker.toml");
    std::fs::write(&path, text).expect("write config");
    (dir, path)
}

#[test]
fn docker_config_passes_check_config() {
    let (_dir, config) = docker_config_with_a_ca();
    let out = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["check-config", "--config"])
        .arg(&config)
        .envs(ENV)
        .output()
        .expect("run idemproxy");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Without the secrets it names the missing variable.
    let out = Command::new(env!("CARGO_BIN_EXE_idemproxy"))
        .args(["check-config", "--config"])
        .arg(&config)
        .env_remove("IDEMPROXY_WORKER_SECRET")
        .env_remove("IDEMPROXY_RECEIPT_KEY")
        .output()
        .expect("run idemproxy");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("docker.toml") && err.contains("IDEMPROXY_WORKER_SECRET"),
        "{err}"
    );
}

#[test]
fn compose_dockerfile_and_config_agree() {
    let config = Config::load(&repo("config/docker.toml")).expect("config/docker.toml");
    let listen = parse_listen(&config.server.listen).expect("listen");
    let admin = parse_listen(config.server.admin_listen.as_deref().expect("admin_listen"))
        .expect("admin_listen");
    assert!(
        listen.ip().is_unspecified() && admin.ip().is_unspecified(),
        "containers must bind 0.0.0.0"
    );

    let c = compose();
    let services = &c["services"];
    for s in ["redis", "idemproxy", "worker"] {
        assert!(services[s].is_object(), "service {s} missing");
    }

    // Redis: AOF on, and it is the store the config names.
    let redis_cmd = strs(&services["redis"]["command"]).join(" ");
    assert!(redis_cmd.contains("--appendonly yes"), "{redis_cmd}");
    let store: http::Uri = config.store.url.parse().expect("store url");
    assert_eq!(store.host(), Some("redis"));
    assert_eq!(store.port_u16().unwrap_or(6379), 6379);

    // Proxy: built from this Dockerfile, admin published on loopback only, CA volume where
    // the config looks for the CA, every secret the config reads is provided.
    let proxy = &services["idemproxy"];
    assert_eq!(proxy["build"], ".");
    let ports = strs(&proxy["ports"]);
    assert!(
        ports
            .iter()
            .any(|p| p == &format!("127.0.0.1:{0}:{0}", admin.port())),
        "{ports:?}"
    );
    assert!(
        !ports
            .iter()
            .any(|p| p.ends_with(&format!(":{}", listen.port())) && !p.starts_with("127.0.0.1:")),
        "the proxy port is not published to the world: {ports:?}"
    );
    let ca_cert = config.tls.ca_cert.clone().expect("tls.ca_cert");
    let ca_dir = ca_cert
        .parent()
        .expect("ca dir")
        .to_string_lossy()
        .into_owned();
    let volumes = strs(&proxy["volumes"]);
    assert!(
        volumes
            .iter()
            .any(|v| v.split(':').nth(1) == Some(ca_dir.as_str())),
        "CA volume {ca_dir} not mounted: {volumes:?}"
    );
    let env = proxy["environment"].as_object().expect("environment");
    let mut needed = vec![config.admin.token_env.clone()];
    needed.extend(config.encryption.key_env.clone());
    needed.extend(config.tenants.iter().filter_map(|t| t.secret_env.clone()));
    for var in &needed {
        assert!(
            env.contains_key(var),
            "compose does not pass {var} to idemproxy"
        );
    }

    // Worker: goes through the proxy as a configured tenant, trusts the CA the proxy uses.
    let worker = &services["worker"]["environment"];
    let https_proxy = worker["HTTPS_PROXY"].as_str().expect("HTTPS_PROXY");
    let proxy_uri: http::Uri = https_proxy
        .replace("${IDEMPROXY_WORKER_SECRET:?set it in .env}", "secret")
        .parse()
        .expect("HTTPS_PROXY is a URL");
    let authority = proxy_uri.authority().expect("authority").as_str();
    let (user, host) = authority
        .split_once('@')
        .expect("credentials in HTTPS_PROXY");
    let tenant = user.split(':').next().unwrap_or_default();
    assert!(
        config.tenants.iter().any(|t| t.name == tenant),
        "tenant {tenant} not in config"
    );
    assert_eq!(host, format!("idemproxy:{}", listen.port()));
    // Every trust setting points at a mounted file from the proxy's CA directory: the CA
    // itself or the bundle `ca init` writes next to it; the CA key is never mounted.
    let ca_file = ca_cert
        .file_name()
        .expect("file")
        .to_string_lossy()
        .into_owned();
    let mounts: Vec<(String, String)> = strs(&services["worker"]["volumes"])
        .iter()
        .filter_map(|m| {
            let mut parts = m.split(':');
            Some((parts.next()?.to_string(), parts.next()?.to_string()))
        })
        .collect();
    let ca_key = config.tls.ca_key.clone().expect("tls.ca_key");
    let key_file = ca_key
        .file_name()
        .expect("key file")
        .to_string_lossy()
        .into_owned();
    assert!(
        !mounts.iter().any(|(src, _)| src.ends_with(&key_file)),
        "the worker must not see the CA key: {mounts:?}"
    );
    for var in [
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "NODE_EXTRA_CA_CERTS",
    ] {
        let path = worker[var]
            .as_str()
            .unwrap_or_else(|| panic!("worker sets {var}"));
        let (src, _) = mounts
            .iter()
            .find(|(_, target)| target == path)
            .unwrap_or_else(|| panic!("{var}={path} is not mounted: {mounts:?}"));
        assert!(
            src.ends_with(&format!("certs/{ca_file}")) || src.ends_with("certs/ca-bundle.pem"),
            "{var} mounts {src}, not the proxy's CA"
        );
    }
    assert!(
        worker["NODE_EXTRA_CA_CERTS"]
            .as_str()
            .is_some_and(|p| p.ends_with(&ca_file)),
        "Node adds extra CAs to its own roots: it takes the CA alone"
    );

    // Dockerfile: multi-stage, non-root, the config the compose file relies on, health check
    // on the admin port, both ports exposed.
    let dockerfile = std::fs::read_to_string(repo("Dockerfile")).expect("Dockerfile");
    let lines: Vec<&str> = dockerfile.lines().map(str::trim).collect();
    assert!(
        lines.iter().filter(|l| l.starts_with("FROM ")).count() >= 2,
        "multi-stage"
    );
    let user = lines
        .iter()
        .rev()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("USER");
    assert!(!["root", "0", "0:0"].contains(&user.trim()), "runs as root");
    assert!(
        dockerfile.contains("COPY config/docker.toml /etc/idemproxy/idemproxy.toml")
            && dockerfile.contains("\"--config\", \"/etc/idemproxy/idemproxy.toml\""),
        "the image runs config/docker.toml"
    );
    assert!(
        dockerfile.contains(&format!("http://127.0.0.1:{}/healthz", admin.port()))
            && dockerfile.contains("HEALTHCHECK"),
        "health check on the admin port"
    );
    let expose = lines
        .iter()
        .find_map(|l| l.strip_prefix("EXPOSE "))
        .expect("EXPOSE");
    for port in [listen.port(), admin.port()] {
        assert!(
            expose.split_whitespace().any(|p| p == port.to_string()),
            "EXPOSE {port}"
        );
    }
    assert!(
        dockerfile.contains(&format!("VOLUME [\"{ca_dir}\"")),
        "CA volume declared"
    );
}
