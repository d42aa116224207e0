//! The headings the front doors' flags are grouped under in `--help`, each also a section of
//! the `--config` file: `[listen]`, `[backends]`, `[routing]`, `[overload]`, `[limits]`,
//! `[planner]`, `[observability]`, `[admin]`. A flag's heading says which section it goes in.

/// Where the front door listens, and its TLS.
pub const LISTEN: &str = "Listen and TLS";
/// The engines and their registries: where they are, how they are found, checked and called.
pub const BACKENDS: &str = "Backends and discovery";
/// How a request's engines are chosen: policies, KV events, models.
pub const ROUTING: &str = "Routing";
/// When engines are saturated: admission, priorities, the retry budget.
pub const OVERLOAD: &str = "Overload";
/// The capacity planner: latency targets and the pace of its decisions.
pub const PLANNER: &str = "Capacity planner";
/// Time limits and what a client may cost.
pub const LIMITS: &str = "Timeouts and limits";
/// Logs.
pub const OBSERVABILITY: &str = "Observability";
/// Keys, tenants and the operator's routes.
pub const ADMIN: &str = "Admin and keys";

/// Every heading and its section of the config file, in `--help`'s order.
pub const SECTIONS: [(&str, &str); 8] = [
    (LISTEN, "listen"),
    (BACKENDS, "backends"),
    (ROUTING, "routing"),
    (OVERLOAD, "overload"),
    (PLANNER, "planner"),
    (LIMITS, "limits"),
    (OBSERVABILITY, "observability"),
    (ADMIN, "admin"),
];

/// The config file's section of the flags under `heading`.
pub fn section_of(heading: &str) -> Option<&'static str> {
    SECTIONS
        .iter()
        .find(|(name, _)| *name == heading)
        .map(|(_, section)| *section)
}

/// The flags of `command` under no section's heading (by id): what a front door's test keeps
/// empty, so that every flag has its place in `--help` and in the config file. `--help`,
/// `--version`, `--config` and hidden flags are left out.
pub fn without_section(command: &clap::Command) -> Vec<String> {
    (command.get_arguments())
        .filter(|arg| !["help", "version", "config"].contains(&arg.get_id().as_str()))
        .filter(|arg| !arg.is_hide_set())
        .filter(|arg| arg.get_help_heading().and_then(section_of).is_none())
        .map(|arg| arg.get_id().to_string())
        .collect()
}

/// The heading of the config file's `section`.
pub fn heading_of(section: &str) -> Option<&'static str> {
    SECTIONS
        .iter()
        .find(|(_, name)| *name == section)
        .map(|(heading, _)| *heading)
}
