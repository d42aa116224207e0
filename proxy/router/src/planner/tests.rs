use super::*;
use crate::latency::model::{tpot_features, ttft_features};

const CONFIG: PlannerConfig = PlannerConfig {
    ttft_target: Duration::from_secs(2),
    tpot_target: Duration::from_millis(50),
    window: Duration::from_secs(60),
    bounds: Bounds {
        min: 1,
        max: 16,
        scale_down_after: Duration::from_secs(300),
    },
    max_batch: 256,
    interval: Duration::from_secs(5),
};

/// A prefill whose TTFT is 0.2 s + 0.1 s per thousand tokens + 0.3 s per request queued.
fn prefill_latency() -> EngineLatency {
    let latency = EngineLatency::default();
    for i in 0..50 {
        let (tokens, load) = ((i % 7) * 1_000, i % 4);
        let seconds = 0.2 + 0.1 * (tokens / 1_000) as f64 + 0.3 * load as f64;
        lock(&latency.ttft).learn(&ttft_features(tokens, load), seconds);
    }
    latency
}

/// A decode whose TPOT is 20 ms + 1 ms per other request in its batch.
fn decode_latency() -> EngineLatency {
    let latency = EngineLatency::default();
    for i in 0..50 {
        let load = i % 9;
        lock(&latency.tpot).learn(&tpot_features(load), 0.020 + 0.001 * load as f64);
    }
    latency
}

fn view(latency: &EngineLatency, load: usize) -> EngineView<'_> {
    EngineView {
        load,
        stale: false,
        max_batch: None,
        latency,
    }
}

/// A planner that saw 4 requests a second for a minute, each 3,000 uncached tokens through a
/// prefill, answers of 100 tokens.
fn planner_with_demand(start: Instant) -> Planner {
    let planner = Planner::new(CONFIG);
    for i in 0..240 {
        let at = start + Duration::from_millis(i * 250);
        planner.arrived("m", at, 4_000, Some(3_000));
        planner.answered("m", at, 100);
    }
    planner
}

#[test]
fn each_role_is_sized_on_its_rate_at_the_targets() {
    let start = Instant::now();
    let planner = planner_with_demand(start);
    let (p, d) = (prefill_latency(), decode_latency());
    let now = start + Duration::from_secs(60);
    let plan = planner.plan("m", &[view(&p, 0)], &[view(&d, 0), view(&d, 0)], now);
    // The window's first second has just left it: 236 requests in 60 s.
    assert!((plan.demand.requests_per_second - 236.0 / 60.0).abs() < 1e-9);
    // Prefill: 0.5 s alone, 0.3 s a request queued ahead: x = 5, rho = 10/11, 3.03 req/s an
    // engine: 2 for 3.93 req/s.
    let rate = plan.prefill.engine_rate.unwrap();
    assert!((rate - (10.0 / 11.0) / 0.3).abs() < 1e-2, "{rate}");
    assert_eq!(plan.prefill.decision.desired, 2);
    assert_eq!(plan.prefill.decision.why, Why::Floor);
    // Decode: a batch of 31 at 50 ms, 100-token answers: 6.2 req/s an engine; 1 is enough,
    // but a scale-down waits for its window.
    let rate = plan.decode.engine_rate.unwrap();
    assert!((6.0..6.3).contains(&rate), "{rate}");
    assert_eq!(plan.decode.decision.floor, Some(1));
    assert_eq!(plan.decode.decision.desired, 2);
    assert_eq!(plan.decode.decision.why, Why::ScaleDownPending);
    let later = planner.plan(
        "m",
        &[view(&p, 0)],
        &[view(&d, 0), view(&d, 0)],
        now + Duration::from_secs(300),
    );
    // Five minutes later, demand gone and the engines idle: one decode fewer.
    assert_eq!(later.decode.decision.desired, 1);
    assert_eq!(later.decode.decision.why, Why::ScaleDown);
    assert_eq!(planner.models(), ["m"]);
}

#[test]
fn a_burst_adds_one_and_survivors_that_would_miss_block_a_scale_down() {
    let start = Instant::now();
    let planner = planner_with_demand(start);
    let (p, d) = (prefill_latency(), decode_latency());
    let now = start + Duration::from_secs(60);
    // Prefills queued 6 deep: 0.5 + 1.8 s, every one misses 2 s.
    let prefills = [view(&p, 6), view(&p, 6), view(&p, 6)];
    let plan = planner.plan("m", &prefills, &[view(&d, 0)], now);
    assert_eq!(plan.prefill.decision.desired, 4);
    assert_eq!(plan.prefill.decision.why, Why::Burst);
    // Decodes running 20 each: 40 ms; one fewer would make 40: 60 ms, a miss.
    let decodes = [view(&d, 20), view(&d, 20)];
    let plan = planner.plan("m", &prefills, &decodes, now);
    assert_eq!(plan.decode.decision.desired, 2);
    assert_eq!(plan.decode.decision.why, Why::ScaleDownPending);
}

#[test]
fn missing_or_stale_inputs_hold_and_say_which() {
    let start = Instant::now();
    let planner = planner_with_demand(start);
    let (p, d) = (prefill_latency(), decode_latency());
    let untrained = EngineLatency::default();
    let now = start + Duration::from_secs(60);
    let why = |plan: RolePlan| plan.decision.why;
    let stale = EngineView {
        stale: true,
        ..view(&p, 0)
    };
    let plan = planner.plan("m", &[view(&p, 0), stale], &[], now);
    assert_eq!(why(plan.prefill), Why::Held(Hold::StaleMetrics));
    assert_eq!(why(plan.decode), Why::Held(Hold::NoEngines));
    let plan = planner.plan("m", &[view(&untrained, 0)], &[view(&untrained, 0)], now);
    assert_eq!(why(plan.prefill), Why::Held(Hold::NoLatencyModel));
    assert_eq!(why(plan.decode), Why::Held(Hold::NoLatencyModel));
    // A target no engine meets alone: 1 s prompts against 0.5 s.
    let tight = Planner::new(PlannerConfig {
        ttft_target: Duration::from_millis(500),
        ..CONFIG
    });
    for at in [0, 59] {
        tight.arrived("m", start + Duration::from_secs(at), 9_000, Some(9_000));
    }
    let plan = tight.plan("m", &[view(&p, 0)], &[view(&d, 0)], now);
    assert_eq!(why(plan.prefill), Why::Held(Hold::TargetUnreachable));
    assert_eq!(why(plan.decode), Why::Held(Hold::NoAnswers));
    // A model seen for less than half the window is warming up.
    let young = Planner::new(CONFIG);
    young.arrived("m", start, 100, Some(100));
    let plan = young.plan(
        "m",
        &[view(&p, 0)],
        &[view(&d, 0)],
        start + Duration::from_secs(20),
    );
    assert_eq!(why(plan.prefill), Why::Held(Hold::WarmingUp));
}
