//! One simulated queue pair (see the module `fabric`): posted writes land in order at their scheduled
//! times, complete in order an acknowledgement later, and are all flushed with an error the
//! moment the connection errors.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use kvx_io::fabric::ConnOp;
use kvx_io::{Completion, FabricError, PostWrite};
use tokio::sync::{mpsc, watch};

use super::{self as fabric, SimMemory};
use crate::world::World;

#[derive(Debug)]
struct Wr {
    w: PostWrite,
    land_at: Duration,
    /// It would be in flight past the retry timeout: the connection errors at `land_at`.
    doomed: bool,
    /// None until it landed or failed.
    result: Option<Result<(), FabricError>>,
    done_at: Duration,
}

#[derive(Debug)]
pub(crate) struct QueuePair {
    world: World,
    id: u64,
    staging: Arc<SimMemory>,
    done: mpsc::UnboundedSender<Completion>,
    queue: VecDeque<Wr>,
}

impl QueuePair {
    pub fn new(
        world: World,
        id: u64,
        staging: Arc<SimMemory>,
        done: mpsc::UnboundedSender<Completion>,
    ) -> Self {
        Self {
            world,
            id,
            staging,
            done,
            queue: VecDeque::new(),
        }
    }

    pub async fn run(
        mut self,
        mut ops: mpsc::UnboundedReceiver<ConnOp>,
        mut signal: watch::Receiver<bool>,
    ) {
        loop {
            let next = self.next_event();
            let world = self.world.clone();
            let timer = async move {
                match next {
                    Some(at) => world.sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                op = ops.recv() => match op {
                    Some(ConnOp::Write(w)) => self.post(w),
                    Some(ConnOp::Run(run)) => run.into_pieces().into_iter().for_each(|w| self.post(w)),
                    Some(ConnOp::Reset) => fabric::fail(&self.world, self.id, "reset by the sender"),
                    // The sender dropped the connection: nobody waits for completions.
                    None => return fabric::close(&self.world, self.id),
                },
                r = signal.changed() => {
                    if r.is_err() {
                        return fabric::close(&self.world, self.id);
                    }
                }
                _ = timer => {}
            }
            self.progress();
            if !self.emit() {
                return fabric::close(&self.world, self.id);
            }
        }
    }

    fn next_event(&self) -> Option<Duration> {
        let landing = self
            .queue
            .iter()
            .find(|wr| wr.result.is_none())
            .map(|wr| wr.land_at);
        let completing = self
            .queue
            .front()
            .filter(|wr| wr.result.is_some())
            .map(|wr| wr.done_at);
        match (landing, completing) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn post(&mut self, w: PostWrite) {
        let now = self.world.now();
        let wr = match fabric::schedule(&self.world, self.id, w.len) {
            Ok((land_at, doomed)) => Wr {
                w,
                land_at,
                doomed,
                result: None,
                done_at: land_at,
            },
            Err(e) => Wr {
                w,
                land_at: now,
                doomed: false,
                result: Some(Err(e)),
                done_at: now,
            },
        };
        self.queue.push_back(wr);
    }

    /// Lands every write that is due, in order; on a connection error flushes the rest.
    fn progress(&mut self) {
        let now = self.world.now();
        if fabric::is_broken(&self.world, self.id) {
            return self.flush(now);
        }
        let ack = fabric::ack_latency(&self.world);
        for i in 0..self.queue.len() {
            let wr = &self.queue[i];
            if wr.result.is_some() {
                continue;
            }
            if wr.land_at > now {
                return;
            }
            if wr.doomed {
                fabric::fail(&self.world, self.id, "retry count exceeded");
                return self.flush(now);
            }
            let (result, broken) = match fabric::land(&self.world, self.id, &self.staging, &wr.w) {
                Ok(None) => (Ok(()), false),
                // Refused or corrupt: this write failed, the connection is fine.
                Ok(Some(e)) => (Err(e), false),
                Err(e) => (Err(e), true),
            };
            let wr = &mut self.queue[i];
            wr.done_at = if broken { now } else { now + ack };
            wr.result = Some(result);
            if broken {
                return self.flush(now);
            }
        }
    }

    /// Everything not yet completed completes now with an error (a landed write whose
    /// acknowledgement had not come back too, as with verbs); an error already set stays.
    fn flush(&mut self, now: Duration) {
        for wr in &mut self.queue {
            if !matches!(wr.result, Some(Err(_))) {
                wr.result = Some(Err(FabricError::Flushed));
            }
            wr.done_at = now;
        }
    }

    /// Hands out due completions in posting order; false when nobody listens any more.
    fn emit(&mut self) -> bool {
        let now = self.world.now();
        while self
            .queue
            .front()
            .is_some_and(|wr| wr.result.is_some() && wr.done_at <= now)
        {
            let Some(wr) = self.queue.pop_front() else {
                break;
            };
            let result = wr.result.unwrap_or(Err(FabricError::Flushed));
            if let Err(e) = &result {
                self.world.record(format_args!(
                    "qp {}: write {} failed: {e}",
                    self.id, wr.w.id.0
                ));
            }
            if self
                .done
                .send(Completion {
                    id: wr.w.id,
                    result,
                })
                .is_err()
            {
                return false;
            }
        }
        true
    }
}
