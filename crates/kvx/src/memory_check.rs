//! Refusing, at start, buffers the machine cannot hold: a receiver asked for more than the
//! machine has would otherwise touch its pages one by one until the kernel's OOM killer ends
//! it (or another process), long after the operator's typo.

use anyhow::bail;

/// What `what` (e.g. "the receive buffers") needs: `count` regions of `slots × slot_bytes`.
#[derive(Debug, Clone, Copy)]
pub struct Need {
    pub what: &'static str,
    pub slots: u64,
    pub slot_bytes: u64,
    pub count: u64,
}

impl Need {
    fn bytes(&self) -> Option<u64> {
        self.slots
            .checked_mul(self.slot_bytes)?
            .checked_mul(self.count)
    }
}

/// Fails with a message naming every figure when `needs` together exceed the memory the
/// machine has available now (`MemAvailable`; where the kernel does not say, nothing is
/// checked).
pub fn check(needs: &[Need]) -> anyhow::Result<()> {
    let Some(available) = mem_available() else {
        return Ok(());
    };
    check_against(needs, available)
}

fn check_against(needs: &[Need], available: u64) -> anyhow::Result<()> {
    let mut total: u64 = 0;
    let mut parts = Vec::new();
    for n in needs {
        let Some(bytes) = n.bytes() else {
            bail!(
                "{}: {} slots × {} bytes × {} overflows",
                n.what,
                n.slots,
                n.slot_bytes,
                n.count
            );
        };
        total = total.saturating_add(bytes);
        parts.push(format!(
            "{} {} × {} chunks × {} bytes = {}",
            n.what,
            n.count,
            n.slots,
            n.slot_bytes,
            gib(bytes)
        ));
    }
    if total > available {
        bail!(
            "not enough memory: {} ({}) but the machine has {} available (MemAvailable in \
             /proc/meminfo); lower the chunk count or chunk size",
            gib(total),
            parts.join(", "),
            gib(available)
        );
    }
    Ok(())
}

fn gib(bytes: u64) -> String {
    format!(
        "{:.2} GiB ({bytes} bytes)",
        bytes as f64 / f64::from(1u32 << 30)
    )
}

/// `MemAvailable` from /proc/meminfo, in bytes.
fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_much_is_refused_with_every_figure() {
        let need = Need {
            what: "the receive buffers",
            slots: 1_000_000,
            slot_bytes: 1 << 20,
            count: 2,
        };
        let e = check_against(&[need], 16 << 30).expect_err("2 TB > 16 GiB");
        let msg = e.to_string();
        assert!(msg.contains("1000000") && msg.contains("1048576"), "{msg}");
        assert!(msg.contains("16.00 GiB"), "{msg}");
        assert!(check_against(&[Need { slots: 64, ..need }], 16 << 30).is_ok());
        let huge = Need {
            slots: u64::MAX,
            ..need
        };
        assert!(check_against(&[huge], 16 << 30).is_err());
        assert!(
            mem_available().is_some(),
            "Linux says how much is available"
        );
    }
}
