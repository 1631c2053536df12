"""``KvxConnector``: kvx as a vLLM v1 KV connector (``KVConnectorBase_V1``), for vLLM 0.32 and
0.33. vLLM builds one per engine in the scheduler process (``KVConnectorRole.SCHEDULER``) and
one per worker (``KVConnectorRole.WORKER``); each delegates to the side it runs:
``kvx.vllm.scheduler`` (decode or prefill) or ``kvx.vllm.worker``. Importing this module
checks the installed vLLM's version first."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from kvx.vllm.version import check_version, installed_version

check_version(installed_version())

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine  # noqa: E402

from kvx.vllm import signals  # noqa: E402

from kvx.vllm.bootstrap import bootstrap_server  # noqa: E402
from kvx.vllm.registrar import Registrar  # noqa: E402
from kvx.vllm.plan import StepPlan, WorkerReport  # noqa: E402
from kvx.vllm.scheduler import DecodeScheduler, PrefillScheduler  # noqa: E402
from kvx.vllm.settings import ConfigError, settings_from  # noqa: E402
from kvx.vllm.host_buffer import asks_for_host_buffer, host_buffered  # noqa: E402
from kvx.vllm.kvx_transfer import transfer_for  # noqa: E402
from kvx.vllm.tracing import Spans, tracer_for  # noqa: E402
from kvx.vllm.transfer import KvTransfer  # noqa: E402
from kvx.vllm.worker import KvxWorker, worker_for  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KvxConnectorMetadata(KVConnectorMetadata):
    """One step's ``StepPlan``, from the scheduler-side connector to every worker."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KvxWorkerMetadata(KVConnectorWorkerMetadata):
    """A worker's grants and refusals, summed over TP ranks by vLLM."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KvxWorkerMetadata":
        assert isinstance(other, KvxWorkerMetadata)
        return KvxWorkerMetadata(self.report.merge(other.report))


class KvxConnectorStats(KVConnectorStats):
    """kvx's counts for vLLM's periodic "KV Transfer metrics" log line, summed over workers
    and steps: pushes delivered and failed, writes and their bytes, and the delivered pushes'
    times (prefill); loads received and failed (decode). ``reduce`` gives writes per request,
    bytes per write, and per delivered push: its mean time from its first write posted to
    its delivery (``push_ms``, the forward pass included, since writes go as layers are
    computed), the mean time from its last write posted to its delivery (``delivery_ms``:
    what the forward pass does not hide) and the KV bytes per second over the push
    (``push_mb_per_s``)."""

    def reset(self) -> None:
        self.data: Dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> "KvxConnectorStats":
        return KvxConnectorStats(data=signals.merge(self.data, other.data))

    def reduce(self) -> Dict[str, Any]:
        d = self.data
        out: Dict[str, Any] = {k: d[k] for k in ("pushed", "push_failures", "received", "load_failures") if d.get(k)}
        pushes = d.get("pushed", 0) + d.get("push_failures", 0)
        if d.get("writes"):
            out["writes"] = d["writes"]
            out["bytes_per_write"] = round(d.get("write_bytes", 0) / d["writes"], 1)
            if pushes:
                out["writes_per_request"] = round(d["writes"] / pushes, 1)
        timed = d.get("timed_pushes", 0)
        if timed:
            out["push_ms"] = round(d.get("push_us", 0) / 1000 / timed, 2)
            out["delivery_ms"] = round(d.get("delivery_us", 0) / 1000 / timed, 2)
            if d.get("push_us"):
                out["push_mb_per_s"] = round(d.get("timed_bytes", 0) / d["push_us"], 1)
        return out

    def is_empty(self) -> bool:
        # A gauge's 0 is news (it was not 0 before).
        return not any(v or k.startswith("now_") for k, v in self.data.items())


class KvxPromMetrics(KVConnectorPromMetrics):
    """kvx's part of the engine's ``/metrics`` (``kvx.vllm.signals``): the handover's phases
    as histograms, loads, pushes, refusals by reason and registrations as counters, reserved
    blocks and waiting claims as gauges, each per engine as vLLM labels its own."""

    def __init__(self, vllm_config: Any, metric_types: Dict[type, type], labelnames: List[str],
                 per_engine_labelvalues: Dict[int, List[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        per_engine = lambda metric: create_metric_per_engine(metric, per_engine_labelvalues)  # noqa: E731
        self.histograms = {key: per_engine(self._histogram_cls(
            name=name, documentation=doc, buckets=list(signals.BUCKETS), labelnames=labelnames))
            for key, (name, doc) in signals.HISTOGRAMS.items()}
        self.counters = {key: per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames))
                         for key, (name, doc) in signals.COUNTERS.items()}
        self.gauges = {key: per_engine(self._gauge_cls(name=name, documentation=doc, labelnames=labelnames,
                                                       multiprocess_mode="mostrecent"))
                       for key, (name, doc) in signals.GAUGES.items()}
        self.refused = self._counter_cls(name=signals.REFUSED[0], documentation=signals.REFUSED[1],
                                         labelnames=labelnames + ["reason"])

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in self.histograms:
                for seconds in value:
                    self.histograms[key][engine_idx].observe(seconds)
            elif key in self.counters and value:
                self.counters[key][engine_idx].inc(value)
            elif key in self.gauges:
                self.gauges[key][engine_idx].set(value)
            elif key.startswith(signals.REFUSED_PREFIX) and value:
                reason = key[len(signals.REFUSED_PREFIX):]
                self.refused.labels(*self.per_engine_labelvalues[engine_idx], reason).inc(value)


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # no model-parallel group (a single process): rank 0
        return 0


class KvxConnector(KVConnectorBase_V1):
    """kvx's decode-first KV connector: ``kv_role`` ``kv_consumer`` (decode: its block
    allocation is the reservation the prefill engine writes into) or ``kv_producer``
    (prefill: pushes each layer's KV into the decode engine's granted blocks). Settings:
    ``kv_connector_extra_config`` (``kvx.vllm.settings``). ``transfer`` replaces the
    worker side's transport (tests)."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig",
        transfer: Optional[KvTransfer] = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = settings_from(vllm_config.kv_transfer_config)
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise ConfigError(
                f"KvxConnector: the model has {len(groups)} KV cache groups; one (full "
                "attention) is supported, hybrid models are not yet"
            )
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ConfigError("KvxConnector: pipeline parallelism is not yet supported")
        block_size = vllm_config.cache_config.block_size
        self._decode: Optional[DecodeScheduler] = None
        self._prefill: Optional[PrefillScheduler] = None
        self._worker: Optional[KvxWorker] = None
        self._registrar: Optional[Registrar] = None
        if role == KVConnectorRole.SCHEDULER:
            s, tp = self.settings, parallel.tensor_parallel_size
            if s.side == "decode":
                # Under llm-d, reservations are registered with the prefill engine, naming
                # this engine's receivers (kvx.vllm.bootstrap).
                self._registrar = Registrar(s.connect_timeout_sec, probe_interval_sec=s.heartbeat_interval_sec,
                                            dead_after_sec=s.heartbeat_timeout_sec)
                endpoints = (tuple(s.alloc_endpoint(r) for r in range(tp)),
                             tuple(s.fabric_endpoint(r) for r in range(tp)))
                self._decode = DecodeScheduler(block_size, self._registrar, endpoints)
            else:
                if s.bootstrap_port is not None and parallel.data_parallel_size > 1:
                    raise ConfigError("KvxConnector: bootstrap_port serves one data-parallel rank; "
                                      "run one prefill engine per port")
                self._prefill = PrefillScheduler(
                    block_size, tp, s.grant_timeout_sec,
                    registrations=None if s.bootstrap_port is None else bootstrap_server(s).registrations,
                )
        else:
            rank = _tp_rank()
            if transfer is None:
                num_blocks = getattr(kv_cache_config, "num_blocks", None)
                transfer = host_buffered(
                    self.settings.side, transfer_for(self.settings, rank, num_blocks, block_size),
                    asks_for_host_buffer(self.settings), self.settings.kv_buffer_device,
                )
            observability = getattr(vllm_config, "observability_config", None)
            spans = Spans(tracer_for(getattr(observability, "otlp_traces_endpoint", None)))
            self._worker = worker_for(self.settings.side, transfer, rank, spans)

    # ---- scheduler side -------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> Tuple[Optional[int], bool]:
        if self._decode is not None:
            return self._decode.get_num_new_matched_tokens(request, num_computed_tokens)
        assert self._prefill is not None
        return self._prefill.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        side = self._decode or self._prefill
        assert side is not None
        side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        side = self._decode or self._prefill
        assert side is not None
        return KvxConnectorMetadata(side.build_connector_meta(scheduler_output))

    def on_new_request(self, request: "Request") -> None:
        if self._prefill is not None:
            self._prefill.on_new_request(request)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self._decode is not None:
            self._decode.update_connector_output(connector_output.finished_recving)
        elif self._prefill is not None:
            meta = getattr(connector_output, "kv_connector_worker_meta", None)
            report = meta.report if isinstance(meta, KvxWorkerMetadata) else None
            self._prefill.update_connector_output(report, connector_output.finished_sending)

    def request_finished(
        self, request: "Request", block_ids: List[int]
    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        side = self._decode or self._prefill
        assert side is not None
        return side.request_finished(request)

    def has_pending_push_work(self) -> bool:
        return self._prefill is not None and self._prefill.has_pending_push_work()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        # save_kv_layer runs between layers, which a captured CUDA graph would skip.
        return True

    # ---- worker side ----------------------------------------------------------------

    def _w(self) -> KvxWorker:
        assert self._worker is not None, "a worker-side call on the scheduler-side connector"
        return self._worker

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        self._w().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KvxConnectorMetadata)
        self._w().bind(connector_metadata.plan)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # Nothing to start: the prefill engine pushes into the reserved blocks.
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        # A request runs only once its KV is complete (WAITING_FOR_REMOTE_KVS before).
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._w().save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._w().wait_for_save()

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        sending, recving = self._w().get_finished(finished_req_ids)
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self._w().get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        if self._worker is None:
            side = self._decode or self._prefill
            data = side.signals.take() if side is not None else {}
        else:
            data = self._worker.take_counts()
        stats = KvxConnectorStats(data=data)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> Optional[KVConnectorStats]:
        return KvxConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: Dict[type, type], labelnames: List[str],
                           per_engine_labelvalues: Dict[int, List[object]]) -> KvxPromMetrics:
        return KvxPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        report = self._w().take_report()
        return KvxWorkerMetadata(report) if report is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._registrar is not None:
            self._registrar.close()
