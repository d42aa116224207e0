//! The waiting requests, in the order they are let in: by priority band first (higher first),
//! then tenant by tenant in turn inside a band (round robin over the tenants that have
//! requests waiting: each gets one request let in per round, however many it sent), and in
//! arrival order inside a tenant. A pure data structure; [`super::Admission`] locks it.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

/// One waiting request: its id (to find it again) and what the admission keeps of it.
struct Entry<T> {
    id: u64,
    item: T,
}

/// The tenants of one priority band with requests waiting, and whose turn is next.
struct Band<T> {
    waiting: HashMap<Arc<str>, VecDeque<Entry<T>>>,
    /// The tenants with requests waiting, the next to be served first.
    turn: VecDeque<Arc<str>>,
}

impl<T> Default for Band<T> {
    fn default() -> Self {
        Band {
            waiting: HashMap::new(),
            turn: VecDeque::new(),
        }
    }
}

/// Waiting requests by priority band and tenant.
pub(crate) struct FairQueue<T> {
    /// Bands by priority, highest last (iterated in reverse).
    bands: BTreeMap<i32, Band<T>>,
    len: usize,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        FairQueue {
            bands: BTreeMap::new(),
            len: 0,
        }
    }
}

impl<T> FairQueue<T> {
    /// How many requests wait.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// How many wait in each priority band, highest first.
    pub(crate) fn lengths(&self) -> Vec<(i32, usize)> {
        (self.bands.iter().rev())
            .map(|(priority, band)| (*priority, band.waiting.values().map(VecDeque::len).sum()))
            .collect()
    }

    /// How many wait per tenant (all bands).
    pub(crate) fn tenants(&self) -> BTreeMap<Arc<str>, usize> {
        let mut tenants = BTreeMap::new();
        for band in self.bands.values() {
            for (tenant, entries) in &band.waiting {
                *tenants.entry(tenant.clone()).or_default() += entries.len();
            }
        }
        tenants
    }

    /// Queues `item` (id `id`) of `tenant` at `priority`, behind the tenant's earlier ones.
    pub(crate) fn push(&mut self, priority: i32, tenant: Arc<str>, id: u64, item: T) {
        let band = self.bands.entry(priority).or_default();
        let entries = band.waiting.entry(tenant.clone()).or_default();
        if entries.is_empty() {
            band.turn.push_back(tenant);
        }
        entries.push_back(Entry { id, item });
        self.len += 1;
    }

    /// Takes the first request in order that `ready` accepts: band by band, tenant by tenant
    /// in turn, each tenant's oldest that `ready` accepts (one it refuses, say for a model
    /// whose engines are all busy, does not hold back the tenant's others); the tenant served
    /// goes to the end of its band's turn.
    pub(crate) fn pop_first(&mut self, mut ready: impl FnMut(&T) -> bool) -> Option<T> {
        for (priority, band) in self.bands.iter_mut().rev() {
            let found = band.turn.iter().enumerate().find_map(|(position, tenant)| {
                let entries = band.waiting.get(tenant)?;
                let index = entries.iter().position(|entry| ready(&entry.item))?;
                Some((position, index))
            });
            let Some((position, index)) = found else {
                continue;
            };
            let tenant = band
                .turn
                .remove(position)
                .expect("a position found in turn");
            let entries = band
                .waiting
                .get_mut(&tenant)
                .expect("a tenant in turn waits");
            let entry = entries.remove(index).expect("an index found");
            if entries.is_empty() {
                band.waiting.remove(&tenant);
            } else {
                band.turn.push_back(tenant);
            }
            let priority = *priority;
            self.len -= 1;
            self.drop_if_empty(priority);
            return Some(entry.item);
        }
        None
    }

    /// Takes out the request `id`, if it still waits.
    pub(crate) fn remove(&mut self, id: u64) -> Option<T> {
        let (priority, tenant, index) = self.bands.iter().find_map(|(priority, band)| {
            band.waiting.iter().find_map(|(tenant, entries)| {
                let index = entries.iter().position(|entry| entry.id == id)?;
                Some((*priority, tenant.clone(), index))
            })
        })?;
        Some(self.take(priority, &tenant, index))
    }

    /// Makes room for a request at `priority`: takes out the newest request of the tenant with
    /// the most waiting in the lowest band below `priority`, if there is such a band.
    pub(crate) fn displace_below(&mut self, priority: i32) -> Option<T> {
        let (lowest, band) = self.bands.iter().next()?;
        if *lowest >= priority {
            return None;
        }
        let (tenant, entries) = band.waiting.iter().max_by_key(|(_, e)| e.len())?;
        let (lowest, tenant, index) = (*lowest, tenant.clone(), entries.len() - 1);
        Some(self.take(lowest, &tenant, index))
    }

    fn take(&mut self, priority: i32, tenant: &Arc<str>, index: usize) -> T {
        let band = self.bands.get_mut(&priority).expect("a band found");
        let entries = band.waiting.get_mut(tenant).expect("a tenant found");
        let entry = entries.remove(index).expect("an index found");
        if entries.is_empty() {
            band.waiting.remove(tenant);
            band.turn.retain(|t| t != tenant);
        }
        self.len -= 1;
        self.drop_if_empty(priority);
        entry.item
    }

    fn drop_if_empty(&mut self, priority: i32) {
        if self
            .bands
            .get(&priority)
            .is_some_and(|b| b.waiting.is_empty())
        {
            self.bands.remove(&priority);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(entries: &[(i32, &str, u64)]) -> FairQueue<u64> {
        let mut queue = FairQueue::default();
        for (priority, tenant, id) in entries {
            queue.push(*priority, Arc::from(*tenant), *id, *id);
        }
        queue
    }

    fn drain(queue: &mut FairQueue<u64>) -> Vec<u64> {
        std::iter::from_fn(|| queue.pop_first(|_| true)).collect()
    }

    #[test]
    fn higher_bands_first_then_tenants_in_turn_then_arrival() {
        // The noisy tenant sent five before the others sent one each.
        let mut queue = queue(&[
            (0, "noisy", 1),
            (0, "noisy", 2),
            (0, "noisy", 3),
            (0, "noisy", 4),
            (0, "noisy", 5),
            (0, "a", 6),
            (0, "b", 7),
            (1, "b", 8),
            (-1, "a", 9),
        ]);
        assert_eq!(queue.len(), 9);
        assert_eq!(queue.lengths(), vec![(1, 1), (0, 7), (-1, 1)]);
        assert_eq!(drain(&mut queue), vec![8, 1, 6, 7, 2, 3, 4, 5, 9]);
        assert_eq!(queue.len(), 0);
        assert!(queue.lengths().is_empty());
    }

    #[test]
    fn a_request_not_ready_does_not_hold_back_the_others() {
        let mut queue = queue(&[(0, "a", 1), (0, "b", 2), (0, "a", 3)]);
        // The tenant's oldest ready one, then the next tenant's.
        assert_eq!(queue.pop_first(|id| *id != 1), Some(3));
        assert_eq!(queue.pop_first(|id| *id != 1), Some(2));
        assert_eq!(queue.pop_first(|id| *id != 1), None);
        assert_eq!(drain(&mut queue), vec![1]);
    }

    #[test]
    fn removal_and_displacement_take_the_right_ones() {
        let mut queue = queue(&[(0, "a", 1), (-2, "x", 2), (-2, "y", 3), (-2, "y", 4)]);
        assert_eq!(queue.remove(1), Some(1));
        assert_eq!(queue.remove(1), None);
        // Nothing below -2 to displace for a -2 request.
        assert_eq!(queue.displace_below(-2), None);
        // The newest of the tenant with the most waiting in the lowest band.
        assert_eq!(queue.displace_below(0), Some(4));
        assert_eq!(queue.tenants().len(), 2);
        assert_eq!(drain(&mut queue), vec![2, 3]);
    }
}
