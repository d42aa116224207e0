//! Reading rendered manifests: objects by kind, pod templates and their containers, label
//! selectors, and the command lines of this project's binaries (in containers and in the
//! shell scripts of ConfigMaps).

use serde_json::Value;

/// This project's binaries, as the manifests run them.
pub const BINARIES: &[&str] = &["bootstrap-server", "pd-epp", "pd-proxy", "worker-client"];

/// `kind/name`, for messages.
pub fn id(doc: &Value) -> String {
    format!("{}/{}", str_at(doc, "/kind"), str_at(doc, "/metadata/name"))
}

/// The string at a JSON pointer, or "".
pub fn str_at<'a>(value: &'a Value, pointer: &str) -> &'a str {
    value.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

/// The array at a JSON pointer, or an empty one.
pub fn array_at<'a>(value: &'a Value, pointer: &str) -> &'a [Value] {
    value
        .pointer(pointer)
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

/// The documents of a kind.
pub fn of_kind<'a>(docs: &'a [Value], kind: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    docs.iter().filter(move |d| d["kind"] == kind)
}

/// A pod template: its workload's `kind/name`, the workload and the template.
pub struct Pod<'a> {
    pub at: String,
    pub workload: &'a Value,
    pub template: &'a Value,
}

impl<'a> Pod<'a> {
    /// Its init containers (native sidecars among them) and containers.
    pub fn containers(&self) -> impl Iterator<Item = &'a Value> {
        let spec = &self.template["spec"];
        array_at(spec, "/initContainers")
            .iter()
            .chain(array_at(spec, "/containers"))
    }

    /// Whether a Service or budget selecting `selector` (matchLabels or a plain map) takes it.
    pub fn selected_by(&self, selector: &Value) -> bool {
        let wanted = selector.get("matchLabels").unwrap_or(selector).as_object();
        let labels = &self.template["metadata"]["labels"];
        wanted.is_some_and(|w| !w.is_empty() && w.iter().all(|(k, v)| &labels[k] == v))
    }
}

/// Every pod template of the workloads.
pub fn pods(docs: &[Value]) -> Vec<Pod<'_>> {
    docs.iter()
        .filter(|d| ["Deployment", "StatefulSet", "DaemonSet", "Job"].contains(&str_at(d, "/kind")))
        .map(|d| Pod {
            at: id(d),
            workload: d,
            template: &d["spec"]["template"],
        })
        .collect()
}

/// A container's `command` and `args`, as the kubelet runs them.
pub fn argv(container: &Value) -> Vec<String> {
    array_at(container, "/command")
        .iter()
        .chain(array_at(container, "/args"))
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect()
}

/// The HTTP probes of a container: (which, path, port).
pub fn probes(container: &Value) -> Vec<(&'static str, &str, &Value)> {
    ["livenessProbe", "readinessProbe", "startupProbe"]
        .into_iter()
        .filter_map(|which| {
            let get = container.get(which)?.get("httpGet")?;
            Some((which, get["path"].as_str()?, &get["port"]))
        })
        .collect()
}

/// One run of this project's binaries found in the manifests.
pub struct Invocation {
    /// Where: the container or script.
    pub at: String,
    /// Which binary.
    pub binary: &'static str,
    /// Its arguments.
    pub args: Vec<String>,
    /// The environment variables its container sets (none for a script's).
    pub env: Vec<String>,
}

/// Every run of this project's binaries: container commands, and the lines of the shell scripts
/// that ConfigMaps hold (the engines' preStop drain).
pub fn invocations(docs: &[Value]) -> Vec<Invocation> {
    let mut found = Vec::new();
    for pod in pods(docs) {
        for container in pod.containers() {
            let argv = argv(container);
            if let Some((binary, args)) = split_binary(&argv) {
                found.push(Invocation {
                    at: format!("{} container {}", pod.at, str_at(container, "/name")),
                    binary,
                    args,
                    env: array_at(container, "/env")
                        .iter()
                        .map(|e| str_at(e, "/name").to_owned())
                        .collect(),
                });
            }
        }
    }
    for map in of_kind(docs, "ConfigMap") {
        let data = map["data"].as_object().into_iter().flatten();
        for (key, script) in data.filter(|(key, _)| key.ends_with(".sh")) {
            for line in shell_commands(script.as_str().unwrap_or("")) {
                if let Some((binary, args)) = split_binary(&line) {
                    let at = format!("{} {key}", id(map));
                    let env = Vec::new();
                    found.push(Invocation {
                        at,
                        binary,
                        args,
                        env,
                    });
                }
            }
        }
    }
    found
}

/// The binary a command line runs (after an `exec`), and its arguments.
pub fn split_binary(argv: &[String]) -> Option<(&'static str, Vec<String>)> {
    let start = usize::from(argv.first().is_some_and(|a| a == "exec"));
    let program = argv.get(start)?.rsplit('/').next()?;
    let binary = BINARIES.iter().find(|b| **b == program)?;
    Some((binary, argv[start + 1..].to_vec()))
}

/// The simple commands of a shell script, as words: lines continued with `\` joined, comments
/// dropped, split at `;`, `&&`, `||` and `|`, quotes removed (enough for the scripts here).
fn shell_commands(script: &str) -> Vec<Vec<String>> {
    let joined = script.replace("\\\n", " ");
    let mut commands = Vec::new();
    for line in joined.lines() {
        let mut words = Vec::new();
        for word in line.split_whitespace() {
            if word.starts_with('#') {
                break;
            }
            if [";", "&&", "||", "|"].contains(&word) {
                commands.push(std::mem::take(&mut words));
                continue;
            }
            let word = word.trim_end_matches(';').replace(['"', '\''], "");
            words.push(word);
        }
        commands.push(words);
    }
    commands.retain(|c| !c.is_empty());
    commands
}
