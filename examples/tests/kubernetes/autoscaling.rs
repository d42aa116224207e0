//! The engines' autoscalers (KEDA ScaledObjects, `components/autoscaling`): each agrees with
//! the proxy's capacity planner and with the engines it scales, and its query, run on a real
//! Prometheus scraping a real pd-proxy with the planner on, gives the engines the planner
//! desires, and nothing once the proxy is frozen (what KEDA's fallback is set to take).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::manifest::{argv, array_at, id, of_kind, pods, str_at};

/// A ScaledObject's one trigger's metadata (its query, threshold, ...), or `Null`.
fn trigger(scaler: &Value) -> &Value {
    &scaler["spec"]["triggers"][0]
}

/// The value that follows `flag` in a command line.
fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    let at = args.iter().position(|a| a == flag)?;
    args.get(at + 1).map(String::as_str)
}

/// Every `name="value"` of `label` in a PromQL query.
fn label_values<'a>(query: &'a str, label: &str) -> Vec<&'a str> {
    let key = format!("{label}=\"");
    query
        .match_indices(&key)
        .filter_map(|(at, _)| query[at + key.len()..].split('"').next())
        .collect()
}

/// The role an engine's pod serves, by its KV connector's `kv_role`.
fn role_of(container: &Value) -> Option<&'static str> {
    let env = array_at(container, "/env");
    let config = env.iter().find(|v| v["name"] == "KV_TRANSFER_CONFIG")?;
    let config = str_at(config, "/value");
    if config.contains("\"kv_producer\"") {
        Some("prefill")
    } else if config.contains("\"kv_consumer\"") {
        Some("decode")
    } else {
        None
    }
}

/// What is wrong with the ScaledObjects of `docs`, and how many there are.
pub fn problems(docs: &[Value]) -> (usize, Vec<String>) {
    let mut problems = Vec::new();
    let proxy = pods(docs)
        .into_iter()
        .flat_map(|pod| pod.containers().collect::<Vec<_>>())
        .find(|c| c["name"] == "pd-proxy")
        .map(argv)
        .unwrap_or_default();
    let mut count = 0;
    for scaler in of_kind(docs, "ScaledObject") {
        count += 1;
        let at = id(scaler);
        let mut wrong = |what: String| problems.push(format!("{at}: {what}"));
        let target = str_at(scaler, "/spec/scaleTargetRef/name");
        let Some(pod) = pods(docs)
            .into_iter()
            .find(|p| p.at == format!("Deployment/{target}"))
        else {
            wrong(format!("scales a missing Deployment/{target}"));
            continue;
        };
        if pod.workload["spec"].get("replicas").is_some() {
            wrong(format!("{} sets replicas, which the HPA owns", pod.at));
        }
        let engine = pod.containers().find(|c| c["name"] == "engine");
        let model = engine.and_then(|c| {
            let env = array_at(c, "/env");
            env.iter()
                .find(|v| v["name"] == "MODEL")
                .map(|v| str_at(v, "/value"))
        });
        let role = engine.and_then(role_of);
        let query = str_at(trigger(scaler), "/metadata/query");
        for (label, expected) in [("model", model), ("role", role)] {
            let found = label_values(query, label);
            if found.is_empty() || found.iter().any(|v| Some(*v) != expected) {
                wrong(format!("its query's {label} {found:?} is not {expected:?}"));
            }
        }
        if !query.contains("pd_proxy_planner_desired_engines") {
            wrong("its query does not read pd_proxy_planner_desired_engines".into());
        }
        let metadata = &trigger(scaler)["metadata"];
        let checks = [
            ("type", &trigger(scaler)["type"], "prometheus"),
            ("metricType", &trigger(scaler)["metricType"], "AverageValue"),
            ("threshold", &metadata["threshold"], "1"),
            ("ignoreNullValues", &metadata["ignoreNullValues"], "false"),
            (
                "fallback behavior",
                &scaler["spec"]["fallback"]["behavior"],
                "currentReplicasIfHigher",
            ),
        ];
        for (what, value, expected) in checks {
            if value != expected {
                wrong(format!("its {what} is {value}, not {expected:?}"));
            }
        }
        for (bound, flag) in [
            ("minReplicaCount", "--planner-min-engines"),
            ("maxReplicaCount", "--planner-max-engines"),
        ] {
            let count = scaler["spec"][bound].as_u64().map(|n| n.to_string());
            let planner = flag_value(&proxy, flag);
            if count.as_deref() != planner || planner.is_none() {
                wrong(format!(
                    "{bound} {count:?} differs from the proxy's {flag} {planner:?}"
                ));
            }
        }
        for flag in ["--planner-ttft-target", "--planner-tpot-target"] {
            if flag_value(&proxy, flag).is_none() {
                wrong(format!("the proxy plans nothing without {flag}"));
            }
        }
        // One engine at a time, each drained (its pod's grace period) before the next.
        let grace = pod.template["spec"]["terminationGracePeriodSeconds"]
            .as_u64()
            .unwrap_or(30);
        let behavior = "/spec/advanced/horizontalPodAutoscalerConfig/behavior/scaleDown/policies";
        let policies = array_at(scaler, behavior);
        if policies.is_empty() {
            wrong("no scale-down policy: the HPA's default removes engines at once".into());
        }
        for policy in policies {
            let paced = policy["type"] == "Pods"
                && policy["value"] == 1
                && policy["periodSeconds"].as_u64().unwrap_or(0) >= grace;
            if !paced {
                wrong(format!(
                    "scale-down policy {policy} removes more than one engine per {grace} s"
                ));
            }
        }
    }
    (count, problems)
}

/// Unix seconds, now.
fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// The one value of a query's answer, if it has one.
fn value(answer: &Value) -> Option<f64> {
    assert_eq!(answer["status"], "success", "{answer}");
    let result = answer["data"]["result"].as_array()?;
    assert!(result.len() <= 1, "KEDA needs one element: {answer}");
    result.first()?["value"][1].as_str()?.parse().ok()
}

/// What a ScaledObject's query should answer at `time`, from the planner's gauges of every
/// replica: the larger of ceil(sum of demand / mean known engine rate) and the largest desired.
async fn expected(prometheus: &pd_examples::prometheus::Prometheus, role: &str, time: f64) -> f64 {
    let gauges = |name: &str| {
        let expr = format!("pd_proxy_planner_{name}{{model=\"sim-model\",role=\"{role}\"}}");
        async move {
            let answer = prometheus.query_at(&expr, Some(time)).await;
            let result = answer["data"]["result"].as_array().cloned();
            (result.unwrap_or_default().iter())
                .map(|r| r["value"][1].as_str().unwrap().parse::<f64>().unwrap())
                .collect::<Vec<f64>>()
        }
    };
    let demand: f64 = gauges("demand_requests_per_second").await.iter().sum();
    let rates: Vec<f64> = (gauges("engine_requests_per_second").await.into_iter())
        .filter(|r| *r > 0.0)
        .collect();
    let desired = gauges("desired_engines").await;
    let plans = desired.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let floor = if rates.is_empty() {
        f64::NEG_INFINITY
    } else {
        (demand / (rates.iter().sum::<f64>() / rates.len() as f64)).ceil()
    };
    plans.max(floor)
}

/// A second proxy replica's planner gauges, served as a scrape target: more demand than the
/// real proxy sees, so that the fleet's floor, not one replica's plan, sets the query.
async fn another_replica() -> (String, tokio::task::JoinHandle<()>) {
    let page = "\
pd_proxy_planner_demand_requests_per_second{model=\"sim-model\",role=\"prefill\"} 400
pd_proxy_planner_engine_requests_per_second{model=\"sim-model\",role=\"prefill\"} -1
pd_proxy_planner_desired_engines{model=\"sim-model\",role=\"prefill\"} 2
pd_proxy_planner_demand_requests_per_second{model=\"sim-model\",role=\"decode\"} 1
pd_proxy_planner_engine_requests_per_second{model=\"sim-model\",role=\"decode\"} 1000
pd_proxy_planner_desired_engines{model=\"sim-model\",role=\"decode\"} 3
";
    let app =
        axum::Router::new().route("/metrics", axum::routing::get(move || async move { page }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, server)
}

/// Each rendered ScaledObject's role and query, for the sims' model.
fn sim_queries() -> Vec<(String, String)> {
    let rendered = (crate::render::all().iter())
        .find(|r| r.name == "overlays/vllm-autoscaled")
        .expect("the autoscaled overlay is rendered");
    let scalers: Vec<&Value> = of_kind(&rendered.docs, "ScaledObject").collect();
    assert_eq!(scalers.len(), 2, "one ScaledObject a role");
    scalers
        .into_iter()
        .map(|scaler| {
            let query = str_at(trigger(scaler), "/metadata/query");
            let model = label_values(query, "model")[0].to_owned();
            let role = label_values(query, "role")[0].to_owned();
            let query = query.replace(&format!("model=\"{model}\""), "model=\"sim-model\"");
            (role, query)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_autoscalers_queries_give_the_planners_engines_on_a_real_prometheus() {
    use crate::common::{load, planner_cluster};
    use pd_examples::cluster::Cluster;
    use pd_examples::prometheus::{tools, Job, Prometheus};

    tools();
    let queries = sim_queries();
    let (spec, _run_dir) = planner_cluster("autoscaling-", 2, 2);
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let (replica, server) = another_replica().await;
    let targets = [cluster.proxy.url.clone(), replica];
    let prometheus = Prometheus::start(
        &[Job {
            name: "pd-proxy",
            targets: &targets,
        }],
        None,
    );
    prometheus.wait_up(2).await;

    // Light load: the real proxy's plans hold two of each (a scale-down waits its window); the
    // other replica's prefill demand is 400 a second, more than two prefills take.
    // Read while it lasts: once it is over, the real proxy's window empties.
    let light = tokio::spawn({
        let proxy = cluster.proxy.url.clone();
        async move { load(&proxy, 4.0, 7.0, 2_000, 12).await }
    });
    tokio::time::sleep(Duration::from_secs(4)).await;
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut answers = Vec::new();
    loop {
        let time = now() - 1.0;
        answers.clear();
        for (role, query) in &queries {
            let got = value(&prometheus.query_at(query, Some(time)).await);
            answers.push((role.clone(), got, expected(&prometheus, role, time).await));
        }
        let settled = answers.iter().all(|(_, got, _)| got.is_some());
        if settled || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    light.await.unwrap();
    eprintln!("(role, the query's engines, the gauges' floor or largest plan): {answers:?}");
    for (role, got, expected) in &answers {
        let got = got.unwrap_or_else(|| panic!("{role}: the query answers nothing"));
        assert_eq!(got, *expected, "{role}: {answers:?}");
        match role.as_str() {
            // The floor: 400 + the real proxy's ~4 a second over its prefill's rate.
            "prefill" => assert!(got > 2.0, "{answers:?}"),
            // The largest plan: the other replica's 3.
            _ => assert_eq!(got, 3.0, "{answers:?}"),
        }
    }

    // Every replica gone (the real one frozen, the other stopped): the queries answer nothing,
    // which the ScaledObjects' ignoreNullValues "false" makes an error, and so the fallback.
    server.abort();
    cluster.proxy.freeze(true);
    let deadline = Instant::now() + Duration::from_secs(15);
    for (role, query) in &queries {
        while value(&prometheus.query(query).await).is_some() {
            assert!(
                Instant::now() < deadline,
                "{role}: still answers with every proxy down"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    cluster.proxy.freeze(false);
}
