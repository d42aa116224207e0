//! `--config FILE`: a TOML file holding any flag under its long name, in the section of its
//! `--help` heading ([`super::headings`]: a deployment's long command line in one place), plus
//! what flags cannot say: model aliases, per-model policies, the LoRA adapters the proxy may
//! load, and the objectives' priorities. A flag given on the command line or in the
//! environment wins over the file. The file is checked whole at start; every error names its
//! line. Flags at the top level (the older, flat form) are still read, with a note saying
//! which section each belongs in.
//!
//! ```toml
//! [backends]
//! decode = ["http://10.0.0.7:8000", "http://10.0.0.8:8000"]
//! prefill = ["http://10.0.0.5:8000 8998", "http://10.0.0.6:8000 8998"]
//!
//! [routing]
//! policy = "cache_aware"
//! lora-load-on-demand = true
//!
//! [aliases]
//! "gpt-4o-mini" = "meta-llama/Llama-3.1-8B-Instruct"
//!
//! [models."meta-llama/Llama-3.1-8B-Instruct"]
//! prefill-policy = "precise_prefix"   # or `policy` for both choices
//! decode-policy = "least_loaded"
//!
//! [adapters.sql-lora]
//! base = "meta-llama/Llama-3.1-8B-Instruct"
//! path = "/adapters/sql-lora"
//!
//! [objectives]            # x-gateway-inference-objective -> priority (negative: sheddable)
//! interactive = 1
//! batch = -1
//! ```

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::Path;

use clap::parser::ValueSource;
use clap::{ArgMatches, Command, ValueEnum};
use serde::Deserialize;
use toml::Spanned;

use super::headings;
use crate::models::settings::{AdapterSource, ModelPolicies, ModelsConfig};
use crate::routing::settings::Policy;

/// The tables of the file that are not flags.
const SECTIONS: [&str; 4] = ["aliases", "models", "adapters", "objectives"];

/// A mistake in the file, with where it is.
#[derive(Debug, thiserror::Error)]
#[error("{path}:{line}: {message}")]
pub struct FileError {
    /// The file.
    pub path: String,
    /// The line (from 1).
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

/// What the file says beside flags.
#[derive(Debug, Clone, Default)]
pub struct FileModels {
    /// Alias -> model.
    pub aliases: BTreeMap<String, String>,
    /// Model -> (prefill policy, decode policy), each when set.
    pub policies: BTreeMap<String, (Option<Policy>, Option<Policy>)>,
    /// The adapters the proxy may load.
    pub adapters: BTreeMap<String, AdapterSource>,
    /// Objective name -> priority (the admission's).
    pub objectives: BTreeMap<String, i32>,
}

#[derive(Deserialize)]
struct Sections {
    #[serde(default)]
    aliases: BTreeMap<String, Spanned<String>>,
    #[serde(default)]
    models: BTreeMap<String, Spanned<ModelSection>>,
    #[serde(default)]
    adapters: BTreeMap<String, Spanned<AdapterSection>>,
    #[serde(default)]
    objectives: BTreeMap<String, i32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct ModelSection {
    policy: Option<Spanned<String>>,
    prefill_policy: Option<Spanned<String>>,
    decode_policy: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AdapterSection {
    base: String,
    path: String,
}

/// A read file: the flags it sets (as command-line words) and its models' tables.
pub struct ConfigFile {
    /// `--flag value` words for the flags the file sets and `given` did not.
    pub words: Vec<OsString>,
    /// Which line set which flag (by long name), to place clap's errors.
    pub lines: BTreeMap<String, usize>,
    /// The models' tables.
    pub models: FileModels,
    /// The flags the file sets at its top level, the older flat form, each with the section
    /// it belongs in (for a deprecation note).
    pub flat: Vec<String>,
}

impl ConfigFile {
    /// Reads `path` for `command`'s flags; `given` are the matches of the command line alone.
    pub fn read(path: &Path, command: &Command, given: &ArgMatches) -> Result<Self, FileError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|err| FileError {
            path: name.clone(),
            line: 0,
            message: format!("cannot read it: {err}"),
        })?;
        Self::parse(&name, &text, command, given)
    }

    /// Parses `text` (the file `name`).
    pub fn parse(
        name: &str,
        text: &str,
        command: &Command,
        given: &ArgMatches,
    ) -> Result<Self, FileError> {
        let at = |offset: usize, message: String| FileError {
            path: name.to_owned(),
            line: text[..offset.min(text.len())].matches('\n').count() + 1,
            message,
        };
        let toml_error = |err: toml::de::Error| {
            let offset = err.span().map_or(0, |span| span.start);
            at(offset, err.message().to_owned())
        };
        let top: BTreeMap<Spanned<String>, Spanned<toml::Value>> =
            toml::from_str(text).map_err(toml_error)?;
        let sections: Sections = toml::from_str(text).map_err(toml_error)?;
        let mut file = ConfigFile {
            words: Vec::new(),
            lines: BTreeMap::new(),
            models: FileModels::default(),
            flat: Vec::new(),
        };
        for (key, value) in &top {
            let name = key.get_ref().as_str();
            if SECTIONS.contains(&name) {
                continue;
            }
            let start = key.span().start;
            match (headings::heading_of(name), value.get_ref()) {
                (Some(heading), toml::Value::Table(table)) => {
                    for (inner, value) in table {
                        // The inner key's own line: the first line under the section naming it.
                        let offset = line_of_key(text, start, inner);
                        let flag = Flag::find(command, inner, &at, offset)?;
                        if flag.heading != Some(heading) {
                            let right = flag.heading.and_then(headings::section_of);
                            let message = match right {
                                Some(right) => {
                                    format!("`{}` belongs in [{right}], not [{name}]", flag.long)
                                }
                                None => {
                                    format!("`{}` belongs at the top, not in [{name}]", flag.long)
                                }
                            };
                            return Err(at(offset, message));
                        }
                        file.take(&flag, value, given, at(offset, String::new()).line)
                            .map_err(|message| at(offset, message))?;
                    }
                }
                _ => {
                    let flag = Flag::find(command, name, &at, start)?;
                    if let Some(section) = flag.heading.and_then(headings::section_of) {
                        file.flat.push(format!("`{}` under [{section}]", flag.long));
                    }
                    file.take(&flag, value.get_ref(), given, at(start, String::new()).line)
                        .map_err(|message| at(start, message))?;
                }
            }
        }
        for (alias, target) in sections.aliases {
            file.models.aliases.insert(alias, target.into_inner());
        }
        for (alias, target) in &file.models.aliases {
            if file.models.aliases.contains_key(target) {
                let key = top.keys().find(|k| k.get_ref() == "aliases");
                return Err(at(
                    key.map_or(0, |k| k.span().start),
                    format!("alias `{alias}` names `{target}`, itself an alias"),
                ));
            }
        }
        for (model, section) in sections.models {
            let span = section.span();
            let section = section.into_inner();
            let policy = |value: Option<Spanned<String>>| -> Result<Option<Policy>, FileError> {
                let Some(value) = value else { return Ok(None) };
                Policy::from_str(value.get_ref(), true)
                    .map(Some)
                    .map_err(|_| {
                        at(
                            value.span().start,
                            format!("`{}` is not a policy", value.get_ref()),
                        )
                    })
            };
            let both = policy(section.policy)?;
            let prefill = policy(section.prefill_policy)?.or(both);
            let decode = policy(section.decode_policy)?.or(both);
            if prefill.is_none() && decode.is_none() {
                return Err(at(span.start, format!("model `{model}` sets no policy")));
            }
            file.models.policies.insert(model, (prefill, decode));
        }
        for (name, section) in sections.adapters {
            let AdapterSection { base, path } = section.into_inner();
            file.models
                .adapters
                .insert(name, AdapterSource { base, path });
        }
        file.models.objectives = sections.objectives;
        Ok(file)
    }
}

/// A flag of the command, as the file names it.
struct Flag {
    long: String,
    id: String,
    takes_values: bool,
    heading: Option<&'static str>,
}

impl Flag {
    /// The flag the file's `key` names (`_` read as `-`), or an error at `offset`.
    fn find(
        command: &Command,
        key: &str,
        at: &impl Fn(usize, String) -> FileError,
        offset: usize,
    ) -> Result<Flag, FileError> {
        let named = key.replace('_', "-");
        let names = |arg: &clap::Arg| {
            let aliases = arg.get_all_aliases().unwrap_or_default();
            arg.get_long() == Some(named.as_str()) || aliases.contains(&named.as_str())
        };
        let arg = (command.get_arguments())
            .find(|arg| names(arg) && named != "config" && !arg.is_hide_set())
            .ok_or_else(|| {
                at(
                    offset,
                    format!("`{named}` is not a {} flag", command.get_name()),
                )
            })?;
        // Its own name, whatever alias the file used.
        let long = arg.get_long().unwrap_or(&named).to_owned();
        let heading = (arg.get_help_heading())
            .and_then(|h| headings::SECTIONS.iter().find(|(name, _)| *name == h))
            .map(|(name, _)| *name);
        Ok(Flag {
            id: arg.get_id().as_str().to_owned(),
            takes_values: arg.get_action().takes_values(),
            heading,
            long,
        })
    }
}

impl ConfigFile {
    /// Takes `value` as the file's setting of `flag` (on `line`), unless the command line or
    /// the environment set it.
    fn take(
        &mut self,
        flag: &Flag,
        value: &toml::Value,
        given: &ArgMatches,
        line: usize,
    ) -> Result<(), String> {
        let long = &flag.long;
        self.lines.insert(long.clone(), line);
        if matches!(
            given.value_source(&flag.id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            return Ok(());
        }
        let word = OsString::from(format!("--{long}"));
        let items: Vec<&toml::Value> = match value {
            toml::Value::Array(items) => items.iter().collect(),
            single => vec![single],
        };
        for item in items {
            match item {
                toml::Value::Boolean(false) if !flag.takes_values => {}
                toml::Value::Boolean(true) if !flag.takes_values => self.words.push(word.clone()),
                toml::Value::String(text) if long == "prefill" => {
                    self.words.push(word.clone());
                    self.words
                        .extend(text.split_whitespace().map(OsString::from));
                }
                toml::Value::String(text) => {
                    self.words.push(word.clone());
                    self.words.push(text.into());
                }
                toml::Value::Integer(_) | toml::Value::Float(_) | toml::Value::Boolean(_)
                    if flag.takes_values =>
                {
                    let text = match item {
                        toml::Value::Integer(n) => n.to_string(),
                        toml::Value::Float(x) => x.to_string(),
                        _ => item.as_bool().unwrap_or_default().to_string(),
                    };
                    self.words.push(word.clone());
                    self.words.push(text.into());
                }
                other => {
                    let takes = match flag.takes_values {
                        true => "a value",
                        false => "true or false",
                    };
                    return Err(format!("`{long}` takes {takes}, not {}", other.type_str()));
                }
            }
        }
        Ok(())
    }
}

/// The offset of the first line after `from` that sets `key` (`key =`, `"key" =`), else `from`.
fn line_of_key(text: &str, from: usize, key: &str) -> usize {
    let rest = &text[from.min(text.len())..];
    let mut offset = from;
    for line in rest.split_inclusive('\n') {
        let trimmed = line.trim_start().trim_start_matches('"');
        if trimmed.starts_with(key)
            && trimmed[key.len()..]
                .trim_start()
                .trim_start_matches('"')
                .trim_start()
                .starts_with('=')
        {
            return offset;
        }
        offset += line.len();
    }
    from
}

impl FileModels {
    /// The models' configuration: these tables, the flags' policies for what they leave out.
    pub fn config(
        self,
        prefill: Policy,
        decode: Policy,
        load_on_demand: bool,
        load_timeout: std::time::Duration,
    ) -> ModelsConfig {
        ModelsConfig {
            aliases: self.aliases.into_iter().collect(),
            policies: (self.policies.into_iter())
                .map(|(model, (p, d))| {
                    let policies = ModelPolicies {
                        prefill: p.unwrap_or(prefill),
                        decode: d.unwrap_or(decode),
                    };
                    (model, policies)
                })
                .collect(),
            adapters: self.adapters.into_iter().collect(),
            load_on_demand,
            load_timeout,
        }
    }
}
