//! `pd-proxy check-config FILE [FLAGS]`: the configuration `pd-proxy --config FILE [FLAGS]`
//! would start with (the environment read too), checked whole without starting anything:
//! flags, the file's tables, the TLS files, the API keys file. Prints the effective
//! configuration as a sectioned TOML file, each value with where it came from and secrets
//! masked; an error names what is wrong.

use std::ffi::OsString;

use pd_router::tenants::Tenants;
use pd_service::tls::read_key_pair;

use super::{Args, PREFILL_ENV};

/// The subcommand's name.
pub const CHECK_CONFIG: &str = "check-config";

/// Checks the configuration of `pd-proxy check-config FILE [FLAGS]` (`argv` as given, from the
/// program's name on): the effective configuration and a last line saying it is valid, or why
/// it is not.
pub fn check_config(argv: &[OsString], prefill_env: Option<&str>) -> Result<String, String> {
    let usage = format!("usage: pd-proxy {CHECK_CONFIG} FILE [FLAGS]");
    let (program, rest) = argv.split_first().ok_or(usage.clone())?;
    let (command, rest) = rest.split_first().ok_or(usage.clone())?;
    if command != CHECK_CONFIG {
        return Err(usage);
    }
    let (file, flags) = rest.split_first().ok_or(usage)?;
    let full: Vec<OsString> = [program.clone(), "--config".into(), file.clone()]
        .into_iter()
        .chain(flags.iter().cloned())
        .collect();
    let (args, mut text) = Args::try_check_args(full).map_err(|err| err.to_string())?;
    if let Some(env) = prefill_env.filter(|_| args.fleet.prefill_groups.is_empty()) {
        text.push_str(&format!("\n# prefill: from {PREFILL_ENV}={env:?}\n"));
    }
    let config = args
        .into_config(prefill_env)
        .map_err(|err| err.to_string())?;
    Tenants::load(config.api_keys_file.as_deref(), config.api_key.as_deref())
        .map_err(|err| err.to_string())?;
    if let Some(tls) = &config.tls {
        read_key_pair(&tls.cert, &tls.key).map_err(|err| err.to_string())?;
    }
    let file = file.to_string_lossy();
    Ok(format!("{text}\n# {file}: valid\n"))
}
