//! The Dockerfile, built for real and run. `scripts/build-image.sh` builds it with buildah
//! (chroot isolation) on Debian base images made here with debootstrap, since no registry is
//! reachable. The image then runs its own config (config/docker.toml, as the Dockerfile copies
//! it, with this test's Redis and loopback ports) as its own unprivileged user, with a CA from
//! `idemproxy ca init` mounted where the Dockerfile declares its volume; its HEALTHCHECK
//! command gets `/healthz`, and one protected request through `HTTPS_PROXY` (tenant
//! credentials, TLS intercepted) to a Stripe-like fake executes once and its retry replays.
//!
//! Slow (debootstrap once, then a release build: several minutes on 2 cores), so it is
//! `#[ignore]`d: `cargo test` lists it as ignored, with why, and runs it with `-- --ignored`
//! (what `IDEMPROXY_TEST_IMAGE=1 scripts/test.sh` adds; about 12 minutes, and buildah and
//! debootstrap installed).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::common::fakes::stripe::FakeStripe;
use crate::common::pki::{run_ca_init, TestPki};
use crate::common::redis::RedisServer;

const TAG: &str = "localhost/idemproxy:test";
const SECRET: &str = "sk_test_image_1";
const WORKER_SECRET: &str = "image-worker-secret";

/// A container of the image, removed (and its process group stopped) when dropped.
struct Container {
    name: String,
    serve: Option<Child>,
}

impl Container {
    fn create() -> Container {
        let out = Command::new("buildah")
            .args(["from", TAG])
            .output()
            .expect("buildah from");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Container {
            name: String::from_utf8_lossy(&out.stdout).trim().to_string(),
            serve: None,
        }
    }

    fn buildah(&self, args: &[&str]) -> std::process::Output {
        Command::new("buildah")
            .args(args)
            .output()
            .expect("run buildah")
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if let Some(child) = &mut self.serve {
            let _ = Command::new("kill")
                .args(["-TERM", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.wait();
        }
        let _ = self.buildah(&["rm", &self.name]);
    }
}

fn repo(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "builds the container image (about 12 minutes; needs buildah and debootstrap): IDEMPROXY_TEST_IMAGE=1 scripts/test.sh runs it"]
async fn the_dockerfile_builds_and_its_image_serves_health_and_a_protected_request() {
    let log = Path::new(env!("CARGO_TARGET_TMPDIR")).join("build-image.log");
    let build = {
        let log = log.clone();
        tokio::task::spawn_blocking(move || {
            let file = std::fs::File::create(&log).expect("build log");
            Command::new(repo("scripts/build-image.sh"))
                .arg(TAG)
                .stdout(file.try_clone().expect("log"))
                .stderr(file)
                .status()
                .expect("run scripts/build-image.sh")
        })
    };
    let status = tokio::time::timeout(Duration::from_secs(40 * 60), build)
        .await
        .expect("the image built within 40 minutes")
        .expect("build task");
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let tail: Vec<&str> = text.lines().rev().take(30).collect();
    assert!(status.success(), "build failed:\n{}", tail.join("\n"));

    // The proxy's CA and its config, mounted the way docker-compose.yml mounts them.
    let redis = RedisServer::start();
    let pki = TestPki::new("provider CA");
    let fake = FakeStripe::start(&[SECRET], Some(pki.server_config(&["api.stripe.com"]))).await;
    let listen = crate::common::loopback(crate::common::free_port());
    let admin = crate::common::loopback(crate::common::free_port());
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = dir.path().join("certs");
    let proxy_url = format!("http://worker:{WORKER_SECRET}@{listen}");
    let out = run_ca_init(&certs, &["--proxy-url", &proxy_url]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::copy(pki.ca_path(), certs.join("upstream-ca.pem")).expect("copy upstream CA");
    let config = std::fs::read_to_string(repo("config/docker.toml"))
        .expect("config/docker.toml")
        .replace("redis://redis:6379/0", &redis.url())
        .replace("0.0.0.0:8080", &listen.to_string())
        .replace("0.0.0.0:9090", &admin.to_string())
        .replace(
            "upstream = \"https://api.stripe.com\"",
            &format!(
                "upstream = \"https://api.stripe.com\"\nconnect_to = \"127.0.0.1:{}\"\nupstream_ca = \"/etc/idemproxy/certs/upstream-ca.pem\"",
                fake.port()
            ),
        );
    let config_path = dir.path().join("idemproxy.toml");
    std::fs::write(&config_path, config).expect("write config");
    // The image runs as uid 10001: it reads the key (0600) and everything else.
    use std::os::unix::fs::PermissionsExt as _;
    for d in [dir.path(), certs.as_path()] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    std::fs::set_permissions(&config_path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    std::os::unix::fs::chown(certs.join("ca.key"), Some(10001), Some(10001))
        .expect("chown the key to the image's user");

    let mut container = Container::create();
    let name = container.name.clone();
    let configured = container.buildah(&[
        "config",
        "--env",
        "IDEMPROXY_ADMIN_TOKEN=image-admin-token",
        "--env",
        "IDEMPROXY_RECEIPT_KEY=5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a",
        "--env",
        &format!("IDEMPROXY_WORKER_SECRET={WORKER_SECRET}"),
        &name,
    ]);
    assert!(configured.status.success());
    let certs_mount = format!("{}:/etc/idemproxy/certs:ro", certs.display());
    let config_mount = format!("{}:/etc/idemproxy/idemproxy.toml:ro", config_path.display());
    // The image's CMD, with its own config path.
    use std::os::unix::process::CommandExt as _;
    let mut serve = Command::new("buildah")
        .args([
            "run",
            "--isolation",
            "chroot",
            "-v",
            &certs_mount,
            "-v",
            &config_mount,
        ])
        .args([
            &name,
            "--",
            "idemproxy",
            "serve",
            "--config",
            "/etc/idemproxy/idemproxy.toml",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::from(
            std::fs::File::create(dir.path().join("serve.log")).expect("log"),
        ))
        .process_group(0)
        .spawn()
        .expect("buildah run");
    let stdout = serve.stdout.take().expect("stdout");
    container.serve = Some(serve);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with("idemproxy listening") {
                let _ = tx.send(line);
            }
        }
    });
    let started = rx.recv_timeout(Duration::from_secs(60));
    assert!(
        started.is_ok(),
        "the image's proxy did not start:\n{}",
        std::fs::read_to_string(dir.path().join("serve.log")).unwrap_or_default()
    );

    // The Dockerfile's HEALTHCHECK command, in the container.
    let health = container.buildah(&[
        "run",
        "--isolation",
        "chroot",
        &name,
        "--",
        "idemproxy",
        "healthcheck",
        "--url",
        &format!("http://{admin}/healthz"),
    ]);
    assert!(
        health.status.success(),
        "healthcheck: {}",
        String::from_utf8_lossy(&health.stderr)
    );
    // The user it runs as.
    let user = container.buildah(&["run", "--isolation", "chroot", &name, "--", "id", "-u"]);
    assert_eq!(String::from_utf8_lossy(&user.stdout).trim(), "10001");

    // One protected request, as a worker with the tenant's credentials sends it, and its retry.
    let pay = || {
        Command::new("curl")
            .args([
                "-sS",
                "--max-time",
                "30",
                "-D",
                "-",
                "-u",
                &format!("{SECRET}:"),
            ])
            .args([
                "https://api.stripe.com/v1/payment_intents",
                "-d",
                "amount=900",
            ])
            .args([
                "-d",
                "currency=usd",
                "-d",
                "metadata[invoice_id]=inv-image-1",
            ])
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HTTPS_PROXY", &proxy_url)
            .env("CURL_CA_BUNDLE", certs.join("ca-bundle.pem"))
            .output()
            .expect("curl")
    };
    let first = pay();
    let retry = pay();
    let text = |o: &std::process::Output| String::from_utf8_lossy(&o.stdout).to_lowercase();
    assert!(
        text(&first).contains("idempotent-replayed: false"),
        "{} {}",
        text(&first),
        String::from_utf8_lossy(&first.stderr)
    );
    assert!(
        text(&retry).contains("idempotent-replayed: true"),
        "{}",
        text(&retry)
    );
    let body = |o: &std::process::Output| {
        let all = String::from_utf8_lossy(&o.stdout).into_owned();
        all.rsplit("\r\n\r\n")
            .next()
            .unwrap_or_default()
            .to_string()
    };
    assert_eq!(
        body(&first),
        body(&retry),
        "the retry gets the first response's bytes"
    );
    assert_eq!(fake.payment_intents(), 1, "one payment for two requests");
}

/// A test that did not run must not say "ok": `cargo test` lists the image test as ignored,
/// with the reason, unless it was asked for.
#[test]
fn the_image_test_is_reported_as_ignored_unless_asked_for() {
    let out = Command::new(std::env::current_exe().expect("this test binary"))
        .args(["--list", "--ignored"])
        .output()
        .expect("list the ignored tests");
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(
        listed.contains(
            "image::the_dockerfile_builds_and_its_image_serves_health_and_a_protected_request"
        ),
        "{listed}"
    );
}
