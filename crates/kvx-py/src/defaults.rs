//! `kvx._kvx.defaults()`: the default of every setting, read from where it is kept (the core's
//! `ReceiverConfig`, `SenderConfig` and `ProxyConfig` `Default`s, and `kvx_embed::defaults`
//! for node-level ones), so that `kvx.Receiver`, `kvx.Sender`, `kvx.Proxy`, `kvx.config` and
//! `kvx.lmcache` state no default of their own. Each config is taken apart naming every field
//! (no `..`), so a field added to the core is a compile error here until it is exposed.

use std::time::Duration;

use kvx_proto::config::Pipelining;
use kvx_proto::{LegacySenders, Placement, ProxyConfig, ReceiverConfig, SenderConfig};
use pyo3::prelude::*;
use pyo3::types::PyDict;

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// The default of every setting: ``{"receiver": {...}, "sender": {...}, "proxy": {...},
/// "node": {...}}``, each keyed by the core's field name (durations in seconds, enums by
/// their flag value, as ``kvx receiver --help`` names them). ``kvx.Receiver``'s and
/// ``kvx.Sender``'s keyword arguments of the same name (``failure_notices``:
/// ``notify_proxy_on_failure``) take these when given ``None``.
#[pyfunction]
pub(crate) fn defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let ReceiverConfig {
        buffer_slots,
        admission_timeout,
        admission_queue_max,
        requests_max,
        request_idle_timeout,
        stall_timeout,
        unconsumed_ttl,
        write_quarantine,
        tombstone_ttl,
        tombstones_max,
        require_checksums,
        legacy_senders,
        peer_share_percent,
        peer_queue_max,
        req_id_bytes_max,
        key_bytes_max,
        queued_bytes_max,
        tombstones_bytes_max,
        placement,
    } = ReceiverConfig::default();
    let receiver = PyDict::new(py);
    receiver.set_item("buffer_slots", buffer_slots)?;
    receiver.set_item("admission_timeout", secs(admission_timeout))?;
    receiver.set_item("admission_queue_max", admission_queue_max)?;
    receiver.set_item("requests_max", requests_max)?;
    receiver.set_item("request_idle_timeout", secs(request_idle_timeout))?;
    receiver.set_item("stall_timeout", secs(stall_timeout))?;
    receiver.set_item("unconsumed_ttl", secs(unconsumed_ttl))?;
    receiver.set_item("write_quarantine", secs(write_quarantine))?;
    receiver.set_item("tombstone_ttl", secs(tombstone_ttl))?;
    receiver.set_item("tombstones_max", tombstones_max)?;
    receiver.set_item("require_checksums", require_checksums)?;
    receiver.set_item(
        "legacy_senders",
        match legacy_senders {
            LegacySenders::Refuse => "refuse",
            LegacySenders::AfterProxy => "after-proxy",
        },
    )?;
    receiver.set_item("peer_share_percent", peer_share_percent)?;
    receiver.set_item("peer_queue_max", peer_queue_max)?;
    receiver.set_item("req_id_bytes_max", req_id_bytes_max)?;
    receiver.set_item("key_bytes_max", key_bytes_max)?;
    receiver.set_item("queued_bytes_max", queued_bytes_max)?;
    receiver.set_item("tombstones_bytes_max", tombstones_bytes_max)?;
    receiver.set_item("placement", placement_name(placement))?;

    let SenderConfig {
        staging_slots,
        admission_reply_timeout,
        reply_timeout,
        write_timeout,
        staging_timeout,
        inflight_max,
        requests_max,
        outcomes_kept,
        channel_queue_max,
        pipelining,
        notify_proxy_on_failure,
        staging_placement,
        checksums,
    } = SenderConfig::default();
    let sender = PyDict::new(py);
    sender.set_item("staging_slots", staging_slots)?;
    sender.set_item("admission_reply_timeout", secs(admission_reply_timeout))?;
    sender.set_item("reply_timeout", secs(reply_timeout))?;
    sender.set_item("write_timeout", secs(write_timeout))?;
    sender.set_item("staging_timeout", secs(staging_timeout))?;
    sender.set_item("inflight_max", inflight_max)?;
    sender.set_item("requests_max", requests_max)?;
    sender.set_item("outcomes_kept", outcomes_kept)?;
    sender.set_item("channel_queue_max", channel_queue_max)?;
    sender.set_item(
        "pipelining",
        match pipelining {
            Pipelining::Auto => "auto",
            Pipelining::Off => "off",
        },
    )?;
    sender.set_item("notify_proxy_on_failure", notify_proxy_on_failure)?;
    sender.set_item("staging_placement", placement_name(staging_placement))?;
    sender.set_item("checksums", checksums)?;

    let ProxyConfig {
        kv_ready_timeout,
        requests_max,
        early_notices_max,
        early_notice_ttl,
        early_notices_bytes_max,
        req_id_bytes_max,
        reason_bytes_max,
        await_on_first_notice,
        ranks_per_connection,
    } = ProxyConfig::default();
    let proxy = PyDict::new(py);
    proxy.set_item("kv_ready_timeout", secs(kv_ready_timeout))?;
    proxy.set_item("requests_max", requests_max)?;
    proxy.set_item("early_notices_max", early_notices_max)?;
    proxy.set_item("early_notice_ttl", secs(early_notice_ttl))?;
    proxy.set_item("early_notices_bytes_max", early_notices_bytes_max)?;
    proxy.set_item("req_id_bytes_max", req_id_bytes_max)?;
    proxy.set_item("reason_bytes_max", reason_bytes_max)?;
    proxy.set_item("await_on_first_notice", await_on_first_notice)?;
    proxy.set_item("ranks_per_connection", ranks_per_connection)?;

    let node = PyDict::new(py);
    node.set_item("chunk_bytes", kvx_embed::defaults::CHUNK_BYTES)?;
    node.set_item(
        "connect_timeout",
        secs(kvx_embed::defaults::CONNECT_TIMEOUT),
    )?;
    let zmq = kvx_transport::zmq::ZmqConfig::default();
    node.set_item("heartbeat_interval", secs(zmq.heartbeat_interval))?;
    node.set_item("heartbeat_timeout", secs(zmq.heartbeat_timeout))?;

    // The names `transport=`/`fabric=` take (`kvx_embed::named`), the fabrics only as far
    // as this build has them.
    node.set_item("transports", kvx_embed::TRANSPORT_NAMES.to_vec())?;
    let in_process = kvx_embed::InProcess::new();
    let fabrics: Vec<&str> = kvx_embed::FABRIC_NAMES
        .into_iter()
        .filter(|name| kvx_embed::FabricChoice::named(name, &in_process).is_ok())
        .collect();
    node.set_item("fabrics", fabrics)?;

    let all = PyDict::new(py);
    all.set_item("receiver", receiver)?;
    all.set_item("sender", sender)?;
    all.set_item("proxy", proxy)?;
    all.set_item("node", node)?;
    Ok(all)
}

/// A placement as the settings spell it.
fn placement_name(placement: Placement) -> &'static str {
    match placement {
        Placement::Pool => "pool",
        Placement::Caller => "caller",
    }
}

/// Whether memory its owner may reuse while a write still reads it (a vLLM engine's KV
/// blocks) may be staged in place (``placement="caller"``) by a sender with ``checksums``:
/// kvx's rule (``SenderConfig::may_stage_reused_memory_in_place``), so that no integration
/// decides it for itself. ``False``: copy such memory into kvx's own staging.
#[pyfunction]
pub(crate) fn may_stage_in_place(checksums: bool) -> bool {
    SenderConfig {
        checksums,
        ..SenderConfig::default()
    }
    .may_stage_reused_memory_in_place()
}
