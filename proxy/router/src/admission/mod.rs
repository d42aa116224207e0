//! Admission under overload: while every engine that could take a request is saturated
//! ([`crate::saturation`]), a request waits in a bounded queue in front of the placement
//! instead of piling up in the engines' own queues, and is let in as soon as an engine has
//! room; one that cannot get in within its time is refused with 429 and `Retry-After`.
//!
//! - **Who waits**: nobody while the pool has room and nobody waits. A sheddable request
//!   (negative priority) is refused at once when it would have to wait; the others queue.
//! - **In what order** ([`queue`]): priority band first, then the tenants of a band in turn
//!   (fair queueing: a tenant sending ten times the others gets its turn, not ten), then
//!   arrival.
//! - **How long**: at most `--admission-max-wait`, never past the request's own deadline.
//! - **How many**: at most `--admission-queue-length`; when full, a request displaces the
//!   newest of the busiest tenant of a lower band, else it is refused.
//! - **How fast they leave**: one at a time, each after the previous one was placed (its
//!   calls counted on its engines), so the saturation estimate sees it before the next.
//!
//! A request's class (priority, tenant, latency targets) comes from its headers
//! ([`class`]). The dispatcher ([`Admission::run`]) is one task per router.

pub mod class;
mod queue;
pub mod settings;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, Notify};

pub use self::class::{RequestClass, Targets};
use self::queue::FairQueue;
pub use self::settings::AdmissionConfig;
use crate::metrics::AdmissionMetrics;
use crate::sync::lock;

/// How often the dispatcher looks again while requests wait and nothing woke it (the
/// engines' saturation changes as their requests end, which does not wake it).
const RECHECK: Duration = Duration::from_millis(5);
/// How long the dispatcher waits for a request it let in to be placed before the next.
const PLACING: Duration = Duration::from_millis(50);

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShedReason {
    /// Sheddable (negative priority), and the pool is saturated.
    Sheddable,
    /// The queue is full of requests of its priority or higher.
    QueueFull,
    /// It waited, and a request of higher priority took its place.
    Displaced,
    /// It waited as long as it may (`--admission-max-wait`, or its deadline).
    Timeout,
    /// Sheddable, and no engine is predicted to meet its latency targets.
    Targets,
}

impl ShedReason {
    /// Every reason, in label order.
    pub const ALL: [ShedReason; 5] = [
        ShedReason::Sheddable,
        ShedReason::QueueFull,
        ShedReason::Displaced,
        ShedReason::Timeout,
        ShedReason::Targets,
    ];

    /// The `reason` label.
    pub fn as_str(self) -> &'static str {
        match self {
            ShedReason::Sheddable => "sheddable",
            ShedReason::QueueFull => "queue_full",
            ShedReason::Displaced => "displaced",
            ShedReason::Timeout => "timeout",
            ShedReason::Targets => "targets",
        }
    }
}

/// A request refused under overload: why, and when the client should try again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shed {
    /// Why.
    pub reason: ShedReason,
    /// The `Retry-After` to send (whole seconds, at least one).
    pub retry_after: Duration,
}

impl Shed {
    /// What the client is told.
    pub fn message(&self) -> String {
        let why = match self.reason {
            ShedReason::Sheddable => {
                "every engine is saturated and the request is sheddable \
                                      (negative priority)"
            }
            ShedReason::QueueFull => "every engine is saturated and the admission queue is full",
            ShedReason::Displaced => {
                "a request of higher priority took this one's place in the \
                                      admission queue"
            }
            ShedReason::Timeout => {
                "every engine stayed saturated for as long as the request \
                                    could wait"
            }
            ShedReason::Targets => {
                "no engine is predicted to meet the request's latency targets \
                                    and the request is sheddable"
            }
        };
        format!(
            "the server is overloaded: {why}; retry after {} s",
            self.retry_after.as_secs()
        )
    }

    /// The `Retry-After` header's value.
    pub fn retry_after_secs(&self) -> u64 {
        self.retry_after.as_secs().max(1)
    }
}

/// A request let in: hold it until the request's calls are started (dropping it lets the
/// next waiting request in).
#[derive(Debug)]
pub struct Admitted {
    _placed: Option<oneshot::Sender<()>>,
    /// How long it waited in the queue (zero when it did not).
    pub waited: Duration,
}

/// One waiting request.
struct Waiter {
    model: Option<Arc<str>>,
    grant: oneshot::Sender<Result<oneshot::Sender<()>, ShedReason>>,
}

/// The waiting requests, and how many wait for each model.
#[derive(Default)]
struct Queued {
    fair: FairQueue<Waiter>,
    models: HashMap<Option<Arc<str>>, usize>,
}

impl Queued {
    fn push(&mut self, priority: i32, tenant: Arc<str>, id: u64, waiter: Waiter) {
        *self.models.entry(waiter.model.clone()).or_default() += 1;
        self.fair.push(priority, tenant, id, waiter);
    }

    fn left(&mut self, waiter: Option<Waiter>) -> Option<Waiter> {
        let waiter = waiter?;
        if let Some(count) = self.models.get_mut(&waiter.model) {
            *count -= 1;
            if *count == 0 {
                self.models.remove(&waiter.model);
            }
        }
        Some(waiter)
    }

    fn pop_first(&mut self, ready: impl FnMut(&Waiter) -> bool) -> Option<Waiter> {
        let waiter = self.fair.pop_first(ready);
        self.left(waiter)
    }

    fn remove(&mut self, id: u64) -> Option<Waiter> {
        let waiter = self.fair.remove(id);
        self.left(waiter)
    }

    fn displace_below(&mut self, priority: i32) -> Option<Waiter> {
        let waiter = self.fair.displace_below(priority);
        self.left(waiter)
    }

    /// Whether requests for `model` wait.
    fn waiting_for(&self, model: Option<&str>) -> bool {
        self.models.contains_key(&model.map(Arc::from))
    }
}

/// What the live page and `/ready` show of the queue.
#[derive(Debug, Clone, serde::Serialize, PartialEq)]
pub struct QueueState {
    /// Requests waiting.
    pub waiting: usize,
    /// The bound.
    pub capacity: usize,
    /// Waiting per priority band, highest first.
    pub priorities: Vec<(i32, usize)>,
    /// Waiting per tenant.
    pub tenants: BTreeMap<String, usize>,
}

/// The admission queue of one router.
pub struct Admission {
    config: AdmissionConfig,
    queue: Mutex<Queued>,
    /// Requests waiting (read without the lock on the hot path).
    waiting: AtomicUsize,
    next_id: AtomicU64,
    wake: Notify,
    metrics: AdmissionMetrics,
}

impl Admission {
    /// An admission under `config`, counted in `metrics`.
    pub fn new(config: AdmissionConfig, metrics: AdmissionMetrics) -> Self {
        for reason in ShedReason::ALL {
            metrics.shed_reason(reason.as_str());
        }
        Admission {
            config,
            queue: Mutex::new(Queued::default()),
            waiting: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            wake: Notify::new(),
            metrics,
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &AdmissionConfig {
        &self.config
    }

    /// The class `headers` give a request (priority, tenant, latency targets). With the
    /// admission off, a header that cannot mean anything is ignored (logged), not refused.
    pub fn classify(&self, headers: &http::HeaderMap) -> Result<RequestClass, class::ClassError> {
        match RequestClass::of(headers, &self.config.objectives) {
            Err(err) if !self.config.enabled => {
                tracing::debug!(%err, "ignored: the admission is off");
                Ok(RequestClass::default())
            }
            classed => classed,
        }
    }

    /// Lets in a request of `class` for `model` that must be over by `deadline`; `saturated`:
    /// whether every engine that could take it is saturated now. Returns at once unless it
    /// must wait, and never past its deadline.
    pub async fn admit(
        &self,
        class: &RequestClass,
        model: Option<&str>,
        deadline: Instant,
        saturated: bool,
    ) -> Result<Admitted, Shed> {
        // Requests for the same model wait: this one waits its turn behind them.
        let behind =
            self.waiting.load(Ordering::Relaxed) > 0 && lock(&self.queue).waiting_for(model);
        if !self.config.enabled || (!saturated && !behind) {
            self.metrics.admitted(false);
            return Ok(Admitted {
                _placed: None,
                waited: Duration::ZERO,
            });
        }
        let tenant = self.metrics.tenant_label(&class.tenant);
        // A sheddable request never waits: refused whenever it would have to.
        if class.sheddable() {
            return Err(self.shed(ShedReason::Sheddable, class.priority, &tenant));
        }
        let (grant, granted) = oneshot::channel();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        {
            let mut queue = lock(&self.queue);
            if queue.fair.len() >= self.config.queue_length {
                match queue.displace_below(class.priority) {
                    Some(displaced) => {
                        let _ = displaced.grant.send(Err(ShedReason::Displaced));
                    }
                    None => {
                        drop(queue);
                        return Err(self.shed(ShedReason::QueueFull, class.priority, &tenant));
                    }
                }
            }
            let waiter = Waiter {
                model: model.map(Arc::from),
                grant,
            };
            queue.push(class.priority, class.tenant.clone(), id, waiter);
            self.update_gauges(&queue);
        }
        self.wake.notify_one();
        let enqueued = Instant::now();
        let limit = deadline
            .saturating_duration_since(enqueued)
            .min(self.config.max_wait);
        // Takes it out of the queue if it is still there when its wait ends, or when the
        // request goes away (this future dropped).
        let left = Leave {
            admission: self,
            id,
        };
        let outcome = tokio::select! {
            answer = granted => answer.unwrap_or(Err(ShedReason::Displaced)),
            () = tokio::time::sleep(limit) => Err(ShedReason::Timeout),
        };
        let waited = enqueued.elapsed();
        self.metrics.waited(class.priority, &tenant, waited);
        match outcome {
            Ok(placed) => {
                drop(left);
                self.metrics.admitted(true);
                Ok(Admitted {
                    _placed: Some(placed),
                    waited,
                })
            }
            Err(reason) => {
                drop(left);
                Err(self.shed(reason, class.priority, &tenant))
            }
        }
    }

    /// Counts and words a refusal.
    fn shed(&self, reason: ShedReason, priority: i32, tenant: &str) -> Shed {
        self.metrics.shed(reason.as_str(), priority, tenant);
        Shed {
            reason,
            retry_after: self.config.retry_after,
        }
    }

    /// Counts a sheddable request refused because no engine meets its targets.
    pub fn shed_for_targets(&self, class: &RequestClass) -> Shed {
        let tenant = self.metrics.tenant_label(&class.tenant);
        self.shed(ShedReason::Targets, class.priority, &tenant)
    }

    /// What waits now.
    pub fn state(&self) -> QueueState {
        let queue = &lock(&self.queue).fair;
        QueueState {
            waiting: queue.len(),
            capacity: self.config.queue_length,
            priorities: queue.lengths(),
            tenants: (queue.tenants().into_iter())
                .map(|(tenant, n)| (tenant.to_string(), n))
                .collect(),
        }
    }

    fn update_gauges(&self, queue: &Queued) {
        let queue = &queue.fair;
        self.waiting.store(queue.len(), Ordering::Relaxed);
        self.metrics
            .queue_lengths(&queue.lengths(), &queue.tenants());
    }

    /// The dispatcher: lets waiting requests in, one at a time, while `saturated` (whether
    /// every engine that could take a request for a model is saturated) says there is room.
    /// Runs until aborted.
    pub async fn run(self: Arc<Self>, saturated: impl Fn(Option<&str>) -> bool) {
        loop {
            if self.waiting.load(Ordering::Relaxed) == 0 {
                self.wake.notified().await;
                continue;
            }
            let next = {
                let mut queue = lock(&self.queue);
                // Each model's pool judged once per look.
                let mut judged: HashMap<Option<Arc<str>>, bool> = HashMap::new();
                let next = queue.pop_first(|waiter| {
                    let full = *(judged.entry(waiter.model.clone()))
                        .or_insert_with(|| saturated(waiter.model.as_deref()));
                    !full && !waiter.grant.is_closed()
                });
                if next.is_some() {
                    self.update_gauges(&queue);
                }
                next
            };
            let Some(waiter) = next else {
                self.drop_gone();
                tokio::select! {
                    () = self.wake.notified() => {}
                    () = tokio::time::sleep(RECHECK) => {}
                }
                continue;
            };
            let (placed, placing) = oneshot::channel();
            if waiter.grant.send(Ok(placed)).is_ok() {
                // Until it is placed (its guard dropped), or a bound.
                let _ = tokio::time::timeout(PLACING, placing).await;
            }
        }
    }

    /// Takes out the requests whose clients went away.
    fn drop_gone(&self) {
        let mut queue = lock(&self.queue);
        while queue.pop_first(|waiter| waiter.grant.is_closed()).is_some() {}
        self.update_gauges(&queue);
    }
}

/// Takes a request out of the queue when its wait ends (a no-op when it was let in).
struct Leave<'a> {
    admission: &'a Admission,
    id: u64,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        let mut queue = lock(&self.admission.queue);
        if queue.remove(self.id).is_some() {
            self.admission.update_gauges(&queue);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    fn admission(queue_length: usize) -> Arc<Admission> {
        let config = AdmissionConfig {
            queue_length,
            max_wait: Duration::from_millis(300),
            ..AdmissionConfig::default()
        };
        let metrics = AdmissionMetrics::new(&prometheus::Registry::new());
        Arc::new(Admission::new(config, metrics))
    }

    fn class(priority: i32, tenant: &str) -> RequestClass {
        RequestClass {
            priority,
            tenant: Arc::from(tenant),
            ..RequestClass::default()
        }
    }

    #[tokio::test]
    async fn waits_while_saturated_then_lets_in_by_priority_and_sheds_what_cannot_wait() {
        let admission = admission(2);
        let full = Arc::new(AtomicBool::new(true));
        let dispatcher = tokio::spawn({
            let full = full.clone();
            (admission.clone()).run(move |_| full.load(Ordering::Relaxed))
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        // Room and nobody waiting: in at once.
        let direct = admission.admit(&class(0, "a"), None, deadline, false).await;
        assert_eq!(direct.unwrap().waited, Duration::ZERO);
        // Saturated: a sheddable request is refused at once.
        let shed = admission.admit(&class(-1, "a"), None, deadline, true).await;
        assert_eq!(shed.unwrap_err().reason, ShedReason::Sheddable);
        // Two wait; a third of higher priority displaces the lower one; a fourth is refused.
        let low = tokio::spawn({
            let admission = admission.clone();
            async move { admission.admit(&class(0, "a"), None, deadline, true).await }
        });
        let mid = tokio::spawn({
            let admission = admission.clone();
            async move { admission.admit(&class(1, "b"), None, deadline, true).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let high = tokio::spawn({
            let admission = admission.clone();
            async move { admission.admit(&class(2, "c"), None, deadline, true).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let full_queue = admission.admit(&class(0, "d"), None, deadline, true).await;
        assert_eq!(full_queue.unwrap_err().reason, ShedReason::QueueFull);
        assert_eq!(
            low.await.unwrap().unwrap_err().reason,
            ShedReason::Displaced
        );
        assert_eq!(admission.state().priorities, vec![(2, 1), (1, 1)]);
        // Room again: both let in, the higher first.
        full.store(false, Ordering::Relaxed);
        let high = high.await.unwrap().unwrap();
        assert!(high.waited > Duration::ZERO);
        drop(high);
        drop(mid.await.unwrap().unwrap());
        assert_eq!(admission.state().waiting, 0);
        // Saturated for longer than the wait: refused when the wait is over, not later.
        full.store(true, Ordering::Relaxed);
        let started = Instant::now();
        let late = admission.admit(&class(0, "a"), None, deadline, true).await;
        assert_eq!(late.unwrap_err().reason, ShedReason::Timeout);
        assert!(started.elapsed() < Duration::from_millis(600));
        // A deadline sooner than the wait bounds it.
        let soon = Instant::now() + Duration::from_millis(50);
        let started = Instant::now();
        let late = admission.admit(&class(0, "a"), None, soon, true).await;
        assert_eq!(late.unwrap_err().reason, ShedReason::Timeout);
        assert!(started.elapsed() < Duration::from_millis(250));
        assert_eq!(admission.state().waiting, 0);
        dispatcher.abort();
    }

    #[tokio::test]
    async fn a_model_with_room_is_not_held_back_by_another_models_queue() {
        let admission = admission(8);
        let busy = |model: Option<&str>| model == Some("x");
        let dispatcher = tokio::spawn((admission.clone()).run(busy));
        let deadline = Instant::now() + Duration::from_secs(5);
        let waiting = tokio::spawn({
            let admission = admission.clone();
            async move {
                admission
                    .admit(&class(0, "a"), Some("x"), deadline, true)
                    .await
            }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        // Y's engines have room and nothing waits for Y: in at once, sheddable or not.
        let y = admission
            .admit(&class(-1, "a"), Some("y"), deadline, false)
            .await;
        assert_eq!(y.unwrap().waited, Duration::ZERO);
        // The same tenant's request for Y behind its request for X is let in by the
        // dispatcher (Y is saturated for a moment when it arrives).
        let y = admission
            .admit(&class(0, "a"), Some("y"), deadline, true)
            .await;
        assert!(y.is_ok());
        assert_eq!(admission.state().waiting, 1);
        waiting.abort();
        dispatcher.abort();
    }

    #[tokio::test]
    async fn a_request_that_goes_away_leaves_the_queue() {
        let admission = admission(4);
        let deadline = Instant::now() + Duration::from_secs(5);
        let waiting = tokio::spawn({
            let admission = admission.clone();
            async move { admission.admit(&class(0, "a"), None, deadline, true).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(admission.state().waiting, 1);
        waiting.abort();
        let _ = waiting.await;
        assert_eq!(admission.state().waiting, 0);
    }
}
