//! Reading a front door's command line with its `--config` file: [`parse_args`] for a start,
//! [`check_args`] for `check-config` (the same, and the effective configuration as text).

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{ArgMatches, Command, FromArgMatches};

use super::{effective, ConfigFile, FileModels, FleetArgs};

/// The matches of a command line with its file, and what the file said beside flags.
pub(super) struct Parsed {
    /// Every flag's value, the command line's and the environment's winning over the file's.
    pub matches: ArgMatches,
    /// The file's models' tables.
    pub models: FileModels,
    /// The flags (by id) the file set and neither the command line nor the environment did.
    pub from_file: BTreeSet<String>,
}

/// Matches `argv` and its `--config` file (if any) against the command `make` makes.
fn parse_matches(argv: &[OsString], make: &impl Fn() -> Command) -> Result<Parsed, clap::Error> {
    let mut command = make();
    let given = command.try_get_matches_from_mut(argv)?;
    let Some(path) = given.get_one::<PathBuf>("config").cloned() else {
        return Ok(Parsed {
            matches: given,
            models: FileModels::default(),
            from_file: BTreeSet::new(),
        });
    };
    let invalid = |message: String| make().error(clap::error::ErrorKind::InvalidValue, message);
    let file = ConfigFile::read(&path, &command, &given).map_err(|err| invalid(err.to_string()))?;
    let (program, rest) = argv.split_first().expect("argv holds the program");
    let combined = std::iter::once(program.clone())
        .chain(file.words)
        .chain(rest.iter().cloned());
    let matches = make().try_get_matches_from(combined).map_err(|err| {
        let flag = err.get(clap::error::ContextKind::InvalidArg).map(|arg| {
            let text = arg.to_string();
            let long = text.trim_start_matches("--");
            long.split([' ', '=']).next().unwrap_or("").to_owned()
        });
        match flag.and_then(|flag| file.lines.get(&flag)) {
            Some(line) => invalid(format!("{}:{line}: {err}", path.display())),
            None => err,
        }
    })?;
    if !file.flat.is_empty() {
        let name = make().get_name().to_owned();
        eprintln!(
            "{name}: note: {}: flags at the top level are read but deprecated; put {} \
             (`{name} check-config {}` prints the file in sections)",
            path.display(),
            file.flat.join(", "),
            path.display()
        );
    }
    let by_file = |id: &str| {
        let long = command
            .get_arguments()
            .find(|a| a.get_id() == id)?
            .get_long()?;
        file.lines.contains_key(long).then_some(())
    };
    let from_file = (matches.ids())
        .map(|id| id.as_str())
        .filter(|id| {
            !matches!(
                given.value_source(id),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            ) && by_file(id).is_some()
        })
        .map(str::to_owned)
        .collect();
    Ok(Parsed {
        matches,
        models: file.models,
        from_file,
    })
}

/// `A` from its matches, the fleet's file tables and `--prefill` groups filled in.
fn args_of<A: FromArgMatches>(
    parsed: &Parsed,
    fleet: impl FnOnce(&mut A) -> &mut FleetArgs,
) -> Result<A, clap::Error> {
    let mut args = A::from_arg_matches(&parsed.matches)?;
    let fleet = fleet(&mut args);
    fleet.file_models = parsed.models.clone();
    let groups = |name: &str| {
        (parsed.matches.get_occurrences::<String>(name))
            .map(|occurrences| {
                occurrences
                    .map(|values| values.cloned().collect())
                    .collect()
            })
            .unwrap_or_default()
    };
    fleet.prefill_groups = groups("prefill");
    fleet.dual_groups = groups("dual");
    Ok(args)
}

/// Parses a front door's command line `argv` into `A` (with the flags of its `--config` file,
/// the command line's winning), keeping each `--prefill` occurrence's one or two values
/// together (clap's derive flattens them); `command` makes `A`'s command (`A::command`, or it
/// adjusted), `fleet` finds `A`'s [`FleetArgs`].
pub fn parse_args<A, I, T>(
    argv: I,
    command: impl Fn() -> Command,
    fleet: impl FnOnce(&mut A) -> &mut FleetArgs,
) -> Result<A, clap::Error>
where
    A: FromArgMatches,
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
    args_of(&parse_matches(&argv, &command)?, fleet)
}

/// [`parse_args`], and the effective configuration as a sectioned TOML file: every flag's
/// value and where it came from (the file, the environment, the command line, the default),
/// secrets masked (what `check-config` prints).
pub fn check_args<A, I, T>(
    argv: I,
    command: impl Fn() -> Command,
    fleet: impl FnOnce(&mut A) -> &mut FleetArgs,
) -> Result<(A, String), clap::Error>
where
    A: FromArgMatches,
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
    let parsed = parse_matches(&argv, &command)?;
    let text = effective::render(&command(), &parsed);
    Ok((args_of(&parsed, fleet)?, text))
}
