//! The README's "Try it in five minutes", run as written: `idemproxy demo`, then every curl
//! line of the walk-through, on a fresh copy of the shipped config. The stand-in provider must
//! have charged once per key, and the answers must say so.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The shell commands of the walk-through, block by block.
fn walkthrough() -> Vec<Vec<String>> {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("README.md");
    let section = readme
        .split("## Try it in five minutes")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("the README has a walk-through");
    section
        .split("```sh\n")
        .skip(1)
        .filter_map(|block| block.split("```").next())
        .map(|block| block.lines().map(String::from).collect())
        .collect()
}

fn run(line: &str, dir: &Path, path: &str) -> String {
    let out = Command::new("sh")
        .args(["-c", line])
        .current_dir(dir)
        .env("PATH", path)
        .output()
        .expect("sh");
    String::from_utf8_lossy(&out.stdout).to_lowercase()
}

#[test]
fn the_readme_walkthrough_works_as_written() {
    let blocks = walkthrough();
    assert_eq!(
        blocks.len(),
        3,
        "install + demo, base URL, HTTPS_PROXY: {blocks:?}"
    );
    assert_eq!(blocks[0], ["cargo install --path .", "idemproxy demo"]);
    // `cargo install` is what puts the binary on PATH; the test puts the one it built there.
    let bin = Path::new(env!("CARGO_BIN_EXE_idemproxy"));
    let path = format!(
        "{}:{}",
        bin.parent().expect("bin dir").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(dir.path().join("config/examples")).expect("mkdir");
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples/local.toml"),
        dir.path().join("config/examples/local.toml"),
    )
    .expect("copy the shipped config");

    let mut demo = Command::new("sh")
        .args(["-c", &format!("exec {}", blocks[0][1])])
        .current_dir(dir.path())
        .env("PATH", &path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the demo");
    let mut stdout = demo.stdout.take().expect("stdout");
    let started = Instant::now();
    let mut printed = String::new();
    while !printed.contains("Stop with Ctrl-C") {
        let mut buf = [0u8; 4096];
        let n = std::io::Read::read(&mut stdout, &mut buf).expect("read the demo's output");
        assert!(
            n > 0 && started.elapsed() < Duration::from_secs(20),
            "{printed}"
        );
        printed.push_str(&String::from_utf8_lossy(&buf[..n]));
    }

    let base = &blocks[1];
    let sh = |line: &str| run(line, dir.path(), &path);
    let (first, again, effects) = (sh(&base[0]), sh(&base[1]), sh(&base[2]));
    let https = &blocks[2];
    let (tls_first, tls_again) = (sh(&https[0]), sh(&https[1]));
    let all_effects = sh(&base[2]);
    let _ = demo.kill();
    let _ = demo.wait();

    let body = |s: &str| s.split("\r\n\r\n").last().unwrap_or("").to_string();
    assert!(first.contains("idempotent-replayed: false"), "{first}");
    assert!(again.contains("idempotent-replayed: true"), "{again}");
    assert_eq!(body(&first), body(&again), "the replay is the first answer");
    assert!(body(&first).contains("\"id\":\"ch_0001\""), "{first}");
    assert_eq!(effects.trim(), "{\"effects\":1}");
    assert!(
        tls_first.contains("idempotent-replayed: false"),
        "{tls_first}"
    );
    assert!(
        tls_again.contains("idempotent-replayed: true"),
        "{tls_again}"
    );
    assert_eq!(body(&tls_first), body(&tls_again));
    assert_eq!(all_effects.trim(), "{\"effects\":2}");
}
