//! The split of a model's `--dual` engines between the two duties: the share that brings the
//! whole pool (the prefill-only and decode-only engines included) nearest to the ratio of what
//! the planner says each role needs, one engine at least on each duty, approached one engine
//! at a time.

/// What each role of a model needs, in engines (the planner's throughput floor, or its desired
/// engines on a burst).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Needs {
    /// Engines the prefills need.
    pub prefill: f64,
    /// Engines the decodes need.
    pub decode: f64,
}

/// The `--dual` engines that should be on prefill duty, of `duals`, beside `fixed_prefills`
/// prefill-only and `fixed_decodes` decode-only engines, when the roles need `needs`. Needs of
/// nothing keep `current`.
pub fn dual_prefills(
    needs: Needs,
    fixed_prefills: usize,
    fixed_decodes: usize,
    duals: usize,
    current: usize,
) -> usize {
    let wanted = needs.prefill + needs.decode;
    if !wanted.is_finite() || wanted <= 0.0 || duals == 0 {
        return current;
    }
    let total = (fixed_prefills + fixed_decodes + duals) as f64;
    let share = needs.prefill.max(0.0) / wanted;
    let on_prefill = (total * share).round() as usize;
    // At least one engine on each duty, counting the fixed ones.
    let low = usize::from(fixed_prefills == 0);
    let high = duals
        .saturating_sub(usize::from(fixed_decodes == 0))
        .max(low);
    on_prefill.saturating_sub(fixed_prefills).clamp(low, high)
}

/// One step from `current` toward `target`: engines move one at a time.
pub fn step_toward(current: usize, target: usize) -> usize {
    match current.cmp(&target) {
        std::cmp::Ordering::Less => current + 1,
        std::cmp::Ordering::Greater => current - 1,
        std::cmp::Ordering::Equal => current,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn needs(prefill: f64, decode: f64) -> Needs {
        Needs { prefill, decode }
    }

    #[test]
    fn the_split_follows_the_ratio_of_the_needs() {
        // Four duals alone: 3 to 1 needs, 3 to 1 duties; even needs, even duties.
        assert_eq!(dual_prefills(needs(3.0, 1.0), 0, 0, 4, 2), 3);
        assert_eq!(dual_prefills(needs(1.0, 1.0), 0, 0, 4, 3), 2);
        assert_eq!(dual_prefills(needs(1.0, 5.0), 0, 0, 4, 2), 1);
        // Beside 2 prefill-only engines and 2 decode-only: 6 to 2 needs over 8 engines is 6
        // prefills, so 4 of the duals.
        assert_eq!(dual_prefills(needs(6.0, 2.0), 2, 2, 4, 2), 4);
        assert_eq!(dual_prefills(needs(1.0, 3.0), 2, 2, 4, 2), 0);
    }

    #[test]
    fn each_duty_keeps_an_engine() {
        // Needs all on one side: one engine stays on the other when no fixed engine holds it.
        assert_eq!(dual_prefills(needs(10.0, 0.0), 0, 0, 4, 2), 3);
        assert_eq!(dual_prefills(needs(0.0, 10.0), 0, 0, 4, 2), 1);
        // A fixed decode holds the decode side: every dual may take prefill duty.
        assert_eq!(dual_prefills(needs(10.0, 0.0), 0, 1, 4, 2), 4);
        // A pool of one dual and a fixed prefill: the dual decodes.
        assert_eq!(dual_prefills(needs(5.0, 1.0), 1, 0, 1, 0), 0);
    }

    #[test]
    fn needs_of_nothing_keep_the_split() {
        assert_eq!(dual_prefills(needs(0.0, 0.0), 0, 0, 4, 3), 3);
        assert_eq!(dual_prefills(needs(f64::NAN, 1.0), 0, 0, 4, 3), 3);
        assert_eq!(dual_prefills(needs(1.0, 1.0), 1, 1, 0, 0), 0);
    }

    #[test]
    fn engines_move_one_at_a_time() {
        assert_eq!(step_toward(1, 4), 2);
        assert_eq!(step_toward(3, 1), 2);
        assert_eq!(step_toward(2, 2), 2);
    }
}
