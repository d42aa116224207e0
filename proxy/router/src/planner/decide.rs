//! One role's decision: how many engines it should have. A throughput floor (the demand over one
//! engine's rate at the targets), one more at once when every engine's live load misses the
//! targets (a burst the window has not caught up with), and one fewer only when the floor
//! allows it and the survivors, each taking its share of the one removed (load × N/(N−1)),
//! would still meet the targets, for a whole sustained window. With inputs missing or stale it
//! decides nothing and says why ([`Hold`]).

use std::time::{Duration, Instant};

/// Why a role's desired engines stay where they are, whatever the demand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// No engine of the role serves the model (nothing to measure).
    NoEngines,
    /// An engine's metrics stopped answering: its load is not known.
    StaleMetrics,
    /// No engine's latency model has learnt enough to predict (too few answers yet).
    NoLatencyModel,
    /// No answer ended in the window: the answers' length is not known.
    NoAnswers,
    /// The window has not watched long enough.
    WarmingUp,
    /// Even alone an engine misses the target: more engines would not meet it.
    TargetUnreachable,
}

impl Hold {
    /// Every hold, in the order of their metric label values.
    pub const ALL: [Hold; 6] = [
        Hold::NoEngines,
        Hold::StaleMetrics,
        Hold::NoLatencyModel,
        Hold::NoAnswers,
        Hold::WarmingUp,
        Hold::TargetUnreachable,
    ];

    /// Its metric label value and log word.
    pub fn as_str(self) -> &'static str {
        match self {
            Hold::NoEngines => "no_engines",
            Hold::StaleMetrics => "stale_metrics",
            Hold::NoLatencyModel => "no_latency_model",
            Hold::NoAnswers => "no_answers",
            Hold::WarmingUp => "warming_up",
            Hold::TargetUnreachable => "target_unreachable",
        }
    }
}

/// What a role's engines and demand say now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoleFacts {
    /// Engines serving the role now (healthy, not drained).
    pub current: usize,
    /// The requests a second the role must take.
    pub demand: f64,
    /// One engine's requests a second at the targets (the mean of those known).
    pub engine_rate: f64,
    /// Every engine's live load misses the targets.
    pub all_missing: bool,
    /// With one engine fewer, every survivor would still meet the targets.
    pub survivors_meet: bool,
}

/// The bounds and pace of a role's decisions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    /// Never fewer engines than this.
    pub min: usize,
    /// Never more.
    pub max: usize,
    /// How long a scale-down must stay safe before it is made, and between two of them.
    pub scale_down_after: Duration,
}

/// Why the desired engines are what they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// The throughput floor (demand over one engine's rate), or the engines there are.
    Floor,
    /// One more than now: every engine's live load misses the targets.
    Burst,
    /// Fewer would do, but not yet for the whole window (or the survivors would miss).
    ScaleDownPending,
    /// One fewer: safe for the whole window.
    ScaleDown,
    /// Inputs missing or stale: nothing decided.
    Held(Hold),
}

impl Why {
    /// Its log word.
    pub fn as_str(self) -> &'static str {
        match self {
            Why::Floor => "floor",
            Why::Burst => "burst",
            Why::ScaleDownPending => "scale_down_pending",
            Why::ScaleDown => "scale_down",
            Why::Held(hold) => hold.as_str(),
        }
    }
}

/// A role's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// The engines it should have.
    pub desired: usize,
    /// The throughput floor, when the inputs gave one.
    pub floor: Option<usize>,
    /// Why.
    pub why: Why,
}

/// What a role's decisions remember between two: since when a scale-down has been safe.
#[derive(Debug, Default)]
pub struct RoleState {
    safe_since: Option<Instant>,
    last: Option<usize>,
}

impl RoleState {
    /// Holds the role where it is, for `hold`: the last decision, or the engines there are.
    pub fn hold(&mut self, current: usize, hold: Hold) -> Decision {
        self.safe_since = None;
        Decision {
            desired: self.last.unwrap_or(current),
            floor: None,
            why: Why::Held(hold),
        }
    }

    /// Decides at `now` from `facts` within `bounds`.
    pub fn decide(&mut self, facts: RoleFacts, bounds: Bounds, now: Instant) -> Decision {
        let clamp = |n: usize| n.clamp(bounds.min, bounds.max.max(bounds.min));
        let floor = clamp(if facts.engine_rate.is_infinite() {
            1
        } else {
            (facts.demand / facts.engine_rate).ceil() as usize
        });
        let (desired, why) = if facts.all_missing && facts.current < bounds.max {
            (clamp(floor.max(facts.current + 1)), Why::Burst)
        } else if floor >= facts.current {
            (floor, Why::Floor)
        } else if !facts.survivors_meet {
            self.safe_since = None;
            (clamp(facts.current), Why::ScaleDownPending)
        } else {
            let since = *self.safe_since.get_or_insert(now);
            if now.saturating_duration_since(since) >= bounds.scale_down_after {
                // The next step down waits a whole window again.
                self.safe_since = Some(now);
                (clamp(facts.current - 1), Why::ScaleDown)
            } else {
                (clamp(facts.current), Why::ScaleDownPending)
            }
        };
        if !matches!(why, Why::ScaleDown | Why::ScaleDownPending) {
            self.safe_since = None;
        }
        self.last = Some(desired);
        Decision {
            desired,
            floor: Some(floor),
            why,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: Bounds = Bounds {
        min: 1,
        max: 16,
        scale_down_after: Duration::from_secs(300),
    };

    fn facts(current: usize, demand: f64) -> RoleFacts {
        RoleFacts {
            current,
            demand,
            engine_rate: 2.0,
            all_missing: false,
            survivors_meet: true,
        }
    }

    #[test]
    fn the_floor_is_demand_over_one_engines_rate_within_bounds() {
        let mut role = RoleState::default();
        let now = Instant::now();
        let decision = role.decide(facts(2, 7.0), BOUNDS, now);
        assert_eq!((decision.desired, decision.why), (4, Why::Floor));
        assert_eq!(decision.floor, Some(4));
        assert_eq!(role.decide(facts(2, 100.0), BOUNDS, now).desired, 16);
        assert_eq!(role.decide(facts(1, 0.0), BOUNDS, now).desired, 1);
    }

    #[test]
    fn a_burst_adds_one_at_once() {
        let mut role = RoleState::default();
        let burst = RoleFacts {
            all_missing: true,
            ..facts(4, 2.0)
        };
        let decision = role.decide(burst, BOUNDS, Instant::now());
        assert_eq!((decision.desired, decision.why), (5, Why::Burst));
        let at_max = RoleFacts {
            current: 16,
            ..burst
        };
        assert_eq!(role.decide(at_max, BOUNDS, Instant::now()).desired, 16);
    }

    #[test]
    fn scale_down_waits_a_safe_window_then_steps_by_one() {
        let mut role = RoleState::default();
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        // Demand for 1 engine, 4 there: safe, but not for the window yet.
        let pending = role.decide(facts(4, 2.0), BOUNDS, at(0));
        assert_eq!((pending.desired, pending.why), (4, Why::ScaleDownPending));
        assert_eq!(role.decide(facts(4, 2.0), BOUNDS, at(299)).desired, 4);
        let down = role.decide(facts(4, 2.0), BOUNDS, at(300));
        assert_eq!((down.desired, down.why), (3, Why::ScaleDown));
        // The next step waits a whole window again.
        assert_eq!(role.decide(facts(3, 2.0), BOUNDS, at(301)).desired, 3);
        assert_eq!(role.decide(facts(3, 2.0), BOUNDS, at(600)).desired, 2);
        // Survivors that would miss reset the clock.
        let unsafe_ = RoleFacts {
            survivors_meet: false,
            ..facts(2, 0.5)
        };
        assert_eq!(role.decide(unsafe_, BOUNDS, at(1_000)).desired, 2);
        assert_eq!(role.decide(facts(2, 0.5), BOUNDS, at(1_001)).desired, 2);
        assert_eq!(role.decide(facts(2, 0.5), BOUNDS, at(1_300)).desired, 2);
        assert_eq!(role.decide(facts(2, 0.5), BOUNDS, at(1_301)).desired, 1);
        // Demand back above the engines there resets it too.
        let mut role = RoleState::default();
        role.decide(facts(4, 2.0), BOUNDS, at(0));
        role.decide(facts(4, 8.0), BOUNDS, at(100));
        assert_eq!(role.decide(facts(4, 2.0), BOUNDS, at(300)).desired, 4);
    }

    #[test]
    fn a_hold_keeps_the_last_decision_and_says_why() {
        let mut role = RoleState::default();
        let held = role.hold(3, Hold::StaleMetrics);
        assert_eq!((held.desired, held.floor), (3, None));
        assert_eq!(held.why, Why::Held(Hold::StaleMetrics));
        role.decide(facts(3, 9.0), BOUNDS, Instant::now());
        assert_eq!(role.hold(3, Hold::NoAnswers).desired, 5);
    }
}
