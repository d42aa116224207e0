//! The multi-turn chat workload: sessions share a few system prompts; each turn's prompt is the
//! whole conversation so far (the system prompt, every earlier question and answer) and a new
//! question, as chat clients send it. An engine that served the previous turn holds all but the
//! newest part in its prefix cache.

use super::{four_prefills_two_decodes, tokens, Scenario};

/// The chat workload.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    /// Conversations.
    pub sessions: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Conversations running at once.
    pub concurrency: usize,
    /// Distinct system prompts the conversations share.
    pub system_prompts: usize,
}

impl Workload {
    /// The default: 200 five-turn conversations, 16 at a time, over 8 system prompts.
    pub const DEFAULT: Workload = Workload {
        sessions: 200,
        turns: 5,
        concurrency: 16,
        system_prompts: 8,
    };
}

/// Tokens of a system prompt, a question and an answer (the engines' default tokenizer makes
/// one token of each byte).
const SYSTEM_TOKENS: usize = 50;
const QUESTION_TOKENS: usize = 200;
const ANSWER_TOKENS: usize = 50;

/// The prompts of one conversation, turn by turn.
fn conversation(session: usize, workload: &Workload) -> Vec<String> {
    let mut history = tokens(
        &format!("sys{}", session % workload.system_prompts),
        SYSTEM_TOKENS,
    );
    (0..workload.turns)
        .map(|turn| {
            history.push_str(&tokens(&format!("s{session}q{turn}"), QUESTION_TOKENS));
            let prompt = history.clone();
            history.push_str(&tokens(&format!("s{session}a{turn}"), ANSWER_TOKENS));
            prompt
        })
        .collect()
}

/// The chat scenario: four prefills and two decodes of 2,048-block caches, one proxy, each
/// setup of the proxy's policies.
pub fn scenario(workload: Workload) -> Scenario {
    Scenario {
        name: "a multi-turn chat workload",
        chart: "routing",
        sessions: workload.sessions,
        concurrency: workload.concurrency,
        prompts: Box::new(move |session| conversation(session, &workload)),
        setups: vec![
            ("round_robin", vec!["--policy", "round_robin"]),
            ("least_loaded", vec!["--policy", "least_loaded"]),
            ("consistent_hash", vec!["--policy", "consistent_hash"]),
            ("cache_aware", vec!["--policy", "cache_aware"]),
            (
                "cache_aware + decode-only on prefix hit",
                vec![
                    "--policy",
                    "cache_aware",
                    "--decode-only-prefix-share",
                    "0.5",
                ],
            ),
            ("precise_prefix", vec!["--policy", "precise_prefix"]),
        ],
        shape: Box::new(|spec| four_prefills_two_decodes(spec, 200, 2048, &[])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_turn_carries_the_whole_conversation() {
        let workload = Workload {
            sessions: 4,
            turns: 3,
            concurrency: 1,
            system_prompts: 2,
        };
        let turns = conversation(1, &workload);
        assert_eq!(turns.len(), 3);
        assert!(turns[2].starts_with(&turns[1]) && turns[1].starts_with(&turns[0]));
        assert_eq!(turns[0].len(), SYSTEM_TOKENS + QUESTION_TOKENS);
        assert_eq!(
            turns[1].len(),
            turns[0].len() + ANSWER_TOKENS + QUESTION_TOKENS
        );
        // Sessions 1 and 3 share a system prompt, 0 and 1 do not.
        let system = |s: usize| conversation(s, &workload)[0][..SYSTEM_TOKENS].to_owned();
        assert_eq!(system(1), system(3));
        assert_ne!(system(0), system(1));
    }
}
