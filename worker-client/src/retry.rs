//! Bounded retries with exponential backoff and jitter (`backon` runs them; the pauses, never
//! longer than the cap, are [`pd_service::backoff`]'s).

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use backon::Retryable;
use pd_service::backoff::Backoff;

use crate::error::ClientError;

/// How a client retries: pauses doubling from `initial_backoff` to `max_backoff`, each drawn
/// between half and all of its step (so never longer than `max_backoff`: a lease keep-alive
/// retried within its TTL stays within it), for at most the deadline of the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The first pause between attempts.
    pub initial_backoff: Duration,
    /// The longest pause between attempts.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
        }
    }
}

impl RetryPolicy {
    /// The backoff schedule, as an endless iterator of pauses (for loops that are not one
    /// call).
    pub fn schedule(&self) -> impl Iterator<Item = Duration> + Send + Sync + Unpin {
        Backoff::new(self.initial_backoff, self.max_backoff)
    }

    /// Runs `call` until it succeeds, fails with an error that is not retryable, or `deadline`
    /// has passed (then [`ClientError::DeadlineExceeded`] carries the last error). The deadline is
    /// strict: an attempt still running when it passes is abandoned.
    pub async fn run<T, F, Fut>(
        &self,
        url: &str,
        deadline: Duration,
        call: F,
    ) -> Result<T, ClientError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let started = Instant::now();
        let attempts = AtomicU32::new(0);
        let last_error: Mutex<Option<ClientError>> = Mutex::new(None);
        let mut call = call;
        let counted = || {
            attempts.fetch_add(1, Ordering::Relaxed);
            call()
        };
        let retried = counted
            .retry(self.schedule())
            .sleep(tokio::time::sleep)
            .when(ClientError::is_retryable)
            .notify(|err: &ClientError, pause: Duration| {
                tracing::warn!(%url, error = %err, retry_in = ?pause, "bootstrap call failed, retrying");
                *last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(err.clone());
            });
        let outcome = tokio::time::timeout(deadline, retried).await;
        let exceeded = |last: ClientError| ClientError::DeadlineExceeded {
            url: url.to_owned(),
            attempts: attempts.load(Ordering::Relaxed),
            elapsed: started.elapsed(),
            last: Box::new(last),
        };
        match outcome {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(err)) if err.is_retryable() => Err(exceeded(err)),
            Ok(Err(err)) => Err(err),
            Err(_elapsed) => {
                let last = last_error
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take()
                    .unwrap_or(ClientError::Timeout {
                        url: url.to_owned(),
                        timeout: deadline,
                    });
                Err(exceeded(last))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_pause_is_longer_than_the_cap() {
        let policy = RetryPolicy::default();
        let pauses: Vec<Duration> = policy.schedule().take(500).collect();
        assert!(pauses[0] <= policy.initial_backoff, "{:?}", pauses[0]);
        // backon's own jitter added up to one more step: pauses of up to twice the cap.
        assert!(
            pauses.iter().all(|p| *p <= policy.max_backoff),
            "{pauses:?}"
        );
        // Once at the cap, still spread below it (half to all of it).
        assert!(pauses[10..].iter().all(|p| *p >= policy.max_backoff / 2));
        assert!(pauses[10..].iter().any(|p| *p < policy.max_backoff * 3 / 4));
    }

    #[tokio::test]
    async fn attempts_are_never_further_apart_than_the_cap() {
        let policy = RetryPolicy {
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(80),
        };
        let attempts = Mutex::new(Vec::new());
        let outcome: Result<(), ClientError> = policy
            .run("http://test", Duration::from_millis(900), || async {
                attempts.lock().unwrap().push(Instant::now());
                Err(ClientError::Timeout {
                    url: "http://test".to_owned(),
                    timeout: Duration::ZERO,
                })
            })
            .await;
        assert!(matches!(outcome, Err(ClientError::DeadlineExceeded { .. })));
        let attempts = attempts.into_inner().unwrap();
        let gaps: Vec<Duration> = attempts.windows(2).map(|w| w[1] - w[0]).collect();
        // The timer's granularity and a busy machine's scheduling on top of the cap.
        assert!(
            gaps.iter()
                .all(|gap| *gap <= Duration::from_millis(80 + 40)),
            "{gaps:?}"
        );
        // 20, 40, then 80 ms steps: at least 10 attempts in 900 ms.
        assert!(attempts.len() >= 10, "{gaps:?}");
    }
}
