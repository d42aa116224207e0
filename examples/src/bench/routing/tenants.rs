//! The multi-tenant workload: many tenants, each with a long system prompt its users share,
//! every request that prompt and a question of its own; through two proxy replicas in front of
//! prefills whose caches hold only part of all the tenants' prompts, and whose compute serves
//! one prompt at a time. Where a tenant's prompt lands decides whether it is computed again.

use super::{four_prefills_two_decodes, tokens, Scenario};

/// The multi-tenant workload.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    /// Tenants, each with its own system prompt.
    pub tenants: usize,
    /// Users per tenant, each sending its requests in turn.
    pub users: usize,
    /// Requests per user.
    pub requests: usize,
    /// Users sending at once.
    pub concurrency: usize,
    /// Tokens of a tenant's system prompt.
    pub system_tokens: usize,
    /// Tokens of a question.
    pub question_tokens: usize,
    /// Blocks of 16 tokens each engine's prefix cache holds.
    pub cache_blocks: usize,
}

impl Workload {
    /// The default: 50 tenants of 32 users, one request each (1,600 requests, as independent
    /// calls sharing a tenant's prompt are), 24 users at a time, 1,024-token system prompts and
    /// 128-token questions, caches of 1,200 blocks.
    pub const DEFAULT: Workload = Workload {
        tenants: 50,
        users: 32,
        requests: 1,
        concurrency: 24,
        system_tokens: 1024,
        question_tokens: 128,
        cache_blocks: 1200,
    };
}

/// The prompts of user `session` (of tenant `session % tenants`, so that the users at work at
/// any time belong to many tenants).
fn prompts(session: usize, workload: &Workload) -> Vec<String> {
    let tenant = session % workload.tenants;
    let system = tokens(&format!("tenant{tenant}"), workload.system_tokens);
    (0..workload.requests)
        .map(|k| {
            let question = tokens(&format!("u{session}q{k}"), workload.question_tokens);
            format!("{system}{question}")
        })
        .collect()
}

/// The multi-tenant scenario: four prefills computing one prompt at a time, two decodes, each
/// engine's cache holding `cache_blocks` blocks of 16 tokens (all the tenants' system prompts
/// are 3,200: by default the four prefills hold them once with room for the questions, not
/// twice), two proxies; round robin, cache_aware and precise_prefix.
pub fn scenario(workload: Workload) -> Scenario {
    Scenario {
        name: "a multi-tenant workload through two proxies",
        chart: "tenants",
        sessions: workload.tenants * workload.users,
        concurrency: workload.concurrency,
        prompts: Box::new(move |session| prompts(session, &workload)),
        setups: vec![
            ("round_robin", vec!["--policy", "round_robin"]),
            ("cache_aware", vec!["--policy", "cache_aware"]),
            ("precise_prefix", vec!["--policy", "precise_prefix"]),
        ],
        shape: Box::new(move |spec| {
            four_prefills_two_decodes(
                spec,
                100,
                workload.cache_blocks,
                &["--prefill-concurrency", "1"],
            );
            spec.proxies = 2;
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenants_users_share_its_system_prompt() {
        let workload = Workload {
            tenants: 3,
            ..Workload::DEFAULT
        };
        let first = prompts(0, &workload);
        assert_eq!(first.len(), workload.requests);
        assert_eq!(first[0].len(), 1024 + 128);
        let same_tenant = prompts(3, &workload);
        let other_tenant = prompts(1, &workload);
        assert_eq!(first[0][..1024], same_tenant[0][..1024]);
        assert_ne!(first[0][..1024], other_tenant[0][..1024]);
        assert_ne!(first[0][1024..], same_tenant[0][1024..]);
    }
}
