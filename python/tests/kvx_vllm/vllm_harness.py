"""Drives vLLM's real v1 ``Scheduler`` (CPU, a tiny Llama config, no weights) with a
``KvxConnector`` built by vLLM's own factory from ``--kv-transfer-config`` values, and a
worker-side ``KvxConnector`` over ``FakeTransfer``, stepping them as vLLM's engine core and
model runner do (``KVConnectorModelRunnerMixin``'s order of calls), with fake model outputs."""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
from typing import Any, Callable, Dict, List, Optional

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ObservabilityConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvx.vllm.connector import KvxConnector
from fake_transfer import FakeTransfer

BLOCK_SIZE = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
EOS = 2


@functools.lru_cache(maxsize=None)
def tiny_model_dir() -> str:
    """A model directory with only a config.json: enough for vLLM's scheduler. One per
    process (the exhaustive search makes thousands of engines), removed at exit."""
    path = tempfile.mkdtemp(prefix="kvx-vllm-model-")
    atexit.register(shutil.rmtree, path, True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": len(LAYERS),
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": EOS,
        "torch_dtype": "float32",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


class Engine:
    """One engine: the real scheduler, one worker-side connector, fake model outputs."""

    def __init__(
        self,
        role: str,
        *,
        num_blocks: int = 64,
        max_batched_tokens: int = 2048,
        failure_policy: str = "fail",
        extra: Optional[Dict[str, Any]] = None,
        prefix_caching: bool = False,
        multi: bool = False,
        transfer: Optional[Any] = None,
        otlp_traces_endpoint: Optional[str] = None,
    ) -> None:
        model = ModelConfig(
            model=tiny_model_dir(),
            tokenizer=None,
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=4096,
            seed=0,
        )
        kvx_child = {
            "kv_connector": "KvxConnector",
            "kv_connector_module_path": "kvx.vllm",
            "kv_role": role,
            "kv_connector_extra_config": dict(extra or {}),
        }
        if multi:  # kvx as a child of vLLM's MultiConnector
            kv = KVTransferConfig(
                kv_connector="MultiConnector",
                kv_role=role,
                kv_load_failure_policy=failure_policy,
                kv_connector_extra_config={"connectors": [kvx_child]},
            )
        else:
            kv = KVTransferConfig(kv_load_failure_policy=failure_policy, **kvx_child)
        self.config = VllmConfig(
            model_config=model,
            cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching),
            scheduler_config=SchedulerConfig(
                max_num_seqs=16,
                max_num_batched_tokens=max_batched_tokens,
                max_model_len=4096,
                is_encoder_decoder=False,
                enable_chunked_prefill=True,
            ),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=kv,
            observability_config=ObservabilityConfig(otlp_traces_endpoint=otlp_traces_endpoint),
        )
        self.config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float32)
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        )
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BLOCK_SIZE,
        )
        # As vLLM's EngineCore does when a KV connector is set: requests carry block hashes.
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self.transfer = transfer if transfer is not None else FakeTransfer()
        if multi:
            self.worker: Any = MultiConnector(self.config, KVConnectorRole.WORKER, kv_cache_config)
            (child,) = self.worker.sub_connectors
            child._worker.transfer = self.transfer
        else:
            self.worker = KvxConnector(
                self.config, KVConnectorRole.WORKER, kv_cache_config, transfer=self.transfer
            )
        # CPU paged KV as vLLM's CPU attention backend lays it out (0.32, 0.33): one float32
        # tensor per layer, [num_blocks, num_kv_heads, block_size, 2 * head_size].
        self.kv_caches = {name: torch.zeros(num_blocks, 2, BLOCK_SIZE, 2 * 16) for name in LAYERS}
        self.worker.register_kv_caches(self.kv_caches)
        self.outputs: List[Any] = []

    @property
    def connector(self) -> KvxConnector:
        conn = self.scheduler.connector
        if isinstance(conn, MultiConnector):
            (conn,) = conn.sub_connectors
        assert isinstance(conn, KvxConnector)
        return conn

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def add(self, req_id: str, prompt_len: int, params: Optional[Dict[str, Any]], max_tokens: int = 4,
            tokens: Optional[List[int]] = None, trace_headers: Optional[Dict[str, str]] = None) -> Request:
        """Adds a request of ``prompt_len`` tokens (or the prompt ``tokens``), with the W3C
        trace context ``trace_headers`` as vLLM's server hands it on."""
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if params is not None:
            sampling.extra_args = {"kv_transfer_params": params}
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(tokens) if tokens is not None else [10 + i % 500 for i in range(prompt_len)],
            sampling_params=sampling,
            pooling_params=None,
            block_hasher=self.block_hasher,
            trace_headers=trace_headers,
        )
        self.scheduler.add_request(request)
        return request

    def step(self, forward: Optional[Callable[[Any], None]] = None) -> Any:
        """One engine step: schedule, the model runner's connector calls around a fake
        forward (every layer's save_kv_layer, after ``forward(scheduler_output)`` when given,
        which may fill the computed blocks), then the scheduler's update."""
        so = self.scheduler.schedule()
        w = self.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(None)
        if so.total_num_scheduled_tokens > 0:
            if forward is not None:
                forward(so)
            for name in LAYERS:
                w.wait_for_layer_load(name)
                w.save_kv_layer(name, self.kv_caches[name], None)
        w.wait_for_save()
        results = w.get_transfer_results(so.finished_req_ids)
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        w.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[self._sampled(r) for r in req_ids],
            kv_connector_output=kv_out,
        )
        out = self.scheduler.update_from_output(so, runner)
        self.outputs.append(out)
        return so

    def _sampled(self, req_id: str) -> List[int]:
        # As the model runner: a partial prefill samples nothing (schedule() has already
        # advanced num_computed_tokens past this step's tokens).
        request = self.scheduler.requests[req_id]
        return [100] if request.num_computed_tokens >= request.num_tokens else []

    def status(self, req_id: str) -> Optional[str]:
        request = self.scheduler.requests.get(req_id)
        return None if request is None else request.status.name

    def finished_outputs(self) -> Dict[str, str]:
        """Request id → finish reason of every finished output so far."""
        done: Dict[str, str] = {}
        for out in self.outputs:
            for engine_outputs in out.values():
                for o in engine_outputs.outputs:
                    if o.finish_reason is not None:
                        done[o.request_id] = str(o.finish_reason)
        return done
