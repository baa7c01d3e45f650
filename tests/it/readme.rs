//! The README's "Try it in five minutes", run as written, from a directory that is not the
//! repository: `idemproxy demo`, every curl line of the walk-through, the official Stripe SDK
//! snippet against the demo's Stripe stand-in (twice, each a new Python process, with the
//! worker setup `idemproxy env` printed), a second demo run that starts afresh, and the steps
//! to Stripe's test mode. The stand-ins must have charged once per operation, and the answers
//! must say so. The install lines are checked as text: the test puts the binary it built and
//! the suite's Python (scripts/test.sh's virtual environment, which has `stripe`) on PATH.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// The fenced blocks of one language in a Markdown text, each as its lines (a block indented
/// under a list item loses its indentation).
fn blocks(text: &str, lang: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let mut open: Option<(usize, Vec<String>)> = None;
    for line in text.lines() {
        let indent = line.len() - line.trim_start().len();
        match &mut open {
            None if line.trim_start() == format!("```{lang}") => open = Some((indent, Vec::new())),
            Some(_) if line.trim() == "```" => {
                found.extend(open.take().map(|(_, lines)| lines));
            }
            Some((indent, lines)) => lines.push(line.get(*indent..).unwrap_or("").to_string()),
            None => {}
        }
    }
    found
}

/// The text of a `## ` section of the README (its `### ` subsections included).
fn readme_section(heading: &str) -> String {
    let readme = std::fs::read_to_string(repo("README.md")).expect("README.md");
    readme
        .split(&format!("\n## {heading}\n"))
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .unwrap_or_else(|| panic!("the README has a section {heading}"))
        .to_string()
}

/// A directory to run the README in, and the PATH with the binary under test first.
struct Shell {
    dir: tempfile::TempDir,
    path: String,
}

/// Marks the end of one command's output when several run in one shell.
const NEXT: &str = "::readme-next-command::";

impl Shell {
    fn new() -> Shell {
        // `cargo install` is what puts the binary on PATH; the test puts the one it built there.
        let bin = Path::new(env!("CARGO_BIN_EXE_idemproxy"));
        Shell {
            dir: tempfile::tempdir().expect("tempdir"),
            path: format!(
                "{}:{}",
                bin.parent().expect("bin dir").display(),
                std::env::var("PATH").unwrap_or_default()
            ),
        }
    }

    fn command(&self, line: &str) -> Command {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", line])
            .current_dir(self.dir.path())
            .env("PATH", &self.path)
            .env_remove("HTTPS_PROXY")
            .env_remove("HTTP_PROXY")
            .env_remove("https_proxy")
            .env_remove("http_proxy");
        cmd
    }

    /// Runs one line; its stdout and whether it succeeded.
    fn run(&self, line: &str) -> (String, bool) {
        let out = self.command(line).output().expect("sh");
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            out.status.success(),
        )
    }

    /// Runs one line; its stdout, lower-cased (HTTP header names are in any case).
    fn lower(&self, line: &str) -> String {
        self.run(line).0.to_lowercase()
    }

    /// Runs `lines` one after another in one shell (so `eval` and `.` carry over), each
    /// one's stdout apart.
    fn run_together(&self, lines: &[String]) -> Vec<String> {
        let script: String = lines
            .iter()
            .map(|l| format!("{l}\necho '{NEXT}'\n"))
            .collect();
        let out = self.command(&script).output().expect("sh");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let parts: Vec<String> = stdout
            .split(&format!("{NEXT}\n"))
            .map(String::from)
            .collect();
        assert_eq!(
            parts.len(),
            lines.len() + 1,
            "every line ran: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        parts[..lines.len()].to_vec()
    }

    /// Starts a long-running command (the demo, the proxy) and reads its stdout until it
    /// printed `until`.
    fn start(&self, line: &str, until: &str) -> Running {
        let mut child = self
            .command(&format!("exec {line}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start");
        let mut stdout = child.stdout.take().expect("stdout");
        let started = Instant::now();
        let mut printed = String::new();
        while !printed.contains(until) {
            let mut buf = [0u8; 4096];
            let n = stdout.read(&mut buf).expect("read its output");
            assert!(
                n > 0 && started.elapsed() < Duration::from_secs(30),
                "`{line}` did not print {until:?}: {printed}"
            );
            printed.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
        Running {
            child,
            printed,
            _stdout: stdout,
        }
    }
}

/// A process the README starts and the user stops with Ctrl-C.
struct Running {
    child: Child,
    printed: String,
    _stdout: std::process::ChildStdout,
}

impl Running {
    /// Ctrl-C, and the process ends by itself.
    fn stop(mut self) {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-INT", &pid]).status();
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        panic!("it did not stop on Ctrl-C within 20 s: {}", self.printed);
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn body(s: &str) -> String {
    s.split("\r\n\r\n").last().unwrap_or("").to_string()
}

/// The charge ids (`ch_…`) a run of the SDK snippet printed.
fn printed_charge(out: &str) -> String {
    let id = out.trim();
    assert!(
        id.starts_with("ch_") && !id.contains(char::is_whitespace),
        "the snippet prints the charge id: {out:?}"
    );
    id.to_string()
}

/// The base-URL walk-through: two charges under one key, one effect, the replay identical.
fn base_url_walkthrough(sh: &Shell, base: &[String]) {
    let (first, again, effects) = (sh.lower(&base[0]), sh.lower(&base[1]), sh.lower(&base[2]));
    assert!(first.contains("idempotent-replayed: false"), "{first}");
    assert!(again.contains("idempotent-replayed: true"), "{again}");
    assert_eq!(body(&first), body(&again), "the replay is the first answer");
    assert!(body(&first).contains("\"id\":\"ch_0001\""), "{first}");
    assert_eq!(effects.trim(), "{\"effects\":1}");
}

#[test]
fn the_readme_walkthrough_works_as_written() {
    let section = readme_section("Try it in five minutes");
    let shell = blocks(&section, "sh");
    assert_eq!(
        shell.len(),
        6,
        "install + demo, base URL, HTTPS_PROXY, the SDK's setup, its runs, test mode: {shell:?}"
    );
    assert_eq!(
        shell[0],
        ["cargo install --locked --path .", "idemproxy demo"]
    );
    let python = blocks(&section, "python");
    assert_eq!(python.len(), 1, "one SDK snippet");
    let snippet = python[0].join("\n") + "\n";
    assert!(snippet.is_ascii(), "the snippet is ASCII: {snippet}");
    assert!(
        snippet.contains("\"sk_test_") && !snippet.contains("sk_live"),
        "a test-mode key: {snippet}"
    );

    let sh = Shell::new();
    let demo = sh.start(&shell[0][1], "Stop with Ctrl-C");
    base_url_walkthrough(&sh, &shell[1]);
    let https = &shell[2];
    let (tls_first, tls_again) = (sh.lower(&https[0]), sh.lower(&https[1]));
    assert!(
        tls_first.contains("idempotent-replayed: false"),
        "{tls_first}"
    );
    assert!(
        tls_again.contains("idempotent-replayed: true"),
        "{tls_again}"
    );
    assert_eq!(body(&tls_first), body(&tls_again));
    assert_eq!(sh.lower(&shell[1][2]).trim(), "{\"effects\":2}");

    // The official SDK against the demo's Stripe stand-in. The venv line installs `stripe`;
    // the suite's Python has it.
    let setup = &shell[3];
    assert_eq!(
        setup[0],
        "python3 -m venv .venv && . .venv/bin/activate && pip install stripe"
    );
    std::fs::write(sh.dir.path().join("pay.py"), &snippet).expect("save pay.py");
    let mut lines = vec![setup[1].clone()];
    lines.extend(shell[4].iter().cloned());
    let out = sh.run_together(&lines);
    let (first, rerun, list) = (&out[1], &out[2], &out[3]);
    assert_eq!(
        printed_charge(first),
        printed_charge(rerun),
        "the re-run, a new process, gets the first charge"
    );
    let list: serde_json::Value = serde_json::from_str(list).expect("the charge list is JSON");
    let charges = list["data"].as_array().expect("a Stripe list");
    assert_eq!(charges.len(), 1, "one charge for two runs: {list}");
    assert_eq!(
        charges[0]["id"].as_str(),
        Some(printed_charge(first).as_str())
    );
    stripe_stand_in_behaves_like_stripe(&sh);
    demo.stop();

    // A second demo run starts afresh: what the README says holds again.
    let demo = sh.start(&shell[0][1], "Stop with Ctrl-C");
    base_url_walkthrough(&sh, &shell[1]);
    demo.stop();

    test_mode(&sh, &shell[5]);
}

/// The demo's Stripe stand-in, asked directly (not through the proxy): it refuses a key that
/// is not a test key in Stripe's error shape, and deduplicates on `Idempotency-Key` as Stripe
/// does.
fn stripe_stand_in_behaves_like_stripe(sh: &Shell) {
    let direct = "curl -si --cacert certs/ca.pem --resolve api.stripe.com:8098:127.0.0.1 https://api.stripe.com:8098/v1/charges";
    let refused = sh.run(&format!("{direct} -u sk_live_nope:")).0;
    assert!(refused.contains(" 401"), "{refused}");
    let error: serde_json::Value = serde_json::from_str(&body(&refused)).expect("JSON");
    assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
    let charge = format!(
        "{direct} -H 'Authorization: Bearer sk_test_direct' -H 'Idempotency-Key: direct-1' -d amount=700 -d currency=usd -d source=tok_visa"
    );
    let (first, again) = (sh.lower(&charge), sh.lower(&charge));
    assert!(!first.contains("idempotent-replayed"), "{first}");
    assert!(again.contains("idempotent-replayed: true"), "{again}");
    assert_eq!(body(&first), body(&again));
    let other = sh.lower(&charge.replace("amount=700", "amount=800"));
    assert!(other.contains("idempotency_error"), "{other}");
}

/// The steps to Stripe's test mode: `ca init` finds the demo's CA and prints its `[tls]`
/// block, which goes into a copy of the shipped Stripe config; that config checks and serves.
fn test_mode(sh: &Shell, steps: &[String]) {
    assert_eq!(steps.len(), 4, "{steps:?}");
    let (printed, ok) = sh.run(&steps[0]);
    assert!(ok, "`{}` succeeds when the CA exists: {printed}", steps[0]);
    let tls: String = printed
        .lines()
        .skip_while(|l| *l != "[tls]")
        .take(3)
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(
        tls.starts_with("[tls]\nca_cert = ") && tls.contains("ca_key = "),
        "`{}` prints the [tls] block: {printed}",
        steps[0]
    );
    // "From the repository": the one file the copy needs.
    std::fs::create_dir_all(sh.dir.path().join("config/examples")).expect("mkdir");
    std::fs::copy(
        repo("config/examples/stripe.toml"),
        sh.dir.path().join("config/examples/stripe.toml"),
    )
    .expect("copy the shipped config");
    assert!(sh.run(&steps[1]).1, "{}", steps[1]);
    let config = sh.dir.path().join("idemproxy.toml");
    let mut text = std::fs::read_to_string(&config).expect("the copy");
    text.push('\n');
    text.push_str(&tls);
    std::fs::write(&config, text).expect("append the [tls] block");
    let (checked, ok) = sh.run(&steps[2]);
    assert!(ok && checked.contains("OK"), "{checked}");
    let serving = sh.start(&steps[3], "idemproxy listening");
    serving.stop();
}

/// `cargo install` re-resolves every dependency without `--locked`: every doc says it.
#[test]
fn every_install_line_is_locked() {
    let mut files = vec![repo("README.md")];
    for entry in std::fs::read_dir(repo("docs")).expect("docs") {
        files.push(entry.expect("entry").path());
    }
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        for line in text.lines().filter(|l| l.contains("cargo install")) {
            assert!(
                line.contains("cargo install --locked"),
                "{}: {line}",
                file.display()
            );
        }
    }
}

/// YAML as JSON, parsed by PyYAML (scripts/test.sh installs it).
fn yaml(text: &str) -> serde_json::Value {
    use std::io::Write as _;
    let mut child = Command::new("python3")
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps(yaml.safe_load(sys.stdin.read())))",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 with PyYAML");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write YAML");
    let out = child.wait_with_output().expect("python3");
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("YAML does not parse ({e}):\n{text}"))
}

/// docs/https-proxy.md's set-up, as written: `ca init` prints what the page shows, the
/// compose example's worker is exactly what `idemproxy env --format compose` prints (the
/// start-up hook stripe-python needs included), and the check command works against a proxy
/// on the shipped stripe.toml (here dialled to a Stripe-like fake with `connect_to`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_https_proxy_page_works_as_written() {
    use crate::common::fakes::stripe::FakeStripe;
    use crate::common::pki::TestPki;
    use crate::common::proxy::Proxy;

    let page = std::fs::read_to_string(repo("docs/https-proxy.md")).expect("the page");
    let shell = blocks(&page, "sh");
    let sh = Shell::new();

    // 1. ca init, as written, prints the page's worker environment.
    let (printed, ok) = sh.run(&shell[0].join("\n"));
    assert!(ok, "{printed}");
    // The `NAME=value` lines (the [tls] block's paths differ: the page shows /srv/…).
    let vars = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| {
                l.split_once('=').is_some_and(|(k, _)| {
                    !k.is_empty() && k.chars().all(|c| c.is_ascii_alphabetic() || c == '_')
                })
            })
            .map(String::from)
            .collect()
    };
    let shown = blocks(&page, "text");
    assert_eq!(vars(&printed), vars(&shown[0].join("\n")), "{printed}");

    // 3. The compose example's worker is what `env --format compose` prints.
    let out = sh.command(&shell[1].join("\n")).output().expect("env");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = yaml(&format!(
        "worker:\n{}",
        String::from_utf8_lossy(&out.stdout)
    ));
    let example = yaml(&(blocks(&page, "yaml")[0].join("\n") + "\n"));
    let worker = &example["services"]["worker"];
    assert_eq!(worker["environment"], printed["worker"]["environment"]);
    assert_eq!(worker["volumes"], printed["worker"]["volumes"]);
    assert!(
        worker["environment"]["PYTHONPATH"].is_string(),
        "the hook stripe-python needs"
    );

    // 4. The check command, from a worker, against the shipped stripe.toml.
    const KEY: &str = "sk_test_https_page_1";
    let pki = TestPki::new("sandbox CA");
    let fake = FakeStripe::start(&[KEY], Some(pki.server_config(&["api.stripe.com"]))).await;
    let mut cfg: toml::Table = std::fs::read_to_string(repo("config/examples/stripe.toml"))
        .expect("stripe.toml")
        .parse()
        .expect("TOML");
    cfg.insert(
        "server".into(),
        toml::toml! { listen = "127.0.0.1:0" }.into(),
    );
    cfg.insert(
        "store".into(),
        toml::Value::Table(toml::toml! { url = "sqlite://claims.db" }),
    );
    let certs = sh.dir.path().join("certs");
    let mut tls = toml::Table::new();
    tls.insert(
        "ca_cert".into(),
        certs.join("ca.pem").display().to_string().into(),
    );
    tls.insert(
        "ca_key".into(),
        certs.join("ca.key").display().to_string().into(),
    );
    cfg.insert("tls".into(), tls.into());
    let route = cfg["routes"]
        .as_array_mut()
        .and_then(|r| r[0].as_table_mut())
        .expect("a route");
    route.insert(
        "connect_to".into(),
        format!("127.0.0.1:{}", fake.port()).into(),
    );
    route.insert(
        "upstream_ca".into(),
        pki.ca_path().display().to_string().into(),
    );
    let proxy = Proxy::start_in(sh.dir.path(), &toml::to_string(&cfg).expect("TOML"));
    let check: String = shell[2]
        .iter()
        .filter(|l| !l.trim_start().starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect();
    let worker_env = [
        ("HTTPS_PROXY", format!("http://{}", proxy.addr)),
        (
            "CURL_CA_BUNDLE",
            certs.join("ca-bundle.pem").display().to_string(),
        ),
        ("STRIPE_KEY", KEY.to_string()),
    ];
    let run = || {
        let out = sh
            .command(&check)
            .envs(worker_env.iter().map(|(k, v)| (*k, v.as_str())))
            .output()
            .expect("curl");
        String::from_utf8_lossy(&out.stdout).to_lowercase()
    };
    let (first, again) = (run(), run());
    assert!(first.contains("idempotent-replayed: false"), "{first}");
    assert!(again.contains("idempotent-replayed: true"), "{again}");
    assert_eq!(body(&first), body(&again));
    assert_eq!(fake.charges().len(), 1);
}
