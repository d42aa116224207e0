//! One engine's step loop under the engine model: the requests waiting and running, what each
//! step computes (every decode one token, then prompt chunks first come first served within the
//! token budget), its time, and each request's tokens as they come.
//!
//! A request holds the KV of its context (its cached and computed prompt tokens, then one more
//! per token generated). One that does not fit waits; a decode step that would overflow the
//! capacity preempts the request admitted last, whose prompt and tokens so far are recomputed
//! when it is admitted again (vLLM's recompute preemption). Steps keep their own clock: a step
//! ends `time / time scale` after the one before, so timer rounding never adds up.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use super::Coefficients;

/// A request that cannot fit the KV cache even alone.
#[derive(Debug, thiserror::Error)]
#[error("the prompt and max_tokens need {needed} KV tokens; the engine model holds {capacity}")]
pub struct TooLong {
    /// Tokens needed.
    pub needed: u64,
    /// Tokens the cache holds.
    pub capacity: u64,
}

/// What the loop reports, as an engine's `/metrics` does.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Load {
    /// Requests in the running batch.
    pub running: usize,
    /// Requests waiting to enter it.
    pub waiting: usize,
    /// KV tokens held.
    pub kv_tokens: u64,
    /// Requests preempted so far.
    pub preemptions: u64,
    /// Steps run so far.
    pub steps: u64,
}

/// One engine's step loop (it runs as long as the runtime).
#[derive(Clone)]
pub struct Steps {
    shared: Arc<Shared>,
}

struct Shared {
    model: Coefficients,
    /// Requests running at most (0: no limit).
    max_seqs: usize,
    time_scale: f64,
    state: Mutex<State>,
    work: Notify,
}

#[derive(Default)]
struct State {
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    kv_used: u64,
    preemptions: u64,
    steps: u64,
}

struct Seq {
    prompt: u32,
    /// Tokens to compute before the next token comes (the prompt; after a preemption, the
    /// prompt and the tokens generated).
    target: u32,
    /// KV tokens held.
    context: u32,
    generated: u32,
    total: u32,
    progress: watch::Sender<u32>,
}

impl Seq {
    fn decoding(&self) -> bool {
        self.context >= self.target
    }
}

/// A request's tokens as the steps make them: the count so far.
pub type Progress = watch::Receiver<u32>;

/// What a step does to one running request.
enum Work {
    Chunk(u32),
    Decode,
}

impl Steps {
    /// Starts the loop of an engine of `model`, at most `max_seqs` running (0: no limit).
    pub fn start(model: Coefficients, max_seqs: usize, time_scale: f64) -> Self {
        let shared = Arc::new(Shared {
            model,
            max_seqs,
            time_scale,
            state: Mutex::new(State::default()),
            work: Notify::new(),
        });
        tokio::spawn(run(shared.clone()));
        Steps { shared }
    }

    /// Refuses a request of `prompt` tokens and `total` to generate that can never fit.
    pub fn check_fits(&self, prompt: u32, total: u32) -> Result<(), TooLong> {
        let needed = u64::from(prompt) + u64::from(total);
        let capacity = self.shared.model.kv_capacity_tokens;
        match needed <= capacity {
            true => Ok(()),
            false => Err(TooLong { needed, capacity }),
        }
    }

    /// Queues a request of `prompt` tokens, `cached` of them already held (a prefix cache hit,
    /// or KV pulled from a prefill), to make `total` tokens (at least one: the prefill's).
    /// Dropping the receiver cancels it.
    pub fn submit(&self, prompt: u32, cached: u32, total: u32) -> Progress {
        let (progress, receiver) = watch::channel(0);
        let seq = Seq {
            prompt,
            target: prompt,
            context: cached.min(prompt),
            generated: 0,
            total: total.max(1),
            progress,
        };
        self.shared.lock().waiting.push_back(seq);
        self.shared.work.notify_one();
        receiver
    }

    /// The loop's requests and KV now.
    pub fn load(&self) -> Load {
        let state = self.shared.lock();
        Load {
            running: state.running.len(),
            waiting: state.waiting.len(),
            kv_tokens: state.kv_used,
            preemptions: state.preemptions,
            steps: state.steps,
        }
    }

    /// The KV capacity in tokens.
    pub fn capacity(&self) -> u64 {
        self.shared.model.kv_capacity_tokens
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

async fn run(shared: Arc<Shared>) {
    let mut clock = Instant::now();
    loop {
        let planned = shared.lock().plan(&shared.model, shared.max_seqs);
        let Some((work, ms)) = planned else {
            shared.work.notified().await;
            clock = Instant::now();
            continue;
        };
        // A loop starved of CPU catches up at most a second: past that the engine is slower.
        let behind = Instant::now().checked_sub(Duration::from_secs(1));
        clock = clock.max(behind.unwrap_or(clock));
        clock += Duration::from_secs_f64(ms / 1e3 / shared.time_scale);
        tokio::time::sleep_until(clock).await;
        shared.lock().apply(&work);
    }
}

impl State {
    /// Plans the next step: the work of each running request (by index) and the step's time
    /// in ms; none when there is nothing to do.
    fn plan(&mut self, model: &Coefficients, max_seqs: usize) -> Option<(Vec<Work>, f64)> {
        self.drop_cancelled();
        loop {
            let decodes = self.running.iter().filter(|s| s.decoding()).count() as u64;
            if self.kv_used + decodes <= model.kv_capacity_tokens || self.running.len() <= 1 {
                break;
            }
            self.preempt_last();
        }
        loop {
            self.admit(model, max_seqs);
            let (work, ms) = self.work(model);
            if work.iter().any(|w| !matches!(w, Work::Chunk(0))) {
                return Some((work, ms));
            }
            if self.running.is_empty() {
                return None;
            }
            // Prompts part computed fill the cache and none can go on: the last one yields.
            self.preempt_last();
        }
    }

    /// Moves waiting requests into the batch while there is room, first come first served.
    fn admit(&mut self, model: &Coefficients, max_seqs: usize) {
        while let Some(next) = self.waiting.front() {
            let free = model.kv_capacity_tokens.saturating_sub(self.kv_used);
            let full = max_seqs > 0 && self.running.len() >= max_seqs;
            // Its cached KV and its first chunk (or its first token) must fit.
            let first = (next.target - next.context).min(model.token_budget).max(1);
            if full || u64::from(next.context) + u64::from(first) > free {
                return;
            }
            let seq = self.waiting.pop_front().expect("a front");
            self.kv_used += u64::from(seq.context);
            self.running.push(seq);
        }
    }

    /// Each running request's work this step and the step's time.
    fn work(&self, model: &Coefficients) -> (Vec<Work>, f64) {
        let mut budget = model.token_budget;
        let mut free = model.kv_capacity_tokens.saturating_sub(self.kv_used);
        let (mut batch, mut context, mut chunks_ms, mut chunks) = (0usize, 0u64, 0.0, false);
        let mut work: Vec<Work> = self
            .running
            .iter()
            .map(|seq| match seq.decoding() {
                true => {
                    batch += 1;
                    context += u64::from(seq.context);
                    budget = budget.saturating_sub(1);
                    free = free.saturating_sub(1);
                    Work::Decode
                }
                false => Work::Chunk(0),
            })
            .collect();
        for (seq, slot) in self.running.iter().zip(work.iter_mut()) {
            if let Work::Chunk(k) = slot {
                let room = u32::try_from(free).unwrap_or(u32::MAX);
                *k = (seq.target - seq.context).min(budget).min(room);
                budget -= *k;
                free -= u64::from(*k);
                if *k > 0 {
                    chunks = true;
                    chunks_ms += model.chunk_ms(seq.context, *k);
                }
            }
        }
        let fixed = match (chunks, batch > 0) {
            (true, true) => model.c0_ms.max(model.w_ms),
            (true, false) => model.c0_ms,
            (false, true) => model.w_ms,
            (false, false) => 0.0,
        };
        let decode = match batch {
            0 => 0.0,
            b => model.decode_ms(context, b) - model.w_ms,
        };
        (work, fixed + chunks_ms + decode)
    }

    /// Applies a step's work: chunks computed, tokens made; finished requests leave.
    fn apply(&mut self, work: &[Work]) {
        self.steps += 1;
        for (seq, work) in self.running.iter_mut().zip(work) {
            let token = match work {
                Work::Decode => {
                    seq.context += 1;
                    self.kv_used += 1;
                    true
                }
                Work::Chunk(k) => {
                    seq.context += k;
                    self.kv_used += u64::from(*k);
                    *k > 0 && seq.decoding()
                }
            };
            if token {
                seq.generated += 1;
                seq.progress.send_replace(seq.generated);
            }
        }
        let kv_used = &mut self.kv_used;
        self.running.retain(|seq| {
            let stays = seq.generated < seq.total && !seq.progress.is_closed();
            if !stays {
                *kv_used -= u64::from(seq.context);
            }
            stays
        });
    }

    fn drop_cancelled(&mut self) {
        self.waiting.retain(|seq| !seq.progress.is_closed());
        let kv_used = &mut self.kv_used;
        self.running.retain(|seq| {
            let live = !seq.progress.is_closed();
            if !live {
                *kv_used -= u64::from(seq.context);
            }
            live
        });
    }

    /// Frees the KV of the request admitted last; it waits first in line to be recomputed.
    fn preempt_last(&mut self) {
        if let Some(mut seq) = self.running.pop() {
            self.kv_used -= u64::from(seq.context);
            seq.target = seq.prompt + seq.generated;
            seq.context = 0;
            self.preemptions += 1;
            self.waiting.push_front(seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::model::Preset;

    fn model(capacity: u64, budget: u32) -> Coefficients {
        Coefficients {
            c0_ms: 1.0,
            k_lin_ms: 0.01,
            k_att_ms: 0.0,
            w_ms: 5.0,
            ctx_ms: 0.001,
            c_ms: 0.1,
            token_budget: budget,
            kv_capacity_tokens: capacity,
        }
    }

    async fn finished(mut progress: Progress, total: u32) -> Instant {
        progress
            .wait_for(|n| *n >= total)
            .await
            .expect("the tokens come");
        Instant::now()
    }

    #[tokio::test(start_paused = true)]
    async fn a_prefill_alone_takes_the_formula_and_chunks_share_the_budget() {
        let steps = Steps::start(model(1_000_000, 1000), 0, 1.0);
        let start = Instant::now();
        // 3000 tokens, 1000 cached: 2 chunks of 1000, each c0 + 10 ms.
        let done = finished(steps.submit(3000, 1000, 1), 1).await;
        let took = (done - start).as_secs_f64() * 1e3;
        assert!((22.0..23.0).contains(&took), "{took}");
        assert_eq!(
            steps.load(),
            Load {
                steps: 2,
                ..Load::default()
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_decode_step_grows_with_the_batch_and_its_context() {
        let steps = Steps::start(model(1_000_000, 8192), 0, 2.0);
        let start = Instant::now();
        let (a, b) = (steps.submit(100, 100, 10), steps.submit(300, 300, 10));
        let (a, b) = tokio::join!(finished(a, 10), finished(b, 10));
        assert_eq!(a, b);
        // Ten steps of 5 + 0.001 × (400 + growing) + 0.1 × 2 ms, halved by the time scale.
        let ms: f64 = (0..10)
            .map(|i| 5.0 + 0.001 * f64::from(400 + 2 * i) + 0.2)
            .sum();
        let took = (a - start).as_secs_f64() * 1e3;
        assert!(
            (0.0..1.0).contains(&(took - ms / 2.0)),
            "{took} against {}",
            ms / 2.0
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_cache_makes_requests_wait_preempts_the_last_and_loses_none() {
        let steps = Steps::start(model(250, 8192), 0, 1.0);
        assert!(steps.check_fits(200, 51).is_err());
        let first = steps.submit(100, 100, 100);
        let second = steps.submit(100, 100, 100);
        tokio::task::yield_now().await;
        let (a, b) = tokio::join!(finished(first, 100), finished(second, 100));
        assert!(a < b, "the request preempted ends last");
        let load = steps.load();
        assert!(load.preemptions >= 1, "{load:?}");
        assert_eq!((load.running, load.waiting, load.kv_tokens), (0, 0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_request_frees_its_place() {
        let steps = Steps::start(model(1000, 8192), 1, 1.0);
        let gone = steps.submit(500, 500, 400);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let load = steps.load();
        assert!(load.steps > 0);
        assert_eq!(load.kv_tokens, 500 + load.steps);
        let next = steps.submit(10, 0, 1);
        drop(gone);
        let load_before = steps.load();
        assert_eq!(load_before.waiting, 1);
        finished(next, 1).await;
        assert_eq!(steps.load().kv_tokens, 0);
    }

    #[test]
    fn presets_fit_a_long_conversation_prompt() {
        let steps_model = Preset::Llama3_8bH200.coefficients();
        // The Mooncake conversation trace's mean prompt, whole, in about 0.3 s on H200.
        let ms = steps_model.prefill_ms(12_035, 0);
        assert!((250.0..400.0).contains(&ms), "{ms}");
    }
}
