//! The Kubernetes manifests of `examples/kubernetes`: every kustomization renders, validates
//! strictly against Kubernetes' API schemas, and cannot drift from the code: the flags and
//! variables given to this project's binaries are theirs, probes and scrapes hit routes they
//! serve, and ports, Services, selectors and DNS names agree.
//!
//! Needs bootstrap-server, pd-proxy and worker-client in the test's target folder (built here
//! when missing; `cargo test --workspace` builds them), kubectl, python3 with venv, and PyPI the
//! first time: `examples/kubernetes/tools.sh` (run from here) installs what is missing.

mod autoscaling;
mod checks;
#[path = "../common/mod.rs"]
mod common;
mod manifest;
mod render;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::Duration;

use manifest::{array_at, id, invocations, of_kind, pods, probes, str_at};
use pd_examples::cluster::{free_port, spawn, wait_for};
use render::{all, binary as binary_path, root, run, run_status, venv};
use serde_json::{json, Value};

/// The Kubernetes versions validated against: the first with native sidecars on by default
/// and GA (every prefill pod runs one), and the newest kubernetes-validate knows.
const KUBERNETES_VERSIONS: &[&str] = &["1.33.0", "1.37.0"];

/// Kinds that are not Kubernetes' own (so not in its schemas), each validated instead against
/// a schema of its own under `examples/kubernetes/schemas`.
const CUSTOM_KINDS: &[(&str, &str)] = &[
    ("ServiceMonitor", "schemas/servicemonitor.json"),
    ("InferencePool", "schemas/inferencepool.json"),
    ("HTTPRoute", "schemas/httproute.json"),
    ("ScaledObject", "schemas/scaledobject.json"),
];

/// Validates one document against a JSON schema (argv[1]) read as JSON on stdin; prints why not.
const VALIDATE_SCHEMA: &str = "import json, sys, jsonschema
schema = json.load(open(sys.argv[1]))
for e in jsonschema.Draft202012Validator(schema).iter_errors(json.load(sys.stdin)):
    print('/'.join(map(str, e.absolute_path)) + ': ' + e.message)";

/// kubernetes-validate's verdict on `docs`: the lines it printed (none when they are valid).
fn kubernetes_validate(docs: &[&Value]) -> String {
    let file = tempfile::NamedTempFile::new().unwrap();
    let yaml: Vec<String> = docs.iter().map(|d| d.to_string()).collect();
    std::fs::write(file.path(), yaml.join("\n---\n")).unwrap();
    let mut command = Command::new(venv().join("bin/kubernetes-validate"));
    command.args(["--strict", "--quiet"]);
    for version in KUBERNETES_VERSIONS {
        command.args(["-k", version]);
    }
    let (_, stdout, stderr) = run_status(command.arg(file.path()), "");
    format!("{stdout}{stderr}").trim().to_owned()
}

/// The schema's verdict on `doc`: why it is invalid, or nothing.
fn schema_validate(schema: &str, doc: &Value) -> String {
    let mut python = Command::new(venv().join("bin/python"));
    python
        .args(["-c", VALIDATE_SCHEMA])
        .arg(root().join(schema));
    run(&mut python, &doc.to_string()).trim().to_owned()
}

#[test]
fn every_kustomization_renders_and_validates_strictly() {
    let mut custom_validated = 0;
    for rendered in all() {
        let name = rendered.name;
        assert!(!rendered.docs.is_empty(), "{name} renders nothing");
        let is_custom = |d: &Value| CUSTOM_KINDS.iter().any(|(kind, _)| d["kind"] == *kind);
        let core: Vec<&Value> = rendered.docs.iter().filter(|d| !is_custom(d)).collect();
        // With --quiet it prints only failures and warnings; a kind it has no schema for is a
        // warning, so no output means every document was found and valid.
        let verdict = kubernetes_validate(&core);
        assert!(verdict.is_empty(), "{name}:\n{verdict}");
        for (kind, schema) in CUSTOM_KINDS {
            for doc in of_kind(&rendered.docs, kind) {
                let verdict = schema_validate(schema, doc);
                assert!(verdict.is_empty(), "{name} {}: {verdict}", id(doc));
                custom_validated += 1;
            }
        }
    }
    // Every ServiceMonitor, the gateway overlay's InferencePool and HTTPRoute, and the
    // autoscaled overlay's ScaledObjects.
    assert!(
        custom_validated > 4,
        "{custom_validated} custom documents validated"
    );
}

#[test]
fn the_validators_refuse_what_kubernetes_would() {
    // A field a Service does not have, and a wrong type.
    let service = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"},
        "spec": {"ports": [{"port": "http"}], "clusterIp": "None"}});
    let verdict = kubernetes_validate(&[&service]);
    assert!(verdict.contains("ERROR"), "{verdict}");
    // A kind it does not know is only a warning: still a failure here (the check is "prints
    // nothing").
    let unknown =
        json!({"apiVersion": "example.com/v1", "kind": "Thing", "metadata": {"name": "t"}});
    assert!(kubernetes_validate(&[&unknown]).contains("Couldn't find schema"));
    let monitor = json!({"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
        "metadata": {"name": "m"}, "spec": {"selector": {},
        "endpoints": [{"port": "http", "interval": "15 seconds", "pathh": "/metrics"}]}});
    let verdict = schema_validate(CUSTOM_KINDS[0].1, &monitor);
    assert!(
        verdict.contains("interval") && verdict.contains("pathh"),
        "{verdict}"
    );
    // An InferencePool with a misspelled field, a port out of range, a failure mode v1 does
    // not have, and a Service picker without its port.
    let pool = json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "p"}, "spec": {"selector": {"matchLabels": {"app": "d"}},
        "targetPortz": [{"number": 8000}], "targetPorts": [{"number": 70000}],
        "endpointPickerRef": {"name": "epp", "failureMode": "FailSoft"}}});
    let verdict = schema_validate(CUSTOM_KINDS[1].1, &pool);
    for wrong in ["targetPortz", "70000", "FailSoft", "port"] {
        assert!(verdict.contains(wrong), "{wrong} passed: {verdict}");
    }
    // A ScaledObject with a fallback behaviour KEDA does not have, a misspelled metric type
    // field, a threshold given as a number, and a scale-down policy of zero pods.
    let scaler = json!({"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": {"name": "s"}, "spec": {"scaleTargetRef": {"name": "decode"},
        "fallback": {"failureThreshold": 3, "replicas": 1, "behavior": "keepCurrent"},
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {"scaleDown":
            {"policies": [{"type": "Pods", "value": 0, "periodSeconds": 60}]}}}},
        "triggers": [{"type": "prometheus", "metrictype": "AverageValue",
            "metadata": {"query": "up", "threshold": 1}}]}});
    let verdict = schema_validate(CUSTOM_KINDS[3].1, &scaler);
    for wrong in ["keepCurrent", "metrictype", "threshold", "value"] {
        assert!(verdict.contains(wrong), "{wrong} passed: {verdict}");
    }
}

/// `binary --help`, and for worker-client the help of the subcommand `args` run.
fn help(binary: &str, args: &[String]) -> String {
    let path = binary_path(binary);
    let main = run(Command::new(&path).arg("--help"), "");
    let commands = main.split("Commands:").nth(1).unwrap_or("");
    let names: BTreeSet<&str> = commands
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .take_while(|w| !w.ends_with(':'))
        .collect();
    match args.iter().find(|a| names.contains(a.as_str())) {
        Some(sub) => main + &run(Command::new(&path).args([sub, "--help"]), ""),
        None => main,
    }
}

/// Whether a help text documents `--flag` (not merely a longer flag it starts).
fn documents_flag(help: &str, flag: &str) -> bool {
    help.match_indices(flag).any(|(at, _)| {
        let next = help[at + flag.len()..].chars().next();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}

#[test]
fn our_binaries_know_every_flag_and_variable_the_manifests_give_them() {
    let mut unknown = BTreeSet::new();
    let mut seen = BTreeSet::new();
    for rendered in all() {
        for run in invocations(&rendered.docs) {
            seen.insert(run.binary);
            let help = help(run.binary, &run.args);
            for arg in run.args.iter().filter(|a| a.starts_with("--")) {
                let flag = arg.split('=').next().unwrap();
                if !documents_flag(&help, flag) {
                    unknown.insert(format!("{} {flag} ({})", run.binary, run.at));
                }
            }
            // Our own variables: the binary must read them (its help names each).
            for var in run.env.iter().filter(|v| v.starts_with("PD_")) {
                if !help.contains(var.as_str()) {
                    unknown.insert(format!("{} ${var} ({})", run.binary, run.at));
                }
            }
        }
    }
    assert_eq!(seen.len(), manifest::BINARIES.len(), "runs found: {seen:?}");
    let unknown: Vec<String> = unknown.into_iter().collect();
    assert!(
        unknown.is_empty(),
        "not in the binary's --help:\n{}",
        unknown.join("\n")
    );
}

/// Every HTTP path the manifests expect of each binary: its probes, and the scrapes of the
/// ServiceMonitors whose Service leads to it.
fn expected_routes() -> BTreeMap<&'static str, BTreeSet<String>> {
    let mut routes: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    for rendered in all() {
        let docs = &rendered.docs;
        for pod in pods(docs) {
            for container in pod.containers() {
                let Some(binary) = checks::binary_of(container) else {
                    continue;
                };
                for (_, path, _) in probes(container) {
                    routes.entry(binary).or_default().insert(path.to_owned());
                }
            }
        }
        for (binary, path) in checks::scraped_paths(docs) {
            routes.entry(binary).or_default().insert(path);
        }
    }
    routes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_and_scrapes_hit_routes_the_binaries_serve() {
    let routes = expected_routes();
    assert!(
        ["bootstrap-server", "pd-proxy", "pd-epp"]
            .iter()
            .all(|binary| routes.contains_key(binary)),
        "{routes:?}"
    );
    let dir = tempfile::tempdir().unwrap();
    for (binary, paths) in &routes {
        let port = free_port();
        let data = dir.path().join("data").display().to_string();
        let mut args = vec!["--host", "127.0.0.1"];
        // The least each needs to start; the proxies' backends need not exist. pd-epp serves
        // HTTP on its --admin-port (its --port is gRPC).
        let (grpc, port_flag) = (
            free_port().to_string(),
            match *binary {
                "pd-epp" => "--admin-port",
                _ => "--port",
            },
        );
        match *binary {
            "bootstrap-server" => args.extend(["--data-dir", &data]),
            "pd-proxy" => args.extend([
                "--prefill",
                "http://127.0.0.1:9",
                "--decode",
                "http://127.0.0.1:9",
            ]),
            "pd-epp" => args.extend(["--decode", "http://127.0.0.1:9", "--port", &grpc]),
            other => panic!("{other} serves nothing here"),
        }
        let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
        let args = [args, vec![port_flag.into(), port.to_string()]].concat();
        let url = format!("http://127.0.0.1:{port}");
        let program = binary_path(binary);
        let mut process = spawn(dir.path(), binary, &program, &args, url.clone()).unwrap();
        wait_for(&mut process, "/health", Duration::from_secs(20))
            .await
            .unwrap();
        for path in paths {
            let status = reqwest::get(format!("{url}{path}")).await.unwrap().status();
            assert_ne!(status, 404, "{binary} does not serve {path}");
        }
    }
}

#[test]
fn ports_services_selectors_and_names_agree() {
    let mut problems = Vec::new();
    for rendered in all() {
        for problem in checks::references(&rendered.docs) {
            problems.push(format!("{}: {problem}", rendered.name));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_references_check_catches_a_wrong_port() {
    let base = &all()[0];
    let mut docs = base.docs.clone();
    let service = docs
        .iter_mut()
        .find(|d| id(d) == "Service/pd-proxy")
        .unwrap();
    service["spec"]["ports"][0]["targetPort"] = json!("metrics");
    let problems = checks::references(&docs);
    assert!(
        problems.iter().any(|p| p.contains("Service/pd-proxy")),
        "{problems:?}"
    );
}

#[test]
fn every_prefill_pod_serves_the_bootstrap_port_the_proxy_names() {
    let mut problems = Vec::new();
    for rendered in all() {
        let (checked, found) = checks::prefill_bootstraps(&rendered.docs);
        problems.extend(found.into_iter().map(|p| format!("{}: {p}", rendered.name)));
        // Every kustomization with a proxy whose prefills have a bootstrap server (all but
        // NIXL's sequential mode, and the dashboards, which have no proxy) was checked.
        let expected = !["overlays/vllm-nixl", "dashboards"].contains(&rendered.name);
        assert_eq!(
            checked > 0,
            expected,
            "{}: {checked} pods checked",
            rendered.name
        );
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_bootstrap_check_catches_a_prefill_without_its_registry() {
    let base = &all()[0];
    let prefill = |docs: &[Value]| -> usize {
        docs.iter()
            .position(|d| id(d) == "Deployment/prefill")
            .unwrap()
    };
    // The central registry of old: no sidecar, and vLLM registering at a Service.
    let mut docs = base.docs.clone();
    let at = prefill(&docs);
    let spec = &mut docs[at]["spec"]["template"]["spec"];
    spec["initContainers"]
        .as_array_mut()
        .unwrap()
        .retain(|c| c["name"] != "bootstrap-server");
    for var in spec["containers"][0]["env"].as_array_mut().unwrap() {
        if var["name"] == "KV_TRANSFER_CONFIG" {
            let value = var["value"].as_str().unwrap();
            var["value"] =
                json!(value.replace("127.0.0.1:8998", "bootstrap.pd.svc.cluster.local:8998"));
        }
    }
    let (checked, problems) = checks::prefill_bootstraps(&docs);
    assert!(checked > 0);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("runs bootstrap-server on 0.0.0.0:8998")),
        "{problems:?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p.contains("registers at bootstrap.pd.svc.cluster.local:8998")),
        "{problems:?}"
    );
    // A sidecar listening on loopback only, which D cannot reach.
    let mut docs = base.docs.clone();
    let at = prefill(&docs);
    let sidecar = docs[at]["spec"]["template"]["spec"]["initContainers"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|c| c["name"] == "bootstrap-server")
        .unwrap();
    let args = sidecar["args"].as_array_mut().unwrap();
    let host = args.iter().position(|a| a == "--host").unwrap();
    args[host + 1] = json!("127.0.0.1");
    let (_, problems) = checks::prefill_bootstraps(&docs);
    assert!(!problems.is_empty(), "a loopback-only registry passed");
    // A P deployment's registry named by URL: its leader registering at its own loopback
    // instead, and the registry's Service pointed at a port nothing listens on.
    let multinode = all().iter().find(|r| r.name == "overlays/vllm-multinode");
    let mut docs = multinode.unwrap().docs.clone();
    for doc in docs.iter_mut() {
        if id(doc) == "StatefulSet/prefill" {
            let env = &mut doc["spec"]["template"]["spec"]["containers"][0]["env"];
            for var in env.as_array_mut().unwrap() {
                if var["name"] == "KV_TRANSFER_CONFIG" {
                    let value = var["value"].as_str().unwrap();
                    let local = value.replace("registry.pd.svc.cluster.local", "127.0.0.1");
                    var["value"] = json!(local);
                }
            }
        }
        if id(doc) == "Service/registry" {
            doc["spec"]["ports"][0]["targetPort"] = json!(9999);
        }
    }
    let (_, problems) = checks::prefill_bootstraps(&docs);
    let found = |text: &str| problems.iter().any(|p| p.contains(text));
    assert!(
        found("registers at 127.0.0.1:8998, not at registry.pd.svc.cluster.local:8998"),
        "{problems:?}"
    );
    assert!(
        found("runs bootstrap-server on 0.0.0.0:9999"),
        "{problems:?}"
    );
}

#[test]
fn images_are_pinned_and_ours_carry_the_workspace_version() {
    let ours = format!("pd-bootstrap:{}", env!("CARGO_PKG_VERSION"));
    for rendered in all() {
        for pod in pods(&rendered.docs) {
            for container in pod.containers() {
                let image = str_at(container, "/image");
                let tag = image.rsplit_once(':').map(|(_, tag)| tag);
                assert!(
                    tag.is_some_and(|t| t != "latest"),
                    "{} {}: {image} is not pinned",
                    rendered.name,
                    pod.at
                );
                if image.starts_with("pd-bootstrap") {
                    assert_eq!(image, ours, "{} {}", rendered.name, pod.at);
                }
            }
        }
    }
}

/// pd-proxy's arguments in one kustomization.
fn proxy_args(name: &str) -> Vec<String> {
    let rendered = all().iter().find(|r| r.name == name).unwrap();
    let proxy = of_kind(&rendered.docs, "Deployment")
        .find(|d| str_at(d, "/metadata/name") == "pd-proxy")
        .unwrap();
    manifest::argv(&array_at(proxy, "/spec/template/spec/containers")[0])
}

#[test]
fn each_overlay_runs_the_proxy_in_the_mode_its_engines_need() {
    let dns = "dns://prefill.pd.svc.cluster.local:8000";
    for (name, mode, bootstrap) in [
        ("overlays/vllm-mooncake", "concurrent", "8998"),
        ("overlays/vllm-nixl", "sequential", "none"),
        ("overlays/sglang", "sglang", "8998"),
        (
            "overlays/vllm-multinode",
            "concurrent",
            "http://registry.pd.svc.cluster.local:8998",
        ),
        (
            "overlays/vllm-multinode-etcd",
            "concurrent",
            "http://registry.pd.svc.cluster.local:8998",
        ),
    ] {
        let args = proxy_args(name);
        let after = |flag: &str, n: usize| {
            let at = args.iter().position(|a| a == flag).unwrap();
            args[at + 1..=at + n].to_vec()
        };
        assert_eq!(after("--mode", 1), [mode], "{name}");
        assert_eq!(after("--prefill", 2), [dns, bootstrap], "{name}");
    }
}

/// The gateway overlay's pieces agree: the InferencePool selects the decode pods and targets
/// the port their sidecar (pd-proxy --sidecar) serves, its picker is the Service of pd-epp at
/// its gRPC port, pd-epp sends each decode's requests to that port, and the HTTPRoute leads to
/// the pool.
#[test]
fn the_gateway_overlay_routes_through_the_picker_to_the_sidecars() {
    let rendered = all()
        .iter()
        .find(|r| r.name == "overlays/gateway-api")
        .unwrap();
    let docs = &rendered.docs;
    let pool = of_kind(docs, "InferencePool")
        .next()
        .expect("an InferencePool");
    let target = pool["spec"]["targetPorts"][0]["number"].as_u64().unwrap();
    let decode = of_kind(docs, "Deployment")
        .find(|d| str_at(d, "/metadata/name") == "decode")
        .unwrap();
    let labels = &decode["spec"]["template"]["metadata"]["labels"];
    for (key, value) in pool["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(
            &labels[key], value,
            "the pool does not select the decode pods"
        );
    }
    let pod = &decode["spec"]["template"]["spec"];
    let sidecar = (array_at(pod, "/initContainers").iter())
        .find(|c| manifest::argv(c).contains(&"--sidecar".to_owned()))
        .expect("a pd-proxy --sidecar in the decode pods");
    let argv = manifest::argv(sidecar);
    let port = argv
        .iter()
        .position(|a| a == "--port")
        .map(|i| argv[i + 1].clone());
    assert_eq!(
        port.as_deref(),
        Some(target.to_string().as_str()),
        "{argv:?}"
    );
    let picker = &pool["spec"]["endpointPickerRef"];
    let service = of_kind(docs, "Service")
        .find(|s| s["metadata"]["name"] == picker["name"])
        .expect("the picker's Service");
    let grpc = (array_at(service, "/spec/ports").iter())
        .find(|p| p["port"] == picker["port"]["number"])
        .expect("the picker's port on its Service");
    assert_eq!(grpc["appProtocol"], "kubernetes.io/h2c");
    let epp = of_kind(docs, "Deployment")
        .find(|d| str_at(d, "/metadata/name") == "pd-epp")
        .unwrap();
    let argv = manifest::argv(&array_at(epp, "/spec/template/spec/containers")[0]);
    let after = |flag: &str| {
        argv.iter()
            .position(|a| a == flag)
            .map(|i| argv[i + 1].clone())
    };
    assert_eq!(after("--destination-port"), Some(target.to_string()));
    assert_eq!(
        after("--port"),
        Some(grpc["targetPort"].as_str().map_or_else(
            || grpc["targetPort"].to_string(),
            |name| {
                let container = &array_at(epp, "/spec/template/spec/containers")[0];
                let declared = array_at(container, "/ports")
                    .iter()
                    .find(|p| p["name"] == name)
                    .unwrap();
                declared["containerPort"].to_string()
            },
        ))
    );
    let route = of_kind(docs, "HTTPRoute").next().expect("an HTTPRoute");
    let backend = &route["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!(backend["kind"], "InferencePool");
    assert_eq!(backend["name"], pool["metadata"]["name"]);
    assert!(
        of_kind(docs, "Deployment").all(|d| str_at(d, "/metadata/name") != "pd-proxy"),
        "the standalone proxy is gone"
    );
}

#[test]
fn the_engine_autoscalers_agree_with_the_planner_and_their_engines() {
    let mut problems = Vec::new();
    for rendered in all() {
        let (count, found) = autoscaling::problems(&rendered.docs);
        problems.extend(found.into_iter().map(|p| format!("{}: {p}", rendered.name)));
        // One ScaledObject a role where the overlay asks for them, none elsewhere.
        let expected = if rendered.name == "overlays/vllm-autoscaled" {
            2
        } else {
            0
        };
        assert_eq!(count, expected, "{}", rendered.name);
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_autoscaler_check_catches_drift_from_the_planner_and_the_engines() {
    let rendered = all()
        .iter()
        .find(|r| r.name == "overlays/vllm-autoscaled")
        .unwrap();
    let mut docs = rendered.docs.clone();
    let at = |docs: &[Value], wanted: &str| docs.iter().position(|d| id(d) == wanted).unwrap();
    let scaler = at(&docs, "ScaledObject/decode");
    let spec = &mut docs[scaler]["spec"];
    spec["maxReplicaCount"] = json!(16);
    let query = spec["triggers"][0]["metadata"]["query"].as_str().unwrap();
    let query = query.replacen("role=\"decode\"", "role=\"prefill\"", 1);
    spec["triggers"][0]["metadata"]["query"] = json!(query);
    spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["policies"] =
        json!([{"type": "Percent", "value": 100, "periodSeconds": 15}]);
    let decode = at(&docs, "Deployment/decode");
    docs[decode]["spec"]["replicas"] = json!(2);
    let (_, problems) = autoscaling::problems(&docs);
    for expected in [
        "maxReplicaCount Some(\"16\") differs from the proxy's --planner-max-engines",
        "its query's role",
        "removes more than one engine per 60 s",
        "Deployment/decode sets replicas",
    ] {
        assert!(
            problems.iter().any(|p| p.contains(expected)),
            "{expected} not caught: {problems:?}"
        );
    }
}
