//! pd-epp's HTTP side, route by route: which answer without a key and which need the admin
//! key. A route added to `http.rs` and left out of this table fails here.

use pd_epp::{Config, Epp};
use pd_router::RouterConfig;

/// Every route: method, path, whether it needs the admin key, and the status an admitted
/// caller gets from an epp with one (unreachable) decode and no engine of both roles.
const ROUTES: &[(&str, &str, bool, u16)] = &[
    ("GET", "/metrics", false, 200),
    ("GET", "/health", false, 200),
    ("GET", "/ready", false, 200),
    ("GET", "/admin/backends", true, 200),
    ("POST", "/admin/drain", true, 200),
    // Past the key, the answer names the missing --dual.
    ("POST", "/admin/duties", true, 404),
];

async fn status(
    http: &reqwest::Client,
    base: &str,
    route: &(&str, &str, bool, u16),
    key: Option<&str>,
) -> u16 {
    let (method, path, _, _) = route;
    let url = format!("{base}{path}");
    let mut request = match *method {
        "GET" => http.get(url),
        _ if *path == "/admin/duties" => {
            (http.post(url)).json(&serde_json::json!({"duties": {"http://127.0.0.1:9": "prefill"}}))
        }
        _ => (http.post(url)).json(&serde_json::json!({"url": "http://127.0.0.1:9"})),
    };
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    request.send().await.unwrap().status().as_u16()
}

#[tokio::test]
async fn every_route_is_open_or_needs_the_admin_key_as_the_table_says() {
    let source = include_str!("../src/http.rs");
    let served = source.matches(".route(\"").count();
    assert_eq!(
        served,
        ROUTES.len(),
        "http.rs serves {served} routes; the table lists {}",
        ROUTES.len()
    );
    let http = reqwest::Client::new();
    for admin_key in [None, Some("admin")] {
        let mut config = Config::new(RouterConfig::new(
            Vec::new(),
            vec!["http://127.0.0.1:9".into()],
        ));
        config.admin_key = admin_key.map(str::to_owned);
        let epp = Epp::bind(config).await.unwrap();
        let base = format!("http://{}", epp.http_addr());
        let running = epp.spawn();
        for route in ROUTES {
            let (_, path, closed, admitted) = route;
            let anonymous = status(&http, &base, route, None).await;
            let wrong = status(&http, &base, route, Some("wrong")).await;
            if !closed {
                assert_eq!((anonymous, wrong), (*admitted, *admitted), "{path}");
                continue;
            }
            match admin_key {
                // Without --admin-key the operator routes are off for everyone.
                None => assert_eq!((anonymous, wrong), (403, 403), "{path}"),
                Some(key) => {
                    assert_eq!((anonymous, wrong), (401, 401), "{path}");
                    let answer = status(&http, &base, route, Some(key)).await;
                    assert_eq!(answer, *admitted, "{path}");
                }
            }
        }
        // The build serving, named on /metrics.
        let metrics = http.get(format!("{base}/metrics")).send().await.unwrap();
        let metrics = metrics.text().await.unwrap();
        assert!(metrics.contains("pd_epp_build_info{commit="), "{metrics}");
        running.shutdown().await.unwrap();
    }
}
