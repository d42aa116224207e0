//! How fast a request's tokens come: the fixed pace of `--decode-ms-per-token` (slowed by the
//! batch, see `scheduler.rs`), or the steps of the engine model (`model/`).

use std::sync::Arc;
use std::time::Duration;

use super::model::steps::Progress;
use super::scheduler::Scheduler;

/// The pace of one request's answer.
pub enum Pace {
    /// Each token `per_token` after the one before, slowed by the other requests running.
    Fixed {
        /// The running batch.
        scheduler: Arc<Scheduler>,
        /// A token's time with one request running.
        per_token: Duration,
    },
    /// Each token when the engine model's step that makes it ends.
    Steps {
        /// The tokens made so far.
        progress: Progress,
        /// The tokens taken so far.
        taken: u32,
    },
}

impl Pace {
    /// The engine model's pace of a request whose steps were queued (`progress`).
    pub fn steps(progress: Progress) -> Self {
        Pace::Steps { progress, taken: 0 }
    }

    /// Waits until the next token is made.
    pub async fn next_token(&mut self) {
        match self {
            Pace::Fixed {
                scheduler,
                per_token,
            } => tokio::time::sleep(scheduler.per_token(*per_token)).await,
            Pace::Steps { progress, taken } => {
                *taken += 1;
                let wanted = *taken;
                // The loop only drops a request's sender once all its tokens are made.
                let _ = progress.wait_for(|made| *made >= wanted).await;
            }
        }
    }
}
