//! The device's limits that a geometry can exceed, read once when the device opens
//! (`ibv_query_device`, `ibv_query_port`), and the checks that refuse such a geometry with a
//! message naming the limit — instead of the `EINVAL` that `ibv_reg_mr` or `ibv_create_qp`
//! would give, or a "local length error" on the first write.

/// What the device takes at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Work requests one queue of a queue pair holds (`max_qp_wr`): a sender posts up to one
    /// write per staging slot, so its staging may hold no more slots.
    pub max_qp_wr: u32,
    /// Entries of one completion queue (`max_cqe`).
    pub max_cqe: u32,
    /// Bytes of one message (`max_msg_sz` of the port): a slot, one write, may be no larger.
    pub max_msg_sz: u64,
    /// Bytes of one memory registration (`max_mr_size`): a whole staging pool or buffer.
    pub max_mr_size: u64,
}

impl DeviceLimits {
    /// No limit a test or a geometry would reach.
    pub const UNLIMITED: DeviceLimits = DeviceLimits {
        max_qp_wr: u32::MAX,
        max_cqe: u32::MAX,
        max_msg_sz: u64::MAX,
        max_mr_size: u64::MAX,
    };

    /// Whether memory of `slots × slot_bytes` can be registered and written a slot at a
    /// time; the error names the limit.
    pub fn check_memory(&self, slots: u32, slot_bytes: usize) -> Result<(), String> {
        let slot = slot_bytes as u64;
        if slot > self.max_msg_sz {
            return Err(format!(
                "a slot of {slot_bytes} bytes exceeds the device's max_msg_sz of {} bytes \
                 (one write carries one slot): use smaller chunks",
                self.max_msg_sz
            ));
        }
        let total = u64::from(slots).saturating_mul(slot);
        if total > self.max_mr_size {
            return Err(format!(
                "{slots} slots of {slot_bytes} bytes ({total} bytes) exceed the device's \
                 max_mr_size of {} bytes (one registration): use fewer slots",
                self.max_mr_size
            ));
        }
        Ok(())
    }

    /// Whether a sender's staging of `slots` can have a write in flight from every slot.
    pub fn check_staging(&self, slots: u32) -> Result<(), String> {
        if slots > self.max_qp_wr {
            return Err(format!(
                "a staging of {slots} slots exceeds the device's max_qp_wr of {} (a write \
                 in flight per slot, one send queue): use at most {} staging slots",
                self.max_qp_wr, self.max_qp_wr
            ));
        }
        Ok(())
    }

    /// The receive queue depth a receiver posts: `wanted`, at most `max_qp_wr`. Fewer posted
    /// receives than writes in flight cost the sender RNR retries (unlimited, kvx's default),
    /// not a failure, as receives are reposted as they complete.
    pub fn recv_depth(&self, wanted: u32) -> u32 {
        wanted.min(self.max_qp_wr).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_limit_is_named_when_exceeded() {
        let l = DeviceLimits {
            max_qp_wr: 4,
            max_cqe: 64,
            max_msg_sz: 4096,
            max_mr_size: 16 * 4096,
        };
        assert!(l.check_memory(16, 4096).is_ok());
        assert!(l
            .check_memory(1, 4097)
            .expect_err("refused")
            .contains("max_msg_sz"));
        assert!(l
            .check_memory(17, 4096)
            .expect_err("refused")
            .contains("max_mr_size"));
        assert!(l.check_staging(4).is_ok());
        assert!(l
            .check_staging(5)
            .expect_err("refused")
            .contains("max_qp_wr"));
        assert_eq!(l.recv_depth(20), 4);
        assert_eq!(l.recv_depth(3), 3);
        assert!(DeviceLimits::UNLIMITED
            .check_memory(u32::MAX, usize::MAX)
            .is_ok());
    }
}
