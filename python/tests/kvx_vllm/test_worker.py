"""kvx.vllm's worker side (``DecodeWorker``, ``PrefillWorker``) over a fake transfer, by vLLM's rules for what a
worker reports and when: no vLLM needed."""

from __future__ import annotations

from fake_transfer import FakeTransfer

from kvx.vllm.plan import Begin, Push, Release, Reserve, StepPlan
from kvx.vllm.worker import DecodeWorker, KvxWorker, PrefillWorker

LAYERS = ("l0", "l1")


def step(worker: KvxWorker, plan: StepPlan, finished=(), forward=True):
    """The model runner's order of calls for one step; returns (sent, received, errors,
    report)."""
    worker.bind(plan)
    if forward:
        for name in LAYERS:
            worker.save_kv_layer(name, object())
    worker.wait_for_save()
    sent, received = worker.get_finished(set(finished))
    errors = worker.get_block_ids_with_load_errors()
    report = worker.take_report()
    worker.clear()
    return sent, received, errors, report


def decode():
    transfer = FakeTransfer()
    return DecodeWorker(transfer), transfer


def test_a_reservation_is_reported_received_only_when_the_transfer_says_so():
    worker, transfer = decode()
    reserve = Reserve("r1", "k1", "secret-of-k1-0123456789", 0, (7, 8, 9), 40)
    assert step(worker, StepPlan(reserve=[reserve]))[1] == set()
    assert transfer.reserved == {"k1": (0, (7, 8, 9), 40)}
    assert step(worker, StepPlan())[1] == set()
    transfer.complete("k1")
    sent, received, errors, _ = step(worker, StepPlan())
    assert (sent, received, errors) == (set(), {"r1"}, set())
    transfer.complete("k1")  # a duplicate event reports nothing twice
    assert step(worker, StepPlan())[1] == set()


def test_a_failed_load_reports_its_blocks_in_the_same_step_as_the_request():
    worker, transfer = decode()
    step(worker, StepPlan(reserve=[Reserve("r1", "k1", "secret-of-k1-0123456789", 1, (7, 8), 40)]))
    transfer.fail("k1")
    _, received, errors, _ = step(worker, StepPlan())
    assert received == {"r1"} and errors == {7, 8}
    assert step(worker, StepPlan())[2] == set()  # reported once


def test_a_withdrawn_reservation_is_reported_without_load_errors():
    worker, transfer = decode()
    step(worker, StepPlan(reserve=[Reserve("r1", "k1", "secret-of-k1-0123456789", 0, (7,), 10)]))
    _, received, errors, _ = step(worker, StepPlan(release=[Release("r1", "k1", True)]))
    assert ("release", "k1", True) in transfer.calls
    assert received == {"r1"} and errors == set()


def test_a_release_of_an_id_never_reserved_here_is_passed_on_unreserved():
    worker, transfer = decode()
    step(worker, StepPlan(release=[Release("r1", "k1", True)]))
    assert transfer.named("release") == [("release", "k1", False)]


def prefill_push(worker, transfer):
    begin = Begin("p1", "k1", "secret-of-k1-0123456789", ("tcp://d:8400", "tcp://d:8401"), ("tcp://d:8300", "tcp://d:8301"), 2)
    step(worker, StepPlan(begin=[begin]), forward=False)
    transfer.grant("k1")
    _, _, _, report = step(worker, StepPlan(), forward=False)
    assert report is not None and report.granted == {"p1": 1}
    step(worker, StepPlan(push=[Push("p1", "k1", 0, (3, 4, 5), True)]))


def test_a_prefill_rank_claims_at_its_own_ranks_receiver_and_writes_each_layer_once():
    transfer = FakeTransfer()
    worker = PrefillWorker(transfer, tp_rank=1)
    prefill_push(worker, transfer)
    assert transfer.named("begin") == [("begin", "k1", "tcp://d:8401", "tcp://d:8301")]
    assert transfer.named("write") == [("write", "k1", name, 0, (3, 4, 5)) for name in LAYERS]
    assert transfer.named("finish") == [("finish", "k1")]


def test_sent_is_reported_only_after_vllm_said_the_request_finished():
    transfer = FakeTransfer()
    worker = PrefillWorker(transfer)
    prefill_push(worker, transfer)
    transfer.deliver("k1")  # delivered before vLLM told the worker the request finished
    assert step(worker, StepPlan())[0] == set()
    assert step(worker, StepPlan(), finished={"p1"})[0] == {"p1"}
    assert step(worker, StepPlan(), finished={"p1"})[0] == set()


def test_a_cancel_before_any_write_forgets_the_request():
    transfer = FakeTransfer()
    worker = PrefillWorker(transfer)
    step(worker, StepPlan(begin=[Begin("p1", "k1", "secret-of-k1-0123456789", ("tcp://d:1",), ("tcp://d:2",), 2)]), forward=False)
    step(worker, StepPlan(cancel=["p1"]), forward=False)
    assert ("cancel", "k1") in transfer.calls
    assert worker._claimed == {} and worker._by_kvx == {}


def test_a_cancel_after_writes_is_reported_sent_once_drained():
    transfer = FakeTransfer()
    worker = PrefillWorker(transfer)
    begin = Begin("p1", "k1", "secret-of-k1-0123456789", ("tcp://d:1",), ("tcp://d:2",), 2)
    step(worker, StepPlan(begin=[begin]), forward=False)
    step(worker, StepPlan(push=[Push("p1", "k1", 0, (3,), False)]))
    step(worker, StepPlan(cancel=["p1"]), forward=False)  # the fake drains at once
    assert step(worker, StepPlan(), finished={"p1"})[0] == {"p1"}
    assert worker._claimed == {} and worker._posted == set()
