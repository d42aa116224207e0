//! A real browser for tests: Debian's headless Chromium driven over WebDriver by its
//! chromedriver, started on 127.0.0.1 and a free port (`examples/browser/tools.sh` checks or
//! installs both). Besides what WebDriver does (fantoccini's client), it reads the browser's
//! console (chromedriver's log endpoint), so that a page's errors fail the test.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::wd::{Capabilities, WebDriverCompatibleCommand};
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};
use tokio::process::Child;

/// Runs `examples/browser/tools.sh` (Chromium and chromedriver are needed).
fn tools() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("browser/tools.sh");
    let output = Command::new(&script)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        output.status.success(),
        "examples/browser/tools.sh failed: Debian's chromium and chromium-driver are needed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A headless Chromium and the WebDriver session driving it.
pub struct Browser {
    /// The session.
    pub client: Client,
    driver: Child,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts chromedriver and a headless Chromium with a fresh profile, 1280 x 900.
    pub async fn start() -> Browser {
        tools();
        let port = pd_examples::process::free_port();
        let driver = tokio::process::Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("chromedriver starts");
        let url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(20);
        while reqwest::get(format!("{url}/status")).await.is_err() {
            assert!(Instant::now() < deadline, "chromedriver never answered");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let profile = tempfile::tempdir().unwrap();
        let mut capabilities = Capabilities::new();
        capabilities.insert(
            "goog:chromeOptions".into(),
            json!({
                // The real binary: Debian's /usr/bin/chromium is a launcher script.
                "binary": "/usr/lib/chromium/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1280,900",
                         "--no-first-run", "--no-default-browser-check",
                         format!("--user-data-dir={}", profile.path().display())],
            }),
        );
        capabilities.insert("goog:loggingPrefs".into(), json!({"browser": "ALL"}));
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let client = ClientBuilder::new(connector)
            .capabilities(capabilities)
            .connect(&url)
            .await
            .expect("a WebDriver session on headless Chromium");
        Browser {
            client,
            driver,
            _profile: profile,
        }
    }

    /// The browser console's messages since the last call: (level, text).
    pub async fn console(&self) -> Vec<(String, String)> {
        let entries = self
            .client
            .issue_cmd(BrowserLog)
            .await
            .expect("the browser log");
        let entries = entries.as_array().cloned().unwrap_or_default();
        entries
            .iter()
            .map(|e| {
                let level = e["level"].as_str().unwrap_or_default().to_owned();
                (level, e["message"].as_str().unwrap_or_default().to_owned())
            })
            .collect()
    }

    /// Fails when the console holds an error (or a warning) since the last call.
    pub async fn assert_no_console_errors(&self) {
        let bad: Vec<_> = (self.console().await.into_iter())
            .filter(|(level, _)| level == "SEVERE" || level == "WARNING")
            .collect();
        assert!(bad.is_empty(), "the page logged: {bad:?}");
    }

    /// The text of the first element `css` selects, once there is one (at most `within`).
    pub async fn text_of(&self, css: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(element) = self.client.find(Locator::Css(css)).await {
                if let Ok(text) = element.text().await {
                    return text;
                }
            }
            assert!(
                Instant::now() < deadline,
                "nothing matched {css} within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Waits until `check` (a script returning a boolean) is true, at most `within`; returns
    /// how long it took.
    pub async fn until(&self, what: &str, check: &str, within: Duration) -> Duration {
        let start = Instant::now();
        loop {
            let script = format!("return Boolean({check});");
            if self.client.execute(&script, Vec::new()).await.ok() == Some(Value::Bool(true)) {
                return start.elapsed();
            }
            assert!(start.elapsed() < within, "never within {within:?}: {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Writes a screenshot of the window to `target/live-pages/NAME.png` (printed).
    pub async fn screenshot(&self, name: &str) -> PathBuf {
        let png = self.client.screenshot().await.expect("a screenshot");
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("live-pages");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{name}.png"));
        std::fs::write(&path, png).unwrap();
        println!("screenshot: {}", path.display());
        path
    }

    /// Opens the live page of the server at `url` and waits until its stream is up.
    pub async fn open_live_page(&self, url: &str) {
        self.client.goto(&format!("{url}/ui")).await.unwrap();
        assert_eq!(self.text_of("#live", Duration::from_secs(5)).await, "live");
    }

    /// Photographs the page as `name`, fails on anything on the console, and ends the session.
    pub async fn finish(self, name: &str) {
        self.screenshot(name).await;
        self.assert_no_console_errors().await;
        self.close().await;
    }

    /// Ends the session and chromedriver.
    pub async fn close(mut self) {
        let _ = self.client.close().await;
        let _ = self.driver.kill().await;
    }
}

/// chromedriver's `POST /session/{id}/se/log` for the browser's console.
#[derive(Debug)]
struct BrowserLog;

impl WebDriverCompatibleCommand for BrowserLog {
    fn endpoint(
        &self,
        base: &url::Url,
        session: Option<&str>,
    ) -> Result<url::Url, url::ParseError> {
        base.join(&format!("session/{}/se/log", session.unwrap_or_default()))
    }

    fn method_and_body(&self, _: &url::Url) -> (reqwest::Method, Option<String>) {
        (
            reqwest::Method::POST,
            Some(json!({"type": "browser"}).to_string()),
        )
    }
}
