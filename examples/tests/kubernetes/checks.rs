//! What the manifests refer to must exist among them: the ports flags, probes, Services and
//! ServiceMonitors name, the pods selectors pick, the Services DNS names point at, the volumes
//! and ConfigMaps containers mount, the workloads autoscalers scale.

use serde_json::Value;

use crate::manifest::{argv, array_at, id, of_kind, pods, probes, split_binary, str_at, Pod};

/// The Secrets the operator makes before applying (docs/kubernetes.md): nothing renders them.
const OPERATOR_SECRETS: &[&str] = &["pd-proxy-keys", "hf-token"];

/// Which of this project's binaries a container runs.
pub fn binary_of(container: &Value) -> Option<&'static str> {
    split_binary(&argv(container)).map(|(binary, _)| binary)
}

/// Whether a container declares `port` (a name, or a number).
fn declares(container: &Value, port: &Value) -> bool {
    array_at(container, "/ports")
        .iter()
        .any(|p| p["name"] == *port || p["containerPort"] == *port)
}

/// The containers of `pod` that declare `port`.
fn serving<'a>(pod: &Pod<'a>, port: &'a Value) -> impl Iterator<Item = &'a Value> {
    pod.containers().filter(move |c| declares(c, port))
}

/// The Services whose labels `selector` (of a ServiceMonitor) matches.
fn services_selected<'a>(docs: &'a [Value], selector: &'a Value) -> Vec<&'a Value> {
    let wanted = selector["matchLabels"].as_object();
    of_kind(docs, "Service")
        .filter(|s| wanted.is_some_and(|w| w.iter().all(|(k, v)| &s["metadata"]["labels"][k] == v)))
        .collect()
}

/// The port a Service port forwards to (its `targetPort`, else its `port`).
fn target(port: &Value) -> &Value {
    port.get("targetPort").unwrap_or(&port["port"])
}

/// (binary, path) of every scrape a ServiceMonitor makes of one of this project's binaries.
pub fn scraped_paths(docs: &[Value]) -> Vec<(&'static str, String)> {
    let pods = pods(docs);
    let mut found = Vec::new();
    for monitor in of_kind(docs, "ServiceMonitor") {
        for service in services_selected(docs, &monitor["spec"]["selector"]) {
            for endpoint in array_at(monitor, "/spec/endpoints") {
                let path = endpoint["path"].as_str().unwrap_or("/metrics");
                let ports = array_at(service, "/spec/ports");
                let Some(port) = ports.iter().find(|p| p["name"] == endpoint["port"]) else {
                    continue;
                };
                let selector = &service["spec"]["selector"];
                for pod in pods.iter().filter(|p| p.selected_by(selector)) {
                    for container in serving(pod, target(port)) {
                        if let Some(binary) = binary_of(container) {
                            found.push((binary, path.to_owned()));
                        }
                    }
                }
            }
        }
    }
    found
}

/// Every reference among `docs` that points at nothing, one line each.
pub fn references(docs: &[Value]) -> Vec<String> {
    let mut problems = Vec::new();
    containers(docs, &mut problems);
    services(docs, &mut problems);
    monitors(docs, &mut problems);
    budgets_and_autoscalers(docs, &mut problems);
    dns_names(docs, &mut problems);
    problems
}

/// A container's `--port` and probe ports are ports it declares; its volumes and ConfigMaps
/// exist.
fn containers(docs: &[Value], problems: &mut Vec<String>) {
    let config_maps: Vec<&str> = of_kind(docs, "ConfigMap")
        .map(|m| str_at(m, "/metadata/name"))
        .collect();
    for pod in pods(docs) {
        let volumes: Vec<&str> = array_at(pod.template, "/spec/volumes")
            .iter()
            .chain(array_at(pod.workload, "/spec/volumeClaimTemplates"))
            .map(|v| {
                v["name"]
                    .as_str()
                    .or(v["metadata"]["name"].as_str())
                    .unwrap_or("")
            })
            .collect();
        for volume in array_at(pod.template, "/spec/volumes") {
            let map = str_at(volume, "/configMap/name");
            if !map.is_empty() && !config_maps.contains(&map) {
                problems.push(format!("{}: no ConfigMap {map}", pod.at));
            }
        }
        for container in pod.containers() {
            let at = format!("{} container {}", pod.at, str_at(container, "/name"));
            let argv = argv(container);
            for pair in argv.windows(2).filter(|w| w[0] == "--port") {
                let port: Value = pair[1].parse::<u64>().map_or(Value::Null, Value::from);
                if !declares(container, &port) {
                    problems.push(format!("{at}: --port {} is not a containerPort", pair[1]));
                }
            }
            for (which, path, port) in probes(container) {
                if !declares(container, port) {
                    problems.push(format!("{at}: {which} {path} on undeclared port {port}"));
                }
            }
            for mount in array_at(container, "/volumeMounts") {
                let name = str_at(mount, "/name");
                if !volumes.contains(&name) {
                    problems.push(format!("{at}: mounts {name}, no such volume"));
                }
            }
            for var in array_at(container, "/env") {
                let secret = str_at(var, "/valueFrom/secretKeyRef/name");
                if !secret.is_empty() && !OPERATOR_SECRETS.contains(&secret) {
                    problems.push(format!("{at}: Secret {secret} is not documented"));
                }
            }
        }
    }
}

/// A Service selects pods, and each of its ports reaches a port they declare.
fn services(docs: &[Value], problems: &mut Vec<String>) {
    let pods = pods(docs);
    for service in of_kind(docs, "Service") {
        let selector = &service["spec"]["selector"];
        let chosen: Vec<&Pod> = pods.iter().filter(|p| p.selected_by(selector)).collect();
        if chosen.is_empty() {
            problems.push(format!("{} selects no pod", id(service)));
        }
        for port in array_at(service, "/spec/ports") {
            for pod in chosen
                .iter()
                .filter(|p| serving(p, target(port)).next().is_none())
            {
                let target = target(port);
                problems.push(format!(
                    "{}: {} declares no port {target}",
                    id(service),
                    pod.at
                ));
            }
        }
    }
}

/// A ServiceMonitor selects Services that have the ports it scrapes.
fn monitors(docs: &[Value], problems: &mut Vec<String>) {
    for monitor in of_kind(docs, "ServiceMonitor") {
        let chosen = services_selected(docs, &monitor["spec"]["selector"]);
        if chosen.is_empty() {
            problems.push(format!("{} selects no Service", id(monitor)));
        }
        for endpoint in array_at(monitor, "/spec/endpoints") {
            for service in &chosen {
                if !array_at(service, "/spec/ports")
                    .iter()
                    .any(|p| p["name"] == endpoint["port"])
                {
                    let port = &endpoint["port"];
                    problems.push(format!(
                        "{}: {} has no port {port}",
                        id(monitor),
                        id(service)
                    ));
                }
            }
        }
    }
}

/// A disruption budget selects pods; an autoscaler's target exists.
fn budgets_and_autoscalers(docs: &[Value], problems: &mut Vec<String>) {
    let pods = pods(docs);
    for budget in of_kind(docs, "PodDisruptionBudget") {
        if !pods
            .iter()
            .any(|p| p.selected_by(&budget["spec"]["selector"]))
        {
            problems.push(format!("{} selects no pod", id(budget)));
        }
    }
    for scaler in of_kind(docs, "HorizontalPodAutoscaler") {
        let target = &scaler["spec"]["scaleTargetRef"];
        if !docs
            .iter()
            .any(|d| d["kind"] == target["kind"] && d["metadata"]["name"] == target["name"])
        {
            problems.push(format!("{} scales a missing {target}", id(scaler)));
        }
    }
}

/// Every `NAME.NAMESPACE.svc.cluster.local[:PORT]` in any string (a pod of a StatefulSet's
/// Service is `POD.NAME...`) is a Service of the manifests, in that namespace, with that port.
fn dns_names(docs: &[Value], problems: &mut Vec<String>) {
    let mut strings = Vec::new();
    for doc in docs {
        collect_strings(doc, &mut strings);
    }
    let hostish = |c: char| c.is_ascii_alphanumeric() || ".-:".contains(c);
    for word in strings.iter().flat_map(|s| s.split(|c| !hostish(c))) {
        let Some((host, rest)) = word.split_once(".svc.cluster.local") else {
            continue;
        };
        let mut labels = host.rsplit('.');
        let (namespace, name) = (labels.next().unwrap_or(""), labels.next().unwrap_or(""));
        let port: Option<u64> = rest.strip_prefix(':').and_then(|p| p.parse().ok());
        let service = of_kind(docs, "Service").find(|s| {
            str_at(s, "/metadata/name") == name && str_at(s, "/metadata/namespace") == namespace
        });
        let Some(service) = service else {
            problems.push(format!(
                "{word}: no Service {name} in namespace {namespace}"
            ));
            continue;
        };
        let ports = array_at(service, "/spec/ports");
        if port.is_some_and(|p| !ports.iter().any(|q| q["port"] == p)) {
            problems.push(format!("{word}: {} has no such port", id(service)));
        }
    }
}

fn collect_strings<'a>(value: &'a Value, into: &mut Vec<&'a str>) {
    match value {
        Value::String(s) => into.push(s),
        Value::Array(items) => items.iter().for_each(|v| collect_strings(v, into)),
        Value::Object(map) => map.values().for_each(|v| collect_strings(v, into)),
        _ => {}
    }
}
