//! The `kvx` command as a person runs it.

use std::io::Write;
use std::process::{Command, Stdio};

fn kvx() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvx"))
}

fn golden(name: &str) -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/golden/");
    std::fs::read_to_string(format!("{path}{name}"))
        .expect("golden file present (../shared/golden)")
}

fn run_with_stdin(mut cmd: Command, input: &[u8]) -> std::process::Output {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvx runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input)
        .expect("write stdin");
    child.wait_with_output().expect("kvx exits")
}

#[test]
fn wire_decode_prints_a_golden_message_as_json() {
    let mut cmd = kvx();
    cmd.args(["wire", "decode", "--hex"]);
    let out = run_with_stdin(cmd, golden("alloc_request_first_batch.hex").as_bytes());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json["type"], "AllocRequest");
    assert_eq!(json["total_chunks"], 5);
    assert_eq!(json["req_id"], "s0-r001-n5-t100");
}

#[test]
fn wire_encode_round_trips_to_the_golden_bytes() {
    let mut cmd = kvx();
    cmd.args(["wire", "encode", "--hex"]);
    let json = r#"{"type": "ProxyNotif", "req_id": "s0-r001-n5-t100"}"#;
    let out = run_with_stdin(cmd, json.as_bytes());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        golden("proxy_notif.hex").trim()
    );
}

#[test]
fn bad_input_gets_a_clear_error_and_a_failing_status() {
    let mut cmd = kvx();
    cmd.args(["wire", "decode", "--hex"]);
    let out = run_with_stdin(cmd, b"83a474797065");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a valid LMCache/kvx message"), "{err}");
    let mut missing = kvx();
    missing.args(["wire", "decode", "--hex", "--file", "/nonexistent"]);
    let out = run_with_stdin(missing, b"");
    assert_eq!(out.status.code(), Some(2));
    let out = kvx()
        .args(["demo", "--chunks", "9..3"])
        .output()
        .expect("kvx runs");
    assert_eq!(out.status.code(), Some(2), "clap refuses a bad range");
    assert!(String::from_utf8_lossy(&out.stderr).contains("MIN <= MAX"));
}

/// Runs an in-process demo (mem transport and fabric, 4 KiB chunks, JSON) with `extra`
/// flags; it must succeed; returns its JSON summary.
fn mem_demo(extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "demo",
        "--transport",
        "mem",
        "--fabric",
        "mem",
        "--json",
        "--chunk-bytes",
        "4096",
    ];
    args.extend_from_slice(extra);
    let out = kvx().args(&args).output().expect("kvx runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

#[test]
fn demo_in_process_completes_and_reports_json() {
    let s = mem_demo(&["--requests", "10", "--cancel-fraction", "0.2"]);
    for field in [
        "requests_total",
        "requests_completed",
        "requests_failed",
        "bytes_verified",
        "makespan_s",
        "bytes_per_sec",
        "request_latency_ms_p50",
        "request_latency_ms_p99",
        "transfer_ms_p50",
        "transfer_ms_p99",
        "admission_wait_ms_p99",
        "slots_leaked",
    ] {
        assert!(s.get(field).is_some(), "JSON has {field}: {s}");
    }
    // Each request's latency contains its transfer, so every quantile does too.
    for q in ["p50", "p99"] {
        let request = s[format!("request_latency_ms_{q}")]
            .as_f64()
            .expect("a number");
        let transfer = s[format!("transfer_ms_{q}")].as_f64().expect("a number");
        assert!(request >= transfer && transfer > 0.0, "{q}: {s}");
    }
    assert_eq!(s["requests_total"], 20);
    assert_eq!(s["slots_leaked"], 0);
    assert_eq!(s["requests_lost"], 0);
}

/// Staging smaller than the requests prefilled at once times the batch: every slot can end
/// up holding some request's unsubmitted chunks. The prefill then submits what it holds as a
/// short batch (`StagingHeldByCaller`'s advice) instead of failing; with one staging slot
/// every request of more than one chunk depends on it.
#[test]
fn demo_with_staging_smaller_than_a_batch_completes_every_request() {
    let s = mem_demo(&[
        "--requests",
        "6",
        "--staging-chunks",
        "1",
        "--interleave",
        "4",
    ]);
    assert_eq!(s["requests_completed"], 12, "{s}");
}

/// `--fabric rdma` without a device (this machine, CI) or without the feature: a clear error
/// and exit status 2, never a panic, for every command that takes it.
#[test]
fn rdma_without_a_device_or_the_feature_is_a_clear_error() {
    let runs: [&[&str]; 4] = [
        &["demo", "--fabric", "rdma", "--requests", "1"],
        &["receiver", "--fabric", "rdma", "--exit-after-s", "1"],
        &[
            "sender",
            "--fabric",
            "rdma",
            "--requests",
            "1",
            "--timeout-s",
            "5",
        ],
        &["bench", "--fabric", "rdma", "--total-bytes", "1048576"],
    ];
    for args in runs {
        let out = kvx().args(args).output().expect("kvx runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "kvx {args:?} panicked: {err}");
        if cfg!(feature = "rdma") {
            if !err.contains("no RDMA device") {
                eprintln!("kvx {args:?}: this machine has an RDMA device; skipped");
                continue;
            }
        } else {
            assert!(
                err.contains("built without RDMA support"),
                "kvx {args:?}: {err}"
            );
        }
        assert_eq!(out.status.code(), Some(2), "kvx {args:?}: {err}");
    }
}

/// A buffer larger than the machine can hold is refused at start, naming every figure (it
/// used to be allocated and touched page by page until the OOM killer ended the process).
#[test]
fn a_buffer_larger_than_memory_is_refused_at_start() {
    let out = kvx()
        .args(["receiver", "--alloc-ports", "0", "--fabric-ports", "0"])
        .args(["--buffer-chunks", "1000000", "--chunk-bytes", "1073741824"])
        .args(["--exit-after-s", "5"])
        .output()
        .expect("kvx runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not enough memory") && err.contains("1000000") && err.contains("1073741824"),
        "{err}"
    );
    let out = kvx()
        .args([
            "demo",
            "--buffer-chunks",
            "1000000",
            "--chunk-bytes",
            "1073741824",
        ])
        .output()
        .expect("kvx runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not enough memory"));
}

/// Flags an operator can get wrong are refused before anything starts, naming the flag and
/// what it accepts, or, for what only the combination makes wrong, with a sentence naming
/// both values; the exit status is 2 either way.
#[test]
fn operator_flags_out_of_range_are_refused_naming_the_flag() {
    let refused = [
        (&["receiver", "--buffer-chunks", "0"][..], "--buffer-chunks"),
        (&["receiver", "--chunk-bytes", "0"][..], "--chunk-bytes"),
        (
            &["receiver", "--peer-share-percent", "101"][..],
            "--peer-share-percent",
        ),
        (
            &["receiver", "--legacy-senders", "maybe"][..],
            "--legacy-senders",
        ),
        (&["receiver", "--alloc-ports", "abc"][..], "--alloc-ports"),
        (&["sender", "--chunk-bytes", "0"][..], "--chunk-bytes"),
        (&["sender", "--staging-chunks", "0"][..], "--staging-chunks"),
        (&["sender", "--checksums", "maybe"][..], "--checksums"),
        (&["proxy", "--port", "99999"][..], "--port"),
        (&["demo", "--requests", "0"][..], "--requests"),
    ];
    for (args, flag) in refused {
        let out = kvx().args(args).output().expect("kvx runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?} names {flag}: {err}");
    }
    let out = kvx()
        .args(["sender", "--alloc-ports", "1,2", "--fabric-ports", "3"])
        .output()
        .expect("kvx runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("got 2 alloc and 1 fabric ports"), "{err}");
}

/// `kvx demo` takes the receiver's protocol settings as `kvx receiver` does: `--help` lists
/// them with the core's defaults, a small share with several senders contending still
/// completes every request, a quarantine the demo's senders' write timeout breaks is refused
/// at start naming the rule, and a bad value is refused naming its flag.
#[test]
fn demo_takes_the_receivers_protocol_settings() {
    let out = kvx().args(["demo", "--help"]).output().expect("kvx runs");
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--peer-share-percent <PEER_SHARE_PERCENT>",
        "--write-quarantine-s <WRITE_QUARANTINE_S>",
        "--admission-timeout-s <ADMISSION_TIMEOUT_S>",
        "--legacy-senders <LEGACY_SENDERS>",
        "--unconsumed-ttl-s <UNCONSUMED_TTL_S>",
    ] {
        assert!(help.contains(flag), "kvx demo --help lists {flag}: {help}");
    }
    assert!(help.contains("[default: 75]"), "the core's share: {help}");

    let s = mem_demo(&[
        "--senders",
        "3",
        "--requests",
        "8",
        "--buffer-chunks",
        "16",
        "--chunks",
        "2..4",
        "--peer-share-percent",
        "25",
        "--admission-timeout-s",
        "20",
    ]);
    assert_eq!(s["requests_completed"], 24, "{s}");
    assert_eq!(s["slots_leaked"], 0, "{s}");

    let out = kvx()
        .args(["demo", "--transport", "mem", "--fabric", "mem"])
        .args(["--write-quarantine-s", "5"])
        .output()
        .expect("kvx runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("write_quarantine"), "names the rule: {err}");

    let out = kvx()
        .args(["demo", "--peer-share-percent", "0"])
        .output()
        .expect("kvx runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--peer-share-percent"), "{err}");
}

/// The two demos a newcomer ran in which requests larger than one sender's share were
/// refused (11 of 60 and 10 of 20 failed): with the defaults, over real ZeroMQ and TCP, every
/// request is served (docs/spec/protocol.md §Fair shares).
#[test]
fn requests_larger_than_a_share_are_served_in_the_demo() {
    for (args, requests) in [
        (
            "--senders 3 --requests 20 --chunks 3..7 --interleave 3 --batch-chunks 3 \
             --buffer-chunks 7 --staging-chunks 5 --chunk-bytes 65536 --seed 7",
            60,
        ),
        (
            "--senders 2 --requests 10 --chunks 6..9 --interleave 5 --batch-chunks 1 \
             --buffer-chunks 9 --staging-chunks 2 --chunk-bytes 32768 --seed 11",
            20,
        ),
    ] {
        let out = kvx()
            .arg("demo")
            .args(args.split_whitespace())
            .arg("--json")
            .output()
            .expect("kvx runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "kvx demo {args}: {err}");
        let s: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
        assert_eq!(s["requests_completed"], requests, "kvx demo {args}: {s}");
        assert_eq!(s["slots_leaked"], 0, "kvx demo {args}: {s}");
    }
}
