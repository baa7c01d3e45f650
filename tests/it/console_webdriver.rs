//! Just enough of the W3C WebDriver protocol to drive a real headless Chromium through
//! Debian's chromedriver: sessions, navigation, elements, scripts, screenshots. Plain JSON
//! over HTTP on loopback, with the test harness's own client.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine as _;
use serde_json::{json, Value};

use crate::common::client::exchange;
use crate::common::{eventually_async, free_port};

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A chromedriver process on a free loopback port.
pub struct Driver {
    port: u16,
    child: Child,
    _profiles: tempfile::TempDir,
}

impl Driver {
    /// Starts chromedriver; fails the test, naming what to install, when it is missing.
    pub async fn start() -> Driver {
        let port = free_port();
        let child = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("chromedriver cannot start ({e}): install Debian's chromium and chromium-driver (scripts/test.sh does)")
            });
        let d = Driver {
            port,
            child,
            _profiles: tempfile::tempdir().expect("tempdir"),
        };
        eventually_async("chromedriver answers", Duration::from_secs(20), || async {
            d.call("GET", "/status", None)
                .await
                .ok()
                .filter(|v| v["value"]["ready"] == true)
        })
        .await;
        d
    }

    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .map_err(|e| e.to_string())?;
        let text = body.map(|b| b.to_string()).unwrap_or_default();
        let headers: &[(&str, &str)] = if method == "POST" {
            &[("content-type", "application/json")]
        } else {
            &[]
        };
        let host = format!("127.0.0.1:{}", self.port);
        let r = exchange(stream, method, path, &host, headers, text.into()).await?;
        let v: Value = serde_json::from_slice(&r.body).map_err(|e| format!("{e}: {}", r.text()))?;
        if r.status >= 400 {
            return Err(format!("{} {}", v["value"]["error"], v["value"]["message"]));
        }
        Ok(v)
    }

    /// A new browser: headless Chromium with its own fresh profile, `width` × `height`.
    pub async fn browser(&self, width: u32, height: u32) -> Browser<'_> {
        let profile = self
            ._profiles
            .path()
            .join(format!("p{}", rand::random::<u32>()));
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium(),
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu",
                    "--disable-background-networking", "--disable-component-update",
                    "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                    format!("--user-data-dir={}", profile.display()),
                    format!("--window-size={width},{height}"),
                ],
            },
        }}});
        let v = self
            .call("POST", "/session", Some(caps))
            .await
            .expect("a browser session");
        let id = v["value"]["sessionId"]
            .as_str()
            .expect("session id")
            .to_string();
        let b = Browser { driver: self, id };
        b.post(
            "/timeouts",
            json!({"script": 30_000, "pageLoad": 30_000, "implicit": 0}),
        )
        .await;
        b
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn chromium() -> String {
    ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .iter()
        .find(|p| Path::new(p).exists())
        .unwrap_or(&"/usr/bin/chromium")
        .to_string()
}

pub struct Browser<'d> {
    driver: &'d Driver,
    id: String,
}

impl Browser<'_> {
    async fn post(&self, path: &str, body: Value) -> Value {
        self.try_post(path, body)
            .await
            .unwrap_or_else(|e| panic!("webdriver {path}: {e}"))
    }

    async fn try_post(&self, path: &str, body: Value) -> Result<Value, String> {
        let full = format!("/session/{}{path}", self.id);
        self.driver.call("POST", &full, Some(body)).await
    }

    pub async fn goto(&self, url: &str) {
        self.post("/url", json!({"url": url})).await;
    }

    pub async fn url(&self) -> String {
        let full = format!("/session/{}/url", self.id);
        let v = self.driver.call("GET", &full, None).await.expect("url");
        v["value"].as_str().unwrap_or_default().to_string()
    }

    /// The first element `css` selects, or `None`.
    pub async fn find(&self, css: &str) -> Option<String> {
        let v = self
            .try_post("/element", json!({"using": "css selector", "value": css}))
            .await
            .ok()?;
        v["value"][ELEMENT].as_str().map(String::from)
    }

    pub async fn element(&self, css: &str) -> String {
        eventually_async(
            &format!("an element `{css}`"),
            Duration::from_secs(10),
            || self.find(css),
        )
        .await
    }

    pub async fn click(&self, css: &str) {
        let e = self.element(css).await;
        self.post(&format!("/element/{e}/click"), json!({})).await;
    }

    pub async fn type_into(&self, css: &str, text: &str) {
        let e = self.element(css).await;
        self.post(&format!("/element/{e}/value"), json!({"text": text}))
            .await;
    }

    pub async fn script(&self, script: &str, args: Value) -> Value {
        self.post("/execute/sync", json!({"script": script, "args": args}))
            .await["value"]
            .clone()
    }

    pub async fn script_async(&self, script: &str, args: Value) -> Value {
        self.post("/execute/async", json!({"script": script, "args": args}))
            .await["value"]
            .clone()
    }

    /// The text of an open alert, if a script opened one.
    pub async fn alert(&self) -> Option<String> {
        let full = format!("/session/{}/alert/text", self.id);
        let v = self.driver.call("GET", &full, None).await.ok()?;
        v["value"].as_str().map(String::from)
    }

    pub async fn delete_cookies(&self) {
        let full = format!("/session/{}/cookie", self.id);
        self.driver
            .call("DELETE", &full, None)
            .await
            .expect("delete cookies");
    }

    /// A PNG of the viewport, written to `path`.
    pub async fn screenshot(&self, path: &Path) {
        let full = format!("/session/{}/screenshot", self.id);
        let v = self
            .driver
            .call("GET", &full, None)
            .await
            .expect("screenshot");
        let png = base64::engine::general_purpose::STANDARD
            .decode(v["value"].as_str().unwrap_or_default())
            .expect("base64 PNG");
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("screenshot dir");
        }
        std::fs::write(path, png).expect("write screenshot");
    }

    /// How long the last navigation took to load, per the page's own timing (ms).
    pub async fn load_ms(&self) -> f64 {
        self.script(
            "const n = performance.getEntriesByType('navigation')[0]; return n ? n.loadEventEnd - n.startTime : -1;",
            json!([]),
        )
        .await
        .as_f64()
        .unwrap_or(-1.0)
    }

    pub async fn quit(self) {
        let full = format!("/session/{}", self.id);
        let _ = self.driver.call("DELETE", &full, None).await;
    }
}

/// Where screenshots go: `target/console-screenshots/`.
pub fn artefact(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/console-screenshots")
        .join(name)
}
