//! The effective configuration as text (`check-config`): a TOML file in the sections of the
//! flags' headings, each flag's value with where it came from, a secret as a comment saying it
//! is set (never its value), then the models' tables. Read back with `--config` (the secrets
//! given again by their variables), it starts the same front door.

use std::fmt::Write;

use clap::parser::ValueSource;
use clap::{Arg, Command};

use super::headings::SECTIONS;
use super::parse::Parsed;
use super::FileModels;

/// Flags that are not configuration.
const SKIPPED: [&str; 3] = ["help", "version", "config"];

/// The text of `parsed`'s configuration of `command`.
pub(super) fn render(command: &Command, parsed: &Parsed) -> String {
    let mut out = format!(
        "# The effective configuration of {}: every flag, where its value came from.\n",
        command.get_name()
    );
    for (heading, section) in SECTIONS {
        let args: Vec<&Arg> = (command.get_arguments())
            .filter(|arg| arg.get_help_heading() == Some(heading))
            .filter(|arg| !SKIPPED.contains(&arg.get_id().as_str()))
            .collect();
        if args.is_empty() {
            continue;
        }
        let _ = write!(out, "\n[{section}]\n");
        for arg in args {
            if let Some(line) = line(arg, parsed) {
                out.push_str(&line);
            }
        }
    }
    tables(&mut out, &parsed.models);
    out
}

/// `long = value  # source`, or nothing for a flag that is not set.
fn line(arg: &Arg, parsed: &Parsed) -> Option<String> {
    let id = arg.get_id().as_str();
    let long = arg.get_long()?;
    let source = match parsed.matches.value_source(id)? {
        _ if parsed.from_file.contains(id) => "file".to_owned(),
        ValueSource::EnvVariable => {
            let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
            format!("env {}", env.unwrap_or_default())
        }
        ValueSource::CommandLine => "command line".to_owned(),
        _ => "default".to_owned(),
    };
    let groups: Vec<String> = (parsed.matches.get_raw_occurrences(id)?)
        .map(|values| {
            let words: Vec<String> = values.map(|v| v.to_string_lossy().into_owned()).collect();
            words.join(" ")
        })
        .collect();
    if arg.is_hide_env_values_set() {
        return Some(format!("# {long} = <a secret, not shown>  # {source}\n"));
    }
    let value = if !arg.get_action().takes_values() {
        groups.last().map_or("false", |v| v.as_str()).to_owned()
    } else if matches!(arg.get_action(), clap::ArgAction::Append) || groups.len() > 1 {
        let items: Vec<String> = groups.iter().map(|v| scalar(v)).collect();
        format!("[{}]", items.join(", "))
    } else {
        scalar(groups.first()?)
    };
    Some(format!("{long} = {value}  # {source}\n"))
}

/// A value as TOML: a number as is, anything else quoted.
fn scalar(text: &str) -> String {
    let numeric = text.parse::<i64>().is_ok()
        || (text.parse::<f64>().is_ok_and(f64::is_finite) && text.contains('.'));
    match numeric {
        true => text.to_owned(),
        false => quoted(text),
    }
}

fn quoted(text: &str) -> String {
    format!("\"{}\"", text.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The models' tables of the file.
fn tables(out: &mut String, models: &FileModels) {
    if !models.aliases.is_empty() {
        out.push_str("\n[aliases]\n");
        for (alias, model) in &models.aliases {
            let _ = writeln!(out, "{} = {}", quoted(alias), quoted(model));
        }
    }
    for (model, (prefill, decode)) in &models.policies {
        let _ = write!(out, "\n[models.{}]\n", quoted(model));
        let name = |policy: &super::Policy| quoted(&policy.name());
        if let Some(policy) = prefill {
            let _ = writeln!(out, "prefill-policy = {}", name(policy));
        }
        if let Some(policy) = decode {
            let _ = writeln!(out, "decode-policy = {}", name(policy));
        }
    }
    for (adapter, source) in &models.adapters {
        let _ = write!(out, "\n[adapters.{}]\n", quoted(adapter));
        let _ = writeln!(
            out,
            "base = {}\npath = {}",
            quoted(&source.base),
            quoted(&source.path)
        );
    }
    if !models.objectives.is_empty() {
        out.push_str("\n[objectives]\n");
        for (objective, priority) in &models.objectives {
            let _ = writeln!(out, "{} = {priority}", quoted(objective));
        }
    }
}
