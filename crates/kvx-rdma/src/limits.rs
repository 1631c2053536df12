//! The device's and the process's limits that a geometry can exceed, read once when the device
//! opens (`ibv_query_device`, `ibv_query_port`, the completion queue as created,
//! `RLIMIT_MEMLOCK`), and the checks that refuse such a geometry with a message naming the
//! limit — instead of the `ENOMEM` or `EINVAL` that `ibv_reg_mr` or `ibv_create_qp` would
//! give, a "completion queue is full" at connect, or a "local length error" on the first write.

/// What the device takes at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Work requests one queue of a queue pair holds (`max_qp_wr`): a sender posts up to one
    /// write per staging slot, so its staging may hold no more slots.
    pub max_qp_wr: u32,
    /// Entries of one completion queue (`max_cqe`).
    pub max_cqe: u32,
    /// Entries of the completion queue the device was opened with (`cq_depth`, at most
    /// `max_cqe`): every queue pair's send and receive depths are promised out of it, so a
    /// sender's staging (its send depth) must fit beside its one receive.
    pub cq_entries: u32,
    /// Bytes of one message (`max_msg_sz` of the port): a slot, one write, may be no larger.
    pub max_msg_sz: u64,
    /// Bytes of one memory registration (`max_mr_size`): a whole staging pool or buffer.
    pub max_mr_size: u64,
    /// Bytes this process may pin (`RLIMIT_MEMLOCK`, soft); `None` when unlimited or when the
    /// process holds `CAP_IPC_LOCK`, which lifts the limit (`memlock_limit`).
    pub memlock_bytes: Option<u64>,
}

impl DeviceLimits {
    /// No limit a test or a geometry would reach.
    pub const UNLIMITED: DeviceLimits = DeviceLimits {
        max_qp_wr: u32::MAX,
        max_cqe: u32::MAX,
        cq_entries: u32::MAX,
        max_msg_sz: u64::MAX,
        max_mr_size: u64::MAX,
        memlock_bytes: None,
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
        if let Some(limit) = self.memlock_bytes {
            if total > limit {
                return Err(format!(
                    "{slots} slots of {slot_bytes} bytes ({total} bytes) exceed this process's \
                     locked-memory limit (RLIMIT_MEMLOCK) of {limit} bytes: registering memory \
                     with an RDMA device pins it. Raise the limit for the user running kvx \
                     (`ulimit -l unlimited` in its shell, `LimitMEMLOCK=infinity` in a systemd \
                     unit, `--ulimit memlock=-1` for a container, or a memlock line in \
                     /etc/security/limits.conf), or use fewer or smaller slots"
                ));
            }
        }
        Ok(())
    }

    /// The most staging slots a sender can have: one write in flight per slot on one send
    /// queue (`max_qp_wr`), promised out of the completion queue beside the queue pair's one
    /// receive (`cq_entries`).
    pub fn max_staging_slots(&self) -> u32 {
        self.max_qp_wr.min(self.cq_entries.saturating_sub(1)).max(1)
    }

    /// Whether a sender's staging of `slots` can have a write in flight from every slot.
    pub fn check_staging(&self, slots: u32) -> Result<(), String> {
        if slots > self.max_qp_wr {
            return Err(format!(
                "a staging of {slots} slots exceeds the device's max_qp_wr of {} (a write \
                 in flight per slot, one send queue): use at most {} staging slots",
                self.max_qp_wr,
                self.max_staging_slots()
            ));
        }
        if slots > self.max_staging_slots() {
            return Err(format!(
                "a staging of {slots} slots does not fit the completion queue of {} entries \
                 (a write in flight per slot, plus one receive; `cq_depth`, at most the \
                 device's max_cqe of {}): use at most {} staging slots, or a larger cq_depth",
                self.cq_entries,
                self.max_cqe,
                self.max_staging_slots()
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

/// Bytes this process may pin, as `DeviceLimits::memlock_bytes` says: `RLIMIT_MEMLOCK`'s soft
/// limit, or `None` when it is unlimited or the process holds `CAP_IPC_LOCK` (root usually
/// does), with which the kernel does not apply it.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))] // read where the verbs backend opens a device
pub fn memlock_limit() -> Option<u64> {
    if holds_ipc_lock() {
        return None;
    }
    rustix::process::getrlimit(rustix::process::Resource::Memlock).current
}

/// Whether `CAP_IPC_LOCK` (capability 14) is in this process's effective set, from
/// `/proc/self/status`'s `CapEff` mask; false when it cannot be read.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
fn holds_ipc_lock() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let mask = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
            u64::from_str_radix(mask.trim(), 16).ok()
        })
        .is_some_and(|mask| mask & (1 << CAP_IPC_LOCK) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_limit_is_named_when_exceeded() {
        let l = DeviceLimits {
            max_qp_wr: 4,
            max_cqe: 64,
            cq_entries: 64,
            max_msg_sz: 4096,
            max_mr_size: 16 * 4096,
            memlock_bytes: None,
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
        // The completion queue binds before max_qp_wr does: 8 entries hold 7 writes and a
        // receive.
        let small_cq = DeviceLimits {
            max_qp_wr: 1 << 20,
            cq_entries: 8,
            ..l
        };
        assert_eq!(small_cq.max_staging_slots(), 7);
        assert!(small_cq.check_staging(7).is_ok());
        let e = small_cq.check_staging(8).expect_err("refused");
        assert!(
            e.contains("completion queue") && e.contains("at most 7"),
            "{e}"
        );
        // The locked-memory limit, named with what to set.
        let pinned = DeviceLimits {
            memlock_bytes: Some(8 * 4096),
            ..l
        };
        assert!(pinned.check_memory(8, 4096).is_ok());
        let e = pinned.check_memory(9, 4096).expect_err("refused");
        assert!(
            e.contains("RLIMIT_MEMLOCK") && e.contains("ulimit -l"),
            "{e}"
        );
        assert_eq!(l.recv_depth(20), 4);
        assert_eq!(l.recv_depth(3), 3);
        assert!(DeviceLimits::UNLIMITED
            .check_memory(u32::MAX, usize::MAX)
            .is_ok());
    }

    #[test]
    fn the_memlock_limit_is_the_soft_rlimit_unless_ipc_lock_lifts_it() {
        let soft = rustix::process::getrlimit(rustix::process::Resource::Memlock).current;
        let want = if holds_ipc_lock() { None } else { soft };
        assert_eq!(memlock_limit(), want);
    }
}
