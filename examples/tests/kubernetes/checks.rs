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
    let scalers = of_kind(docs, "HorizontalPodAutoscaler").chain(of_kind(docs, "ScaledObject"));
    for scaler in scalers {
        let target = &scaler["spec"]["scaleTargetRef"];
        // KEDA's default kind is a Deployment.
        let kind = target
            .get("kind")
            .map_or("Deployment", |k| k.as_str().unwrap_or(""));
        if !docs
            .iter()
            .any(|d| d["kind"] == kind && d["metadata"]["name"] == target["name"])
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

/// A flag's value in a command line (`--flag VALUE` or `--flag=VALUE`).
fn flag_value<'a>(argv: &'a [String], flag: &str) -> Option<&'a str> {
    argv.iter().enumerate().find_map(|(at, arg)| {
        if arg == flag {
            argv.get(at + 1).map(String::as_str)
        } else {
            arg.strip_prefix(flag)?.strip_prefix('=')
        }
    })
}

/// Where a prefill's bootstrap server is, as a pd-proxy command line says.
#[derive(Debug)]
enum Bootstrap {
    /// On the prefill's own address, at this port.
    Port(u16),
    /// At this URL: a registry of its own.
    Url(String),
}

/// The prefills a pd-proxy command line names with a bootstrap server: (URL, where). As
/// pd-proxy reads `--prefill URL [BOOTSTRAP_PORT|BOOTSTRAP_URL]`: `none` or no port is 8998,
/// except in sequential mode, where it is no bootstrap server at all.
fn proxy_prefills(args: &[String]) -> Vec<(String, Bootstrap)> {
    let sequential = flag_value(args, "--mode") == Some("sequential");
    let mut found = Vec::new();
    for (at, _) in args.iter().enumerate().filter(|(_, a)| *a == "--prefill") {
        let Some(url) = args.get(at + 1) else {
            continue;
        };
        let port = args.get(at + 2).filter(|p| !p.starts_with("--"));
        let bootstrap = match port.map(String::as_str) {
            Some("none") | None if sequential => continue,
            Some("none") | None => Bootstrap::Port(8998),
            Some(url) if url.starts_with("http") => Bootstrap::Url(url.to_owned()),
            // An unparsable port is pd-proxy's to refuse; 0 is never listened on, so it is
            // reported.
            Some(number) => Bootstrap::Port(number.parse().unwrap_or(0)),
        };
        found.push((url.clone(), bootstrap));
    }
    found
}

/// The Service a URL's host names (`NAME.NAMESPACE.svc.cluster.local`), if it is one.
fn service_of_url<'a>(docs: &'a [Value], url: &str) -> Option<&'a Value> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let host = rest.split([':', '/']).next()?;
    let (name, namespace) = host.strip_suffix(".svc.cluster.local")?.split_once('.')?;
    of_kind(docs, "Service").find(|s| {
        str_at(s, "/metadata/name") == name && str_at(s, "/metadata/namespace") == namespace
    })
}

/// Whether a container runs bootstrap-server reachable from other pods on `port` (an address
/// of every interface, the port declared) and keeps running beside the pod's other containers
/// (a container, or an init container with `restartPolicy: Always`, a native sidecar).
fn listens_for_bootstrap(pod: &Pod, container: &Value, port: u16) -> bool {
    let argv = argv(container);
    let Some(("bootstrap-server", args)) = split_binary(&argv) else {
        return false;
    };
    let listens_on = flag_value(&args, "--port").unwrap_or("8998");
    let host = flag_value(&args, "--host").unwrap_or("0.0.0.0");
    let every_interface = ["0.0.0.0", "::", "[::]"].contains(&host);
    let init = array_at(pod.template, "/spec/initContainers")
        .iter()
        .any(|c| c == container);
    let stays = !init || container["restartPolicy"] == "Always";
    listens_on == port.to_string()
        && every_interface
        && declares(container, &Value::from(port))
        && stays
}

/// Where a pod's engines register, if they name it: vLLM's `bootstrap_server_address` in the
/// KV connector's config (the `KV_TRANSFER_CONFIG` engine-start.sh passes), SGLang's
/// `--disaggregation-bootstrap-port`. (container, host or "", port text).
fn engine_registrations<'a>(pod: &Pod<'a>) -> Vec<(&'a str, String, String)> {
    let mut found = Vec::new();
    for container in pod.containers() {
        let name = str_at(container, "/name");
        for var in array_at(container, "/env") {
            let value = str_at(var, "/value");
            if str_at(var, "/name") != "KV_TRANSFER_CONFIG" || value.is_empty() {
                continue;
            }
            let config: Value =
                serde_json::from_str(&value.replace("%s", "engine")).unwrap_or(Value::Null);
            let address = str_at(
                &config,
                "/kv_connector_extra_config/bootstrap_server_address",
            );
            if config.is_null() {
                let unread = format!("(unreadable KV_TRANSFER_CONFIG {value})");
                found.push((name, unread, String::new()));
            } else if let Some((host, port)) = address.rsplit_once(':') {
                found.push((name, host.to_owned(), port.to_owned()));
            } else if !address.is_empty() {
                found.push((name, address.to_owned(), String::new()));
            }
        }
        if let Some(port) = flag_value(&argv(container), "--disaggregation-bootstrap-port") {
            found.push((name, String::new(), port.to_owned()));
        }
    }
    found
}

impl std::fmt::Display for Bootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bootstrap::Port(port) => write!(f, "{port}"),
            Bootstrap::Url(url) => f.write_str(url),
        }
    }
}

/// The pods behind the Service a URL names (in its namespace), or why there are none.
fn pods_behind<'p, 'a>(
    docs: &[Value],
    pods: &'p [Pod<'a>],
    url: &str,
) -> Result<Vec<&'p Pod<'a>>, String> {
    let Some(service) = service_of_url(docs, url) else {
        return Err(format!("no Service of the manifests behind {url}"));
    };
    let namespace = str_at(service, "/metadata/namespace");
    let behind: Vec<&Pod> = pods
        .iter()
        .filter(|p| p.selected_by(&service["spec"]["selector"]))
        .filter(|p| str_at(p.workload, "/metadata/namespace") == namespace)
        .collect();
    if behind.is_empty() {
        return Err(format!("{} selects no pod", id(service)));
    }
    Ok(behind)
}

/// The port a URL's Service sends its port to in `pod` (its `targetPort`, by number or by the
/// name of a port the pod declares).
fn target_port(docs: &[Value], pod: &Pod, url: &str) -> Option<u16> {
    let service = service_of_url(docs, url)?;
    let port: u64 = url.rsplit(':').next()?.trim_end_matches('/').parse().ok()?;
    let entry = array_at(service, "/spec/ports")
        .iter()
        .find(|p| p["port"] == port)?;
    match target(entry) {
        Value::Number(number) => number.as_u64().and_then(|n| u16::try_from(n).ok()),
        Value::String(name) => pod.containers().find_map(|c| {
            let declared = array_at(c, "/ports").iter().find(|p| p["name"] == *name)?;
            declared["containerPort"]
                .as_u64()
                .and_then(|n| u16::try_from(n).ok())
        }),
        _ => None,
    }
}

/// The bootstrap server each pd-proxy gives its prefills is there, and their engines register
/// with it. A port: the proxy tells D that a prefill's bootstrap server is at
/// `http://<the prefill's address>:PORT` and learns its dp ranks and engine ids there, so each
/// pod behind the prefills must run bootstrap-server on PORT for other pods to reach, and its
/// engine must register there (vLLM's `bootstrap_server_address` on the pod's own loopback,
/// SGLang's bootstrap port). A URL: the pods behind that URL's Service run bootstrap-server on
/// the port it targets, and the engines behind the prefills register at exactly that host and
/// port. Returns how many pods were checked, and what is wrong.
pub fn prefill_bootstraps(docs: &[Value]) -> (usize, Vec<String>) {
    let pods = pods(docs);
    let mut checked = 0;
    let mut problems = Vec::new();
    let proxies = pods.iter().flat_map(|p| p.containers()).filter_map(|c| {
        let argv = argv(c);
        split_binary(&argv).and_then(|(binary, args)| (binary == "pd-proxy").then_some(args))
    });
    for args in proxies.collect::<Vec<_>>() {
        for (url, bootstrap) in proxy_prefills(&args) {
            let said = format!("pd-proxy --prefill {url} {bootstrap}");
            let mut problem = |text: String| problems.push(format!("{said}: {text}"));
            let behind = match pods_behind(docs, &pods, &url) {
                Ok(behind) => behind,
                Err(why) => {
                    problem(why);
                    continue;
                }
            };
            // Who serves the bootstrap server, and where the prefills' engines must register:
            // `None`, on their own pod, at the port.
            let (servers, registry) = match &bootstrap {
                Bootstrap::Port(_) => (behind.clone(), None),
                Bootstrap::Url(url) => match pods_behind(docs, &pods, url) {
                    Ok(servers) => {
                        let rest = url.split_once("://").map_or("", |(_, rest)| rest);
                        (servers, Some(rest.trim_end_matches('/').to_owned()))
                    }
                    Err(why) => {
                        problem(why);
                        continue;
                    }
                },
            };
            for pod in servers {
                checked += 1;
                let port = match &bootstrap {
                    Bootstrap::Port(port) => Some(*port),
                    Bootstrap::Url(url) => target_port(docs, pod, url),
                };
                let port = port.unwrap_or(0);
                if !pod
                    .containers()
                    .any(|c| listens_for_bootstrap(pod, c, port))
                {
                    problem(format!(
                        "no container of {} runs bootstrap-server on 0.0.0.0:{port} \
                         (declared, and running beside the engine)",
                        pod.at
                    ));
                }
            }
            let local = |host: &str, at: &str| {
                ["", "127.0.0.1", "localhost"].contains(&host) && at == bootstrap.to_string()
            };
            for pod in behind {
                checked += 1;
                let registrations = engine_registrations(pod);
                if registrations.is_empty() {
                    problem(format!(
                        "{} names no bootstrap server to register at",
                        pod.at
                    ));
                }
                for (container, host, at) in registrations {
                    let right = match &registry {
                        Some(registry) => format!("{host}:{at}") == *registry,
                        None => local(&host, &at),
                    };
                    if !right {
                        let wanted = registry
                            .as_deref()
                            .unwrap_or("its own pod's bootstrap-server");
                        problem(format!(
                            "{} container {container} registers at {host}:{at}, not at {wanted}",
                            pod.at
                        ));
                    }
                }
            }
        }
    }
    (checked, problems)
}
