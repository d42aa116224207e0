//! [`Runs`]: the walk behind `match_prefix`. The engines still holding every block so far are
//! a bitset; at each block it keeps only the block's holders, and an engine leaving it at block
//! `i` held `i` leading blocks. The cost per block is one pass over the bitset's words (16 for
//! 1,000 engines), whatever the number of holders.

use super::holders::View;
use super::EngineSlot;

/// The engines whose run continues, and the runs that ended.
pub(super) struct Runs {
    alive: Vec<u64>,
    /// The words of `alive` that may be non-zero.
    live: std::ops::Range<usize>,
    ended: Vec<(EngineSlot, usize)>,
}

impl Runs {
    /// Begins with the first block's holders, among engine slots below `slots`.
    pub(super) fn start(first: View<'_>, slots: usize) -> Self {
        let mut alive = vec![0u64; slots.div_ceil(64)];
        match first {
            View::Few(engines) => {
                for &e in engines {
                    if let Some(w) = alive.get_mut((e / 64) as usize) {
                        *w |= 1 << (e % 64);
                    }
                }
            }
            View::Bits(words) => {
                for (a, &w) in alive.iter_mut().zip(words) {
                    *a = w;
                }
            }
        }
        let count = alive.iter().map(|w| w.count_ones() as usize).sum();
        let mut runs = Runs {
            live: 0..alive.len(),
            alive,
            ended: Vec::with_capacity(count),
        };
        runs.shrink();
        runs
    }

    /// Whether no run continues.
    pub(super) fn is_done(&self) -> bool {
        self.live.is_empty()
    }

    /// Block `block` (counted from 0) is held by `holders` (`None`: by no engine).
    pub(super) fn next(&mut self, block: usize, holders: Option<View<'_>>) {
        match holders {
            None => self.retain(block, |_| 0),
            Some(View::Bits(words)) => {
                self.retain(block, |w| words.get(w).copied().unwrap_or(0));
            }
            Some(View::Few(engines)) => self.retain(block, |w| {
                engines
                    .iter()
                    .filter(|&&e| (e / 64) as usize == w)
                    .fold(0, |bits, &e| bits | 1 << (e % 64))
            }),
        }
    }

    /// Keeps, in each word `w` of the bitset, the bits of `keep(w)`; the others end at `block`.
    fn retain(&mut self, block: usize, keep: impl Fn(usize) -> u64) {
        for w in self.live.clone() {
            let alive = self.alive[w];
            let kept = alive & keep(w);
            if kept != alive {
                self.alive[w] = kept;
                let mut ended = alive & !kept;
                while ended != 0 {
                    let engine = w as u32 * 64 + ended.trailing_zeros();
                    self.ended.push((EngineSlot(engine), block));
                    ended &= ended - 1;
                }
            }
        }
        self.shrink();
    }

    /// Drops the zero words at both ends of the live range.
    fn shrink(&mut self) {
        let Runs { alive, live, .. } = self;
        while live.start < live.end && alive[live.start] == 0 {
            live.start += 1;
        }
        while live.end > live.start && alive[live.end - 1] == 0 {
            live.end -= 1;
        }
    }

    /// The runs: those still going held all `blocks`; longest first.
    pub(super) fn finish(mut self, blocks: usize) -> Vec<(EngineSlot, usize)> {
        self.retain(blocks, |_| 0);
        self.ended.reverse();
        self.ended
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_end_where_holders_stop() {
        let first: Vec<u64> = vec![0b1011, 1 << 6];
        let mut runs = Runs::start(View::Bits(&first), 128);
        runs.next(1, Some(View::Few(&[0, 1, 70])));
        runs.next(2, Some(View::Bits(&[0b1])));
        assert!(!runs.is_done());
        runs.next(3, None);
        assert!(runs.is_done());
        let got = runs.finish(4);
        assert_eq!(got[0], (EngineSlot(0), 3));
        let mut rest = got[1..].to_vec();
        rest.sort();
        assert_eq!(
            rest,
            [(EngineSlot(1), 2), (EngineSlot(3), 1), (EngineSlot(70), 2)]
        );
    }
}
