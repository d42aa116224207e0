//! [`BootstrapClient::watch`]: the registry's worker changes as a stream, built on
//! `GET /workers` and `GET /watch` long polls.

use std::time::Duration;

use futures_util::stream::{self, BoxStream, StreamExt};

use crate::client::BootstrapClient;
use crate::error::ClientError;
use pd_protocol::native::{WatchBatch, WorkerList};
use pd_protocol::Revision;

/// One item of [`BootstrapClient::watch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchUpdate {
    /// Every registered worker as of `revision`: first (unless a `since` was given), and again
    /// whenever the watcher fell behind the server's history (`410 Gone`, e.g. after a server
    /// restart). Replace everything known with it; the events that follow come after it.
    Snapshot(WorkerList),
    /// Changes after the previous update, oldest first (never empty); apply them in order.
    /// `revision` is where the stream stands: pass it as `since` to resume later.
    Events(WatchBatch),
}

/// The state of one watch stream between two items.
struct Watcher {
    client: BootstrapClient,
    /// Where to watch from; `None` means list first.
    since: Option<Revision>,
    /// The pause before the next call, after a transient failure.
    pause: Option<Duration>,
    pauses: Box<dyn Iterator<Item = Duration> + Send>,
    /// A non-retryable error ended the stream.
    done: bool,
}

impl Watcher {
    /// The next update, or the error of a failed call; `None` once the stream has ended.
    async fn next(&mut self) -> Option<Result<WatchUpdate, ClientError>> {
        loop {
            if self.done {
                return None;
            }
            if let Some(pause) = self.pause.take() {
                tokio::time::sleep(pause).await;
            }
            let outcome = match self.since {
                None => self.client.workers().await.map(|list| {
                    self.since = Some(list.revision);
                    Some(WatchUpdate::Snapshot(list))
                }),
                Some(since) => match self.client.watch_once(since).await {
                    Ok(batch) => {
                        self.since = Some(batch.revision.max(since));
                        Ok((!batch.events.is_empty()).then_some(WatchUpdate::Events(batch)))
                    }
                    Err(err) if err.status() == Some(410) => {
                        tracing::info!(url = %self.client.url(), since, "watch fell behind the server's history: listing again");
                        self.since = None;
                        Ok(None)
                    }
                    Err(err) => Err(err),
                },
            };
            match outcome {
                Ok(update) => {
                    self.pauses = Box::new(self.client.retry_policy().schedule());
                    if update.is_some() {
                        return update.map(Ok);
                    }
                }
                Err(err) => {
                    if err.is_retryable() {
                        let max = self.client.retry_policy().max_backoff;
                        self.pause = Some(self.pauses.next().unwrap_or(max));
                    } else {
                        self.done = true;
                    }
                    return Some(Err(err));
                }
            }
        }
    }
}

impl BootstrapClient {
    /// Follows the registry's worker changes: first a [`WatchUpdate::Snapshot`] (`GET /workers`)
    /// when `since` is `None`, then [`WatchUpdate::Events`] as they happen (`GET /watch` long
    /// polls of the watch wait each; no event is ever skipped), and a new snapshot whenever
    /// `since` is older than the server's history.
    ///
    /// A transient failure (connection, timeout, 5xx) is yielded as an `Err` item and the stream
    /// goes on after a backoff pause; any other error (e.g. 404 from a server without `/watch`,
    /// such as vLLM's) is yielded and ends the stream. Every call has a timeout, so the stream
    /// never hangs on a dead server; it never ends by itself otherwise: drop it to stop. Calls
    /// are made only while the stream is polled.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), worker_client::ClientError> {
    /// use futures_util::StreamExt;
    /// use worker_client::{BootstrapClient, WatchUpdate};
    /// let client = BootstrapClient::new("http://10.0.0.5:8998")?;
    /// let mut changes = client.watch(None);
    /// while let Some(update) = changes.next().await {
    ///     match update {
    ///         Ok(WatchUpdate::Snapshot(list)) => println!("{} workers", list.workers.len()),
    ///         Ok(WatchUpdate::Events(batch)) => println!("{} changes", batch.events.len()),
    ///         Err(err) if err.is_retryable() => eprintln!("watch: {err} (retrying)"),
    ///         Err(err) => return Err(err),
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub fn watch(
        &self,
        since: Option<Revision>,
    ) -> BoxStream<'static, Result<WatchUpdate, ClientError>> {
        let watcher = Watcher {
            client: self.clone(),
            since,
            pause: None,
            pauses: Box::new(self.retry_policy().schedule()),
            done: false,
        };
        stream::unfold(watcher, |mut watcher| async move {
            let item = watcher.next().await?;
            Some((item, watcher))
        })
        .boxed()
    }
}
