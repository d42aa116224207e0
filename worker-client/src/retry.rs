//! Bounded retries with exponential backoff and jitter (the schedule comes from `backon`).

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use backon::{ExponentialBuilder, Retryable};

use crate::error::ClientError;

/// How a client retries: exponential backoff with full jitter between `initial_backoff` and
/// `max_backoff`, for at most the deadline of the call.
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
    /// The backoff schedule, as an iterator of pauses (for loops that are not one call).
    pub fn schedule(&self) -> impl Iterator<Item = Duration> {
        use backon::BackoffBuilder;
        self.builder(None).build()
    }

    fn builder(&self, total: Option<Duration>) -> ExponentialBuilder {
        ExponentialBuilder::default()
            .with_jitter()
            .with_factor(2.0)
            .with_min_delay(self.initial_backoff)
            .with_max_delay(self.max_backoff)
            .without_max_times()
            .with_total_delay(total)
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
            .retry(self.builder(Some(deadline)))
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
