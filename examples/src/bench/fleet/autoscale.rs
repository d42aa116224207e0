//! The bench as the fleet's autoscaler: during a timed replay it reads pd-proxy's
//! `pd_proxy_planner_desired_engines{role}` as KEDA would, and moves each role's engine count
//! toward it: up at once (an engine still draining serves again, stopped ones are thawed and,
//! after a modelled start-up delay, taken back into rotation), down one engine per decision (an
//! engine too many is drained at pd-proxy, frozen once idle: SIGSTOP, a stopped engine, its GPU
//! free). Engine-seconds count every engine not stopped (serving, draining or starting up), in
//! the GPU's time.

use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::cluster::{Cluster, Process};

/// What the autoscaler did over a run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scaled {
    /// Engine-seconds of wall time spent by engines not stopped.
    pub engine_seconds: f64,
    /// Engines stopped, over the run.
    pub stops: usize,
    /// Engines started, over the run.
    pub starts: usize,
    /// The fewest engines serving at once, per role (prefill, decode).
    pub fewest: (usize, usize),
}

/// How the bench actuates.
#[derive(Debug, Clone, Copy)]
pub struct Actuation {
    /// Between two decisions (wall time).
    pub interval: Duration,
    /// An engine's modelled start-up (wall time): thawed at once, in rotation after this.
    pub start_delay: Duration,
    /// pd-proxy's `--admin-key`.
    pub admin_key: &'static str,
}

/// Where one engine stands.
#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    Serving,
    Draining,
    Stopped,
    Starting { ready_at: Instant },
}

struct Engine<'a> {
    process: &'a Process,
    prefill: bool,
    state: State,
}

/// Actuates the planner of `cluster`'s proxy until `stop` turns true; every engine serves
/// again (thawed, undrained) when it returns.
pub async fn actuate(
    cluster: &Cluster,
    actuation: Actuation,
    mut stop: watch::Receiver<bool>,
) -> Result<Scaled, String> {
    let mut engines: Vec<Engine> = (cluster.prefills.iter().map(|p| (p, true)))
        .chain(cluster.decodes.iter().map(|d| (d, false)))
        .map(|(process, prefill)| Engine {
            process,
            prefill,
            state: State::Serving,
        })
        .collect();
    let admin = Admin::new(&cluster.proxy.url, actuation.admin_key);
    let mut scaled = Scaled {
        fewest: (cluster.prefills.len(), cluster.decodes.len()),
        ..Scaled::default()
    };
    let mut ticks = tokio::time::interval(actuation.interval);
    let mut last = Instant::now();
    let outcome = loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = stop.changed() => break Ok(()),
        }
        let now = Instant::now();
        let up = engines.iter().filter(|e| e.state != State::Stopped).count();
        scaled.engine_seconds += up as f64 * (now - last).as_secs_f64();
        last = now;
        if let Err(err) = step(&admin, &mut engines, actuation, &mut scaled, now).await {
            break Err(err);
        }
    };
    let now = Instant::now();
    let up = engines.iter().filter(|e| e.state != State::Stopped).count();
    scaled.engine_seconds += up as f64 * (now - last).as_secs_f64();
    for engine in &mut engines {
        engine.process.freeze(false);
        let _ = admin.drain(&engine.process.url, false).await;
    }
    outcome.map(|()| scaled)
}

/// One decision: the engines whose drain or start-up ended move on, then each role takes one
/// step toward its desired engines.
async fn step(
    admin: &Admin,
    engines: &mut [Engine<'_>],
    actuation: Actuation,
    scaled: &mut Scaled,
    now: Instant,
) -> Result<(), String> {
    let in_flight = admin.in_flight().await?;
    for engine in engines.iter_mut() {
        match engine.state {
            State::Draining if in_flight(&engine.process.url) == Some(0) => {
                engine.process.freeze(true);
                engine.state = State::Stopped;
                scaled.stops += 1;
            }
            State::Starting { ready_at } if now >= ready_at => {
                admin.drain(&engine.process.url, false).await?;
                engine.state = State::Serving;
            }
            _ => {}
        }
    }
    let desired = admin.desired().await?;
    for (prefill, desired) in [(true, desired.0), (false, desired.1)] {
        let Some(desired) = desired else { continue };
        let of_role = |e: &&mut Engine| e.prefill == prefill;
        let count = |engines: &[Engine], state: fn(&State) -> bool| {
            (engines.iter())
                .filter(|e| e.prefill == prefill && state(&e.state))
                .count()
        };
        let serving = count(&*engines, |s| *s == State::Serving);
        let coming = count(&*engines, |s| matches!(s, State::Starting { .. }));
        let leaving = count(&*engines, |s| *s == State::Draining);
        if serving + coming < desired {
            // Up to the desired count at once, as the HPA's default scale-up does (4 pods or
            // twice as many per 15 s): an engine still draining serves again first, then
            // stopped ones start.
            let mut missing = desired - serving - coming;
            for engine in
                (engines.iter_mut().filter(of_role)).filter(|e| e.state == State::Draining)
            {
                if missing == 0 {
                    break;
                }
                admin.drain(&engine.process.url, false).await?;
                engine.state = State::Serving;
                missing -= 1;
            }
            let stopped =
                (engines.iter_mut().filter(of_role)).filter(|e| e.state == State::Stopped);
            for engine in stopped.take(missing) {
                engine.process.freeze(false);
                engine.state = State::Starting {
                    ready_at: now + actuation.start_delay,
                };
                scaled.starts += 1;
            }
        } else if serving > desired.max(1) && coming == 0 && leaving == 0 {
            let idlest = (engines.iter_mut().filter(of_role))
                .filter(|e| e.state == State::Serving)
                .min_by_key(|e| in_flight(&e.process.url).unwrap_or(usize::MAX));
            if let Some(engine) = idlest {
                admin.drain(&engine.process.url, true).await?;
                engine.state = State::Draining;
            }
        }
        let serving = count(&*engines, |s| *s == State::Serving);
        let fewest = if prefill {
            &mut scaled.fewest.0
        } else {
            &mut scaled.fewest.1
        };
        *fewest = (*fewest).min(serving);
    }
    Ok(())
}

/// pd-proxy's admin routes and metrics, as the autoscaler calls them.
struct Admin {
    http: reqwest::Client,
    proxy: String,
    key: &'static str,
}

impl Admin {
    fn new(proxy: &str, key: &'static str) -> Self {
        let http = (reqwest::Client::builder().timeout(Duration::from_secs(10)))
            .build()
            .expect("a client");
        Admin {
            http,
            proxy: proxy.to_owned(),
            key,
        }
    }

    /// Drains `url` at pd-proxy, or lifts that.
    async fn drain(&self, url: &str, draining: bool) -> Result<(), String> {
        let route = format!("{}/admin/drain", self.proxy);
        (self.http.post(&route).bearer_auth(self.key))
            .json(&json!({ "url": url, "draining": draining }))
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| format!("{route}: {e}"))?;
        Ok(())
    }

    /// Each backend's calls in flight through pd-proxy, by URL.
    async fn in_flight(&self) -> Result<impl Fn(&str) -> Option<usize>, String> {
        let route = format!("{}/admin/backends", self.proxy);
        let backends: Value = (self.http.get(&route).bearer_auth(self.key))
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| format!("{route}: {e}"))?
            .json()
            .await
            .map_err(|e| format!("{route}: {e}"))?;
        let listed: Vec<(String, usize)> = ["prefills", "decodes"]
            .iter()
            .flat_map(|role| backends[role].as_array().cloned().unwrap_or_default())
            .filter_map(|b| {
                Some((
                    b["url"].as_str()?.to_owned(),
                    b["in_flight"].as_u64()? as usize,
                ))
            })
            .collect();
        Ok(move |url: &str| {
            let url = url.trim_end_matches('/');
            (listed.iter()).find(|(u, _)| u == url).map(|(_, n)| *n)
        })
    }

    /// The planner's desired prefills and decodes, as its gauges say (none before its first
    /// decision).
    async fn desired(&self) -> Result<(Option<usize>, Option<usize>), String> {
        let route = format!("{}/metrics", self.proxy);
        // With --admin-key, pd-proxy's /metrics asks for it too.
        let text = (self.http.get(&route).bearer_auth(self.key).send().await)
            .and_then(|r| r.error_for_status())
            .map_err(|e| format!("{route}: {e}"))?
            .text()
            .await
            .map_err(|e| format!("{route}: {e}"))?;
        Ok((desired(&text, "prefill"), desired(&text, "decode")))
    }
}

/// `role`'s desired engines in pd-proxy's metrics `text`.
fn desired(text: &str, role: &str) -> Option<usize> {
    let label = format!("role=\"{role}\"");
    (text.lines())
        .filter(|line| line.starts_with("pd_proxy_planner_desired_engines{"))
        .find(|line| line.contains(&label))
        .and_then(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|value| value as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_desired_engines_are_read_per_role() {
        let text = "# HELP pd_proxy_planner_desired_engines x\n\
            pd_proxy_planner_desired_engines{model=\"sim-model\",role=\"decode\"} 2\n\
            pd_proxy_planner_desired_engines{model=\"sim-model\",role=\"prefill\"} 5\n\
            pd_proxy_planner_current_engines{model=\"sim-model\",role=\"prefill\"} 3\n";
        assert_eq!(desired(text, "prefill"), Some(5));
        assert_eq!(desired(text, "decode"), Some(2));
        assert_eq!(desired("", "decode"), None);
    }
}
