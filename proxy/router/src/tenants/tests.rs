use std::io::Write;

use http::HeaderValue;

use super::*;

fn bearer(key: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let value = HeaderValue::from_str(&format!("Bearer {key}")).unwrap();
    headers.insert(http::header::AUTHORIZATION, value);
    headers
}

fn tenant_of(tenants: &Tenants, key: &str) -> Option<Arc<Tenant>> {
    match tenants.authenticate(&bearer(key)) {
        Authentication::Tenant(tenant) => Some(tenant),
        _ => None,
    }
}

fn keys_file(text: &str) -> tempfile::NamedTempFile {
    let mut file = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    file.write_all(text.as_bytes()).unwrap();
    file
}

#[test]
fn keys_name_their_tenant_and_the_flag_key_is_the_default_tenant() {
    let file = keys_file("[tenants.a]\nkeys = [\"ka1\", \"ka2\"]\n[tenants.b]\nkeys = [\"kb\"]\n");
    let tenants = Tenants::load(Some(file.path()), Some("flag-key"))
        .unwrap()
        .unwrap();
    assert_eq!(&**tenant_of(&tenants, "ka2").unwrap().name(), "a");
    assert_eq!(&**tenant_of(&tenants, "kb").unwrap().name(), "b");
    assert_eq!(
        &**tenant_of(&tenants, "flag-key").unwrap().name(),
        FLAG_TENANT
    );
    assert!(matches!(
        tenants.authenticate(&bearer("ka")),
        Authentication::Unknown
    ));
    assert!(matches!(
        tenants.authenticate(&HeaderMap::new()),
        Authentication::Missing
    ));
    assert!(Tenants::load(None, None).unwrap().is_none());
    // The same key in the file and the flag is refused, without showing it.
    let err = Tenants::load(Some(file.path()), Some("kb"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--api-key") && !err.contains("\"kb\""),
        "{err}"
    );
}

#[test]
fn each_limit_refuses_and_says_when_to_come_back() {
    let now = Instant::now();
    let limits = Limits {
        requests_per_second: Some(2.0),
        prompt_tokens_per_minute: Some(600.0),
        output_tokens_per_minute: Some(120.0),
        max_concurrent_requests: Some(3),
    };
    let tenant = Arc::new(Tenant::new("t", limits, now));
    let first = tenant.arrive(now).unwrap();
    let _second = tenant.arrive(now).unwrap();
    let refused = tenant.arrive(now).unwrap_err();
    assert_eq!(refused.kind, LimitKind::Requests);
    assert_eq!(refused.retry_after, Some(Duration::from_millis(500)));
    // Three in flight at most; one ending frees a place.
    let later = now + Duration::from_secs(2);
    let _third = tenant.arrive(later).unwrap();
    let full = tenant.arrive(later + Duration::from_secs(1)).unwrap_err();
    assert_eq!(full.kind, LimitKind::Concurrency);
    drop(first);
    assert!(tenant.arrive(later + Duration::from_secs(1)).is_ok());
    // Tokens: both must fit; an ask over the limit never fits.
    let status = tenant.charge(500.0, 110.0, later).unwrap();
    assert_eq!(
        status.tokens.unwrap().remaining,
        10.0,
        "the output tokens are the tightest"
    );
    let over = tenant.charge(200.0, 10.0, later).unwrap_err();
    assert_eq!(over.kind, LimitKind::PromptTokens);
    assert_eq!(over.retry_after, Some(Duration::from_secs(10)));
    let never = tenant.charge(1.0, 500.0, later).unwrap_err();
    assert_eq!(
        (never.kind, never.retry_after),
        (LimitKind::OutputTokens, None)
    );
    assert!(
        never.message("t").contains("max_tokens"),
        "{}",
        never.message("t")
    );
    // Nothing was taken by the refusals.
    assert!(tenant.charge(100.0, 10.0, later).is_ok());
}

#[test]
fn a_reload_keeps_the_state_of_tenants_whose_limits_stay() {
    let file = keys_file("[tenants.a]\nkeys = [\"ka\"]\nrequests_per_second = 1\n[tenants.b]\nkeys = [\"kb\"]\nrequests_per_second = 1\n");
    let tenants = Tenants::load(Some(file.path()), None).unwrap().unwrap();
    let now = Instant::now();
    let a = tenant_of(&tenants, "ka").unwrap();
    a.arrive(now).unwrap();
    std::fs::write(
        file.path(),
        "[tenants.a]\nkeys = [\"ka-new\"]\nrequests_per_second = 1\n[tenants.c]\nkeys = [\"kc\"]\n",
    )
    .unwrap();
    tenants.reload();
    assert!(tenant_of(&tenants, "ka").is_none(), "the old key is gone");
    let a_again = tenant_of(&tenants, "ka-new").unwrap();
    assert!(Arc::ptr_eq(&a, &a_again), "same limits: same buckets");
    assert_eq!(a_again.arrive(now).unwrap_err().kind, LimitKind::Requests);
    assert!(tenant_of(&tenants, "kb").is_none() && tenant_of(&tenants, "kc").is_some());
    // Changed limits keep what the tenant used: its requests in flight and its buckets.
    let c = tenant_of(&tenants, "kc").unwrap();
    let text = "[tenants.a]\nkeys = [\"ka-new\"]\nrequests_per_second = 2\n\
                max_concurrent_requests = 1\n[tenants.c]\nkeys = [\"kc\"]\n";
    std::fs::write(file.path(), text).unwrap();
    tenants.reload();
    let a_changed = tenant_of(&tenants, "ka-new").unwrap();
    assert!(!Arc::ptr_eq(&a, &a_changed));
    assert!(Arc::ptr_eq(&c, &tenant_of(&tenants, "kc").unwrap()));
    let held = a_changed
        .arrive(now)
        .expect("a second request fits the new rate");
    assert_eq!(
        a_changed.arrive(now).unwrap_err().kind,
        LimitKind::Concurrency
    );
    drop(held);
    let later = now + Duration::from_secs(5);
    let held = a_changed.arrive(later).unwrap();
    let text = "[tenants.a]\nkeys = [\"ka-new\"]\nmax_concurrent_requests = 1\n";
    std::fs::write(file.path(), text).unwrap();
    tenants.reload();
    let a_again = tenant_of(&tenants, "ka-new").unwrap();
    let busy = a_again.arrive(later).unwrap_err();
    assert_eq!(
        busy.kind,
        LimitKind::Concurrency,
        "its request is still in flight"
    );
    drop(held);
    assert!(a_again.arrive(later).is_ok());
    // A broken file leaves the keys as they were.
    std::fs::write(file.path(), "[tenants.a\n").unwrap();
    tenants.reload();
    assert!(tenant_of(&tenants, "ka-new").is_some());
}

#[test]
fn a_negative_or_enormous_cost_neither_refills_nor_panics() {
    let now = Instant::now();
    let limits = Limits {
        output_tokens_per_minute: Some(100.0),
        requests_per_second: Some(1e-20),
        ..Limits::default()
    };
    let tenant = Arc::new(Tenant::new("t", limits, now));
    tenant.charge(0.0, 100.0, now).unwrap();
    tenant.charge(0.0, -1e12, now).unwrap();
    let over = tenant.charge(0.0, 1.0, now).unwrap_err();
    assert_eq!(over.kind, LimitKind::OutputTokens);
    // One request fits a tiny rate; the next is told to wait ages, and the status renders.
    tenant.arrive(now).unwrap();
    let refused = tenant.arrive(now).unwrap_err();
    assert_eq!(refused.retry_after, Some(Duration::MAX));
    assert!(refused.status.requests.is_some());
}
