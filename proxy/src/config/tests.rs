//! The flags' parsing and validation.
use super::*;

fn config(argv: &[&str]) -> Result<Config, ConfigError> {
    let argv = std::iter::once("pd-proxy").chain(argv.iter().copied());
    Args::try_parse_args(argv).unwrap().into_config(None)
}

#[test]
fn prefill_takes_an_optional_bootstrap_port() {
    let config = config(&[
        "--prefill",
        "http://10.0.0.5:8100",
        "--prefill",
        "http://10.0.0.6:8100/",
        "9000",
        "--prefill",
        "http://[fd00::1]:8100",
        "none",
        "--decode",
        "http://10.0.0.7:8200/",
    ])
    .unwrap();
    assert_eq!(
        config.router.prefills,
        vec![
            PrefillTarget {
                url: "http://10.0.0.5:8100".into(),
                bootstrap_addr: Some("http://10.0.0.5:8998".into())
            },
            PrefillTarget {
                url: "http://10.0.0.6:8100".into(),
                bootstrap_addr: Some("http://10.0.0.6:9000".into())
            },
            PrefillTarget {
                url: "http://[fd00::1]:8100".into(),
                bootstrap_addr: Some("http://[fd00::1]:8998".into())
            },
        ]
    );
    assert_eq!(
        config.router.decodes,
        vec!["http://10.0.0.7:8200".to_owned()]
    );
    assert_eq!(config.prefill_timeout, Duration::from_secs(30));
}

#[test]
fn in_sequential_mode_a_prefill_without_a_port_has_no_bootstrap_server() {
    let config = config(&[
        "--mode",
        "sequential",
        "--prefill",
        "http://10.0.0.5:8100",
        "--prefill",
        "http://10.0.0.6:8100",
        "none",
        "--prefill",
        "http://10.0.0.7:8100",
        "9000",
        "--decode",
        "http://10.0.0.8:8200",
    ])
    .unwrap();
    let bootstraps: Vec<_> = config
        .router
        .prefills
        .iter()
        .map(|p| p.bootstrap_addr.as_deref())
        .collect();
    assert_eq!(bootstraps, [None, None, Some("http://10.0.0.7:9000")]);
    let targets = parse_prefill_env("http://a:1, http://b:2 9000", None).unwrap();
    assert_eq!(bootstrap_of(&targets[0]), None);
    assert_eq!(bootstrap_of(&targets[1]), Some("http://b:9000"));
}

fn bootstrap_of(entry: &PrefillEntry) -> Option<&str> {
    match entry {
        PrefillEntry::Server(target) => target.bootstrap_addr.as_deref(),
        PrefillEntry::Dns(target) => panic!("{target:?}"),
    }
}

#[test]
fn a_bootstrap_url_names_a_registry_elsewhere() {
    let config = config(&[
        "--prefill",
        "http://prefill-leader:8000",
        "http://registry.pd:8998/",
        "--prefill",
        "dns://prefill-leader.pd:8000",
        "HTTPS://registry.pd:8998",
        "--decode",
        "http://d:1",
    ])
    .unwrap();
    assert_eq!(
        config.router.prefills[0].bootstrap_addr.as_deref(),
        Some("http://registry.pd:8998")
    );
    let registry = DnsBootstrap::Url("https://registry.pd:8998".into());
    assert_eq!(config.router.dns.prefills[0].bootstrap, registry);
    for bad in [
        "http://",
        "http://user:pw@registry:8998",
        "ftp://registry:8998",
    ] {
        let argv = ["--prefill", "http://p:1", bad, "--decode", "http://d:1"];
        let err = self::config(&argv).unwrap_err().to_string();
        assert!(
            err.contains("--prefill") || err.contains("bootstrap"),
            "{bad}: {err}"
        );
    }
}

#[test]
fn dns_names_are_backends_too() {
    let parsed = config(&[
        "--prefill",
        "dns://prefill.pd.svc.cluster.local:8000",
        "9000",
        "--prefill",
        "http://p:1",
        "--decode",
        "dns://_http._tcp.decode.pd.svc.cluster.local",
        "--dns-server",
        "127.0.0.1:5353",
        "--dns-interval",
        "2",
    ])
    .unwrap();
    assert_eq!(parsed.router.prefills.len(), 1);
    assert!(parsed.router.decodes.is_empty());
    let prefill = &parsed.router.dns.prefills[0];
    assert_eq!(prefill.name, "prefill.pd.svc.cluster.local");
    assert_eq!(
        (prefill.port, &prefill.bootstrap),
        (Some(8000), &DnsBootstrap::Port(9000))
    );
    let srv = config(&[
        "--prefill",
        "dns://_http._tcp.prefill.pd",
        "dns://_bootstrap._tcp.prefill.pd",
        "--decode",
        "http://d:1",
    ])
    .unwrap();
    let bootstrap = DnsBootstrap::Srv("_bootstrap._tcp.prefill.pd".into());
    assert_eq!(srv.router.dns.prefills[0].bootstrap, bootstrap);
    let err = config(&[
        "--prefill",
        "dns://p.pd:1",
        "dns://b.pd:2",
        "--decode",
        "http://d:1",
    ]);
    assert!(matches!(err, Err(ConfigError::BadBootstrapPort { .. })));
    let decode = &parsed.router.dns.decodes[0];
    assert_eq!(
        (decode.name.as_str(), decode.port),
        ("_http._tcp.decode.pd.svc.cluster.local", None)
    );
    assert_eq!(parsed.router.dns.server.unwrap().port(), 5353);
    assert_eq!(parsed.router.dns.interval, Duration::from_secs(2));
    for bad in ["dns://", "dns://a b:1", "dns://name:0", "dns://name:port"] {
        let err = config(&["--prefill", "http://p:1", "--decode", bad]).unwrap_err();
        assert!(matches!(err, ConfigError::BadUrl { .. }), "{bad}: {err}");
    }
}

#[test]
fn missing_backends_are_refused() {
    assert_eq!(
        config(&["--decode", "http://d:1"]).unwrap_err(),
        ConfigError::NoPrefill
    );
    assert_eq!(
        config(&["--prefill", "http://p:1"]).unwrap_err(),
        ConfigError::NoDecode
    );
}

#[test]
fn bad_urls_and_ports_are_refused() {
    for (argv, needle) in [
        (
            &["--prefill", "p:8100", "--decode", "http://d:1"][..],
            "--prefill",
        ),
        (
            &["--prefill", "http://p:1", "--decode", "ftp://d:1"],
            "--decode",
        ),
        (
            &["--prefill", "http://p:1", "--decode", "nonsense"],
            "--decode",
        ),
        (
            &["--prefill", "http://p:1", "abc", "--decode", "http://d:1"],
            "Invalid bootstrap port",
        ),
        (
            &["--prefill", "http://p:1", "70000", "--decode", "http://d:1"],
            "Invalid bootstrap port",
        ),
        (
            &["--prefill", "http://p:1", "0", "--decode", "http://d:1"],
            "Invalid bootstrap port",
        ),
    ] {
        let err = config(argv).unwrap_err().to_string();
        assert!(err.contains(needle), "{argv:?}: {err}");
    }
}

#[test]
fn prefill_env_lists_entries() {
    let targets = parse_prefill_env("http://a:1 9000, http://b:2 ,", Some(8998)).unwrap();
    assert_eq!(targets.len(), 2);
    assert_eq!(bootstrap_of(&targets[0]), Some("http://a:9000"));
    assert_eq!(bootstrap_of(&targets[1]), Some("http://b:8998"));
    assert!(parse_prefill_env("http://a:1 2 3", Some(8998)).is_err());
    let args = Args::try_parse_args(["pd-proxy", "--decode", "http://d:1"]).unwrap();
    assert_eq!(
        args.into_config(Some("http://a:1"))
            .unwrap()
            .router
            .prefills
            .len(),
        1
    );
}

#[test]
fn flags_parse() {
    let config = config(&[
        "--prefill",
        "http://p:1",
        "--decode",
        "http://d:1,http://d:2",
        "--policy",
        "least_loaded",
        "--mode",
        "sequential",
        "--request-timeout",
        "1.5",
        "--api-key",
        "",
    ])
    .unwrap();
    assert_eq!(config.router.decodes.len(), 2);
    assert_eq!(config.router.routing.prefill_policy, Policy::LeastLoaded);
    assert_eq!(config.router.routing.decode_policy, Policy::LeastLoaded);
    assert_eq!(config.router.mode, Mode::Sequential);
    assert_eq!(config.request_timeout, Duration::from_millis(1500));
    assert_eq!(config.router.health.recovery(), Duration::from_millis(500));
    // D's first byte is due within the whole request's limit.
    assert_eq!(
        config.decode_first_byte_timeout,
        Duration::from_millis(1500)
    );
    assert_eq!(config.api_key, None);
    for bad in [
        &["--policy", "random"][..],
        &["--request-timeout", "0"],
        &["--health-failure-threshold", "0"],
        &["--prefill", "http://p:1", "2", "3"],
        &["--cache-threshold", "1.5"],
        &["--hash-load-factor", "0.5"],
        &["--session-header", "bad header"],
        &["--decode-policy", "sticky"],
    ] {
        let argv = std::iter::once("pd-proxy").chain(bad.iter().copied());
        assert!(Args::try_parse_args(argv).is_err(), "{bad:?} was accepted");
    }
}

#[test]
fn each_choice_takes_its_own_policy() {
    let both = ["--prefill", "http://p:1", "--decode", "http://d:1"];
    let mixed = ["--policy", "least_loaded", "--decode-policy", "cache_aware"];
    let parsed = config(&[&both[..], &mixed].concat()).unwrap();
    assert_eq!(parsed.router.routing.prefill_policy, Policy::LeastLoaded);
    assert_eq!(parsed.router.routing.decode_policy, Policy::CacheAware);
    let share = ["--decode-only-prefix-share", "0.8"];
    assert!(matches!(
        config(&[&both[..], &share].concat()),
        Err(ConfigError::PrefixShareNeedsCacheAware)
    ));
    let aware = ["--decode-policy", "cache_aware"];
    let parsed = config(&[&both[..], &share, &aware].concat()).unwrap();
    assert_eq!(parsed.router.routing.decode_only.prefix_share, Some(0.8));
}

/// The `--config` file, read into pd-proxy's flags.
mod config_file {
    use crate::config::{Args, Policy};

    fn parse(text: &str, flags: &[&str]) -> Result<Args, String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("proxy.toml");
        std::fs::write(&path, text).unwrap();
        let argv = ["pd-proxy", "--config", path.to_str().unwrap()];
        Args::try_parse_args(argv.iter().chain(flags)).map_err(|err| err.to_string())
    }

    #[test]
    fn a_valid_file_sets_flags_and_models() {
        let args = parse(
            "policy = \"cache_aware\"\ndecode = [\"http://d:1\", \"http://d:2\"]\n\
             prefill = [\"http://p:1 9000\"]\nlora-load-on-demand = true\n\
             cache_threshold = 0.25\n[aliases]\nsmall = \"m\"\n\
             [models.m]\npolicy = \"least_loaded\"\ndecode-policy = \"round_robin\"\n\
             [adapters.ad]\nbase = \"m\"\npath = \"/a\"\n",
            &[],
        )
        .unwrap();
        assert_eq!(args.fleet.policy, Policy::CacheAware);
        assert_eq!(args.fleet.prefill_groups, [["http://p:1", "9000"]]);
        assert!(args.fleet.models.lora_load_on_demand);
        let config = args.into_config(None).unwrap();
        assert_eq!(config.router.decodes.len(), 2);
        assert_eq!(config.router.routing.cache.threshold, 0.25);
        let models = config.router.models;
        assert_eq!(models.canonical("small"), "m");
        assert_eq!(models.policies["m"].prefill, Policy::LeastLoaded);
        assert_eq!(models.policies["m"].decode, Policy::RoundRobin);
        assert_eq!(models.adapters["ad"].path, "/a");
    }

    #[test]
    fn flags_win_over_the_file() {
        let args = parse(
            "policy = \"cache_aware\"\ndecode = [\"http://d:1\"]\n",
            &["--policy", "least_loaded", "--decode", "http://e:1"],
        )
        .unwrap();
        assert_eq!(args.fleet.policy, Policy::LeastLoaded);
        assert_eq!(args.fleet.decode, ["http://e:1"]);
    }

    #[test]
    fn mistakes_name_their_line() {
        let cases = [
            (
                "decode = [\"http://d:1\"]\n\nno-such-flag = 1\n",
                ":3: `no-such-flag`",
            ),
            ("\npolicy = \"nearest\"\n", ":2: "),
            (
                "[models.m]\nprefill-policy = \"fast\"\n",
                ":2: `fast` is not a policy",
            ),
            ("[models.m]\ncolour = \"red\"\n", ":2: "),
            ("[aliases]\na = \"b\"\nb = \"c\"\n", "itself an alias"),
            ("decode = [1, [2]]\n", ":1: `decode` takes a value"),
            ("x = \n", ":1: "),
        ];
        for (text, expected) in cases {
            let err = parse(text, &[])
                .err()
                .unwrap_or_else(|| panic!("{text:?} passed"));
            assert!(err.contains(expected), "{text:?}: {err}");
        }
    }

    #[test]
    fn sections_by_help_heading_say_the_same_as_the_flat_form() {
        let sectioned = parse(
            "[listen]\nport = 9100\n[backends]\ndecode = [\"http://d:1\"]\n\
             prefill = [\"http://p:1 9000\"]\n[routing]\npolicy = \"cache_aware\"\n\
             [limits]\nrequest-timeout = 12\n[admin]\nmetrics-open = true\n[aliases]\nsmall = \"m\"\n",
            &[],
        )
        .unwrap();
        let flat = parse(
            "port = 9100\ndecode = [\"http://d:1\"]\nprefill = [\"http://p:1 9000\"]\n\
             policy = \"cache_aware\"\nrequest-timeout = 12\nmetrics-open = true\n",
            &[],
        )
        .unwrap();
        assert_eq!(sectioned.port, 9100);
        assert_eq!(
            format!("{:?}", sectioned.fleet.policy),
            format!("{:?}", flat.fleet.policy)
        );
        assert_eq!(sectioned.request_timeout, flat.request_timeout);
        assert!(sectioned.metrics_open && flat.metrics_open);
        let config = sectioned.into_config(None).unwrap();
        assert_eq!(config.router.models.canonical("small"), "m");
    }

    #[test]
    fn a_flag_in_another_section_is_told_where_it_belongs() {
        let cases = [
            (
                "[routing]\nport = 1\n",
                ":2: `port` belongs in [listen], not [routing]",
            ),
            ("[listen]\n\nconfig = \"x\"\n", ":3: `config` is not a"),
            (
                "[limits]\nno-such = 1\n",
                ":2: `no-such` is not a pd-proxy flag",
            ),
        ];
        for (text, expected) in cases {
            let err = parse(text, &[])
                .err()
                .unwrap_or_else(|| panic!("{text:?} passed"));
            assert!(err.contains(expected), "{text:?}: {err}");
        }
    }
}

#[test]
fn every_flag_has_a_heading_and_so_a_section_of_the_config_file() {
    use clap::CommandFactory;
    let unplaced = pd_router::flags::headings::without_section(&Args::command());
    assert!(unplaced.is_empty(), "{unplaced:?}");
}
