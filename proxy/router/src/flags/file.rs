//! `--config FILE`: a TOML file holding any flag under its long name (a deployment's long
//! command line in one place), plus what flags cannot say: model aliases, per-model policies,
//! the LoRA adapters the proxy may load, and the objectives' priorities. A flag given on the command line or in the
//! environment wins over the file. The file is checked whole at start; every error names its
//! line.
//!
//! ```toml
//! policy = "cache_aware"
//! decode = ["http://10.0.0.7:8000", "http://10.0.0.8:8000"]
//! prefill = ["http://10.0.0.5:8000 8998", "http://10.0.0.6:8000 8998"]
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
        };
        for (key, value) in &top {
            if SECTIONS.contains(&key.get_ref().as_str()) {
                continue;
            }
            let long = key.get_ref().replace('_', "-");
            let line_of = |message: String| at(key.span().start, message);
            let arg = command
                .get_arguments()
                .find(|arg| arg.get_long() == Some(long.as_str()) && long != "config")
                .ok_or_else(|| line_of(format!("`{long}` is not a {} flag", command.get_name())))?;
            file.lines
                .insert(long.clone(), at(key.span().start, String::new()).line);
            let id = arg.get_id().as_str();
            if matches!(
                given.value_source(id),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            ) {
                continue;
            }
            let takes_values = arg.get_action().takes_values();
            let flag = OsString::from(format!("--{long}"));
            let items: Vec<&toml::Value> = match value.get_ref() {
                toml::Value::Array(items) => items.iter().collect(),
                single => vec![single],
            };
            for item in items {
                match item {
                    toml::Value::Boolean(false) if !takes_values => {}
                    toml::Value::Boolean(true) if !takes_values => file.words.push(flag.clone()),
                    toml::Value::String(text) if long == "prefill" => {
                        file.words.push(flag.clone());
                        file.words
                            .extend(text.split_whitespace().map(OsString::from));
                    }
                    toml::Value::String(text) => {
                        file.words.push(flag.clone());
                        file.words.push(text.into());
                    }
                    toml::Value::Integer(_) | toml::Value::Float(_) | toml::Value::Boolean(_)
                        if takes_values =>
                    {
                        let text = match item {
                            toml::Value::Integer(n) => n.to_string(),
                            toml::Value::Float(x) => x.to_string(),
                            _ => item.as_bool().unwrap_or_default().to_string(),
                        };
                        file.words.push(flag.clone());
                        file.words.push(text.into());
                    }
                    other => {
                        return Err(line_of(format!(
                            "`{long}` takes {}, not {}",
                            if takes_values {
                                "a value"
                            } else {
                                "true or false"
                            },
                            other.type_str()
                        )))
                    }
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
