//! The blocking waits these tests make on a sender: the handle's async waits, bounded on the
//! sender's runtime (what the Python package does with its own interruptible wait).

use std::time::Duration;

use kvx_embed::Sender;
use kvx_node::RequestEnd;
use kvx_proto::sender::SendFailure;
use kvx_proto::ReqId;

// Each test file uses what it needs of these.
#[allow(dead_code)]
pub trait Waits {
    /// Whether `req_id` was admitted within `timeout` (`Ok(false)`: not yet).
    fn wait_admitted(&self, req_id: &ReqId, timeout: Duration) -> Result<bool, SendFailure>;
    /// `req_id`'s end within `timeout`, if it came.
    fn wait_outcome(&self, req_id: &ReqId, timeout: Duration) -> Option<Result<(), SendFailure>>;
    /// Up to `max` request ends, waiting at most `timeout` for the first.
    fn next_ends(&self, max: usize, timeout: Duration) -> Vec<RequestEnd>;
}

impl Waits for Sender {
    fn wait_admitted(&self, req_id: &ReqId, timeout: Duration) -> Result<bool, SendFailure> {
        self.runtime()
            .block_on_for(timeout, self.handle().admitted(req_id))
            .map_or(Ok(false), |r| r.map(|()| true))
    }

    fn wait_outcome(&self, req_id: &ReqId, timeout: Duration) -> Option<Result<(), SendFailure>> {
        self.runtime()
            .block_on_for(timeout, self.handle().outcome(req_id))
    }

    fn next_ends(&self, max: usize, timeout: Duration) -> Vec<RequestEnd> {
        self.runtime()
            .block_on_for(timeout, self.ends(max))
            .unwrap_or_default()
    }
}
