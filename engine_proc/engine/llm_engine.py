"""LLMEngine: requests in, tokens out, one scheduler step at a time.

Its other concepts live beside it, as mixins over the state built here (parts.py): tokenization
(tokens.py), step outputs (step_outputs.py), live control and state (control.py), speculative
decoding (speculation.py) and the batch API (batch.py); device and decode-weight choice in
device.py.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections.abc import Callable

import torch

from engine_proc.attention import select_backend
from engine_proc.attention.kv_fp8 import calibrate_fp8_scales, calibration_token_ids
from engine_proc.attention.kv_quant import SCALE_DTYPE as KV_SCALE_DTYPE
from engine_proc.attention.kv_quant import kv_bytes_per_token, resolve_kv_cache_dtype
from engine_proc.attention.kv_quant import pool_dtype as kv_pool_dtype
from engine_proc.config import EngineConfig, largest_chunk
from engine_proc.core.kv_cache_manager import KVCacheManager, root_hash
from engine_proc.core.kv_sizing import (
    block_bytes,
    max_sequence_tokens,
    pool_blocks,
)
from engine_proc.core.request import Sequence
from engine_proc.core.scheduler import Scheduler, SchedulerLimits
from engine_proc.detokenizer import IncrementalDetokenizer
from engine_proc.engine.batch import BatchGeneration
from engine_proc.engine.control import LiveControl
from engine_proc.engine.device import resolve_decode_weights, resolve_device
from engine_proc.engine.kv_layout import choose_kv_layout
from engine_proc.engine.metrics import RequestHistograms
from engine_proc.engine.speculation import Speculation
from engine_proc.engine.step_outputs import StepOutputs
from engine_proc.engine.telemetry import EngineStats
from engine_proc.engine.telemetry_types import StepStats
from engine_proc.engine.tokens import Prompt, Tokenization
from engine_proc.executor.model_runner import ModelRunner
from engine_proc.kv_store.entry import BlockLayout
from engine_proc.kv_store.tiers import KVTiers, model_fingerprint
from engine_proc.kv_transfer.transfer import KVTransfer, KVTransferRequest
from engine_proc.loading.loader import Checkpoint, load_checkpoint
from engine_proc.models.config import longrope_original
from engine_proc.models.llama import LlamaModel
from engine_proc.outputs import RequestMetrics, RequestOutput
from engine_proc.sampling_params import SamplingParams
from engine_proc.structured.manager import StructuredOutputs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}



class LLMEngine(Tokenization, StepOutputs, LiveControl, Speculation, BatchGeneration):
    def __init__(
        self,
        config: EngineConfig,
        progress: Callable[[float, str], None] | None = None,
        checkpoint: Checkpoint | None = None,
    ) -> None:
        self.config = config
        self.clock = time.monotonic
        self.device = resolve_device(config.device)
        self.dtype = _DTYPES[config.dtype]
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        ckpt = checkpoint or load_checkpoint(config.model, self.dtype, progress)
        self.checkpoint_name = ckpt.display_name
        self.model_config = mc = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.model_id = f"{ckpt.model_id}|{config.dtype}"
        ckpt_model_id = ckpt.model_id
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        self.decode_weights = resolve_decode_weights(config.decode_weights, mc, self.device)
        self.model = LlamaModel(
            mc, ckpt.weights, self.dtype, self.device, self.max_model_len, self.decode_weights
        )
        del ckpt
        self.kv_cache_dtype = kv_dtype = resolve_kv_cache_dtype(
            config.kv_cache_dtype, self.dtype, self.decode_weights, self.model.native_bf16
        )
        self.kv_bytes_per_token = kv_bytes_per_token(
            kv_dtype, mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype.itemsize
        )
        self.kv_layout = layout = choose_kv_layout(mc, config, kv_dtype, self.max_model_len)
        self.block_size = config.block_size
        # a block (page) holds group_size layers: every layer without groups
        self.block_bytes = block_bytes(
            kv_dtype, layout, mc.num_kv_heads, mc.head_dim, self.dtype.itemsize, self.block_size
        )
        num_blocks = pool_blocks(config.num_kv_blocks, config.kv_cache_memory, self.block_bytes)
        kv_cache = torch.zeros(
            (layout.group_size, 2, num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim),
            dtype=kv_pool_dtype(kv_dtype, self.dtype),
            device=self.device,
        )
        kv_scales = None  # int8: a float16 scale per token, layer, K/V and KV head
        if kv_dtype == "int8":
            kv_scales = torch.ones(kv_cache.shape[:-1], dtype=KV_SCALE_DTYPE, device=self.device)
        kv_layer_scales = None  # fp8: one scale per layer for K and V, from a fixed prompt
        if kv_dtype == "fp8":
            if progress is not None:
                progress(0.98, "calibrating the fp8 KV cache's scales")
            ids = calibration_token_ids(self.tokenizer)[: self.max_model_len]
            kv_layer_scales = calibrate_fp8_scales(self.model, ids, self.block_size)
        logger.info(
            "KV cache %s: %d B/token (2 x %d layers x %d kv heads x %d dim, %s); pool %d blocks "
            "x %d tokens = %.1f MiB",
            kv_dtype,
            self.kv_bytes_per_token,
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            {"int8": "1 B + a 2 B scale per head", "fp8": "1 B", "fp16": "2 B", "fp32": "4 B"}.get(
                kv_dtype, f"{self.dtype.itemsize} B"
            ),
            num_blocks,
            self.block_size,
            kv_cache.nbytes / 2**20,
        )
        self.num_blocks = num_blocks
        self.backend = select_backend(config.attention_backend, self.device, kv_dtype)
        self.runner = ModelRunner(
            self.model, kv_cache, self.backend, kv_scales, self.dtype, kv_layer_scales,
            decode_step=config.decode_step, layout=layout,
            decode_activations=config.decode_activations,
        )  # fmt: skip
        graphs = config.cuda_graphs and self.device.type == "cuda" and self.backend.graph_safe
        if graphs and mc.has_experts:
            # models/moe.py sizes each expert's product from the routing (a host sync), which a
            # CUDA graph cannot record
            logger.warning("%s has routed experts, whose decode steps CUDA graphs cannot "
                           "record yet: decoding eagerly", mc.architecture)  # fmt: skip
            graphs = False
        if graphs and layout.is_hybrid:
            # the graphs hold one slot mapping and block table, not a table per KV group
            logger.warning("%s's hybrid KV cache has a block table per group of layers, which "
                           "the decode CUDA graphs do not hold yet: decoding eagerly",
                           mc.architecture)  # fmt: skip
            graphs = False
        if graphs:
            self._capture_decode_graphs(progress)
        self.kv = KVCacheManager(num_blocks, self.block_size, config.enable_prefix_caching,
                                 layout.windows)  # fmt: skip
        # The root of every prefix-hash chain: all that changes K/V contents besides the tokens
        # (deterministic across processes, so disk entries are found again after a restart).
        self.cache_identity = (
            f"{self.model_id}|rev={model_fingerprint(ckpt_model_id)}|kv_dtype={self.kv_cache_dtype}"
            f"|block_size={self.block_size}"
        )
        if kv_layer_scales is not None:  # fp8 codes mean nothing without their scales
            digest = hashlib.sha256(kv_layer_scales.detach().cpu().float().numpy().tobytes())
            self.cache_identity += f"|fp8_scales={digest.hexdigest()[:16]}"
        if config.kv_host_memory or config.kv_disk_dir is not None:
            if layout.has_sliding_groups:
                raise ValueError(
                    "kv_host_memory / kv_disk_dir (KV tiers) do not hold a hybrid KV cache's "
                    f"sliding-window groups yet ({mc.architecture}); leave hybrid_kv unset, or "
                    "set it False (--hybrid-kv auto / off)")
            self.kv.attach_tiers(
                KVTiers(
                    kv_cache,
                    root_hash(self.cache_identity, None),
                    host_bytes=config.kv_host_memory,
                    disk_dir=config.kv_disk_dir,
                    disk_bytes=config.kv_disk_bytes,
                    write_through=config.kv_tier_policy == "write_through",
                    kv_scales=kv_scales,  # a tier entry carries the block's scales too
                )
            )
        # Prefill/decode disaggregation: leases and adoption of pulled blocks.
        self.transfer = KVTransfer(
            self.kv, BlockLayout([kv_cache] + ([kv_scales] if kv_scales is not None else []))
        )
        self.scheduler = Scheduler(
            self.kv,
            SchedulerLimits(
                config.max_num_seqs, config.max_num_batched_tokens, config.long_prefill_chunk
            ),
            longrope_original=longrope_original(mc),
        )
        self.proposer = self._speculation(config)
        if self.proposer is not None:
            self.scheduler.propose = self._propose
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.requests: dict[str, list[Sequence]] = {}
        # Grammars: requests wait there, outside the scheduler, while theirs compiles; the ids
        # and reasons of those refused since the server last took them (invalid_request).
        self.structured = StructuredOutputs(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        self.refusals: dict[str, str] = {}
        self.stats = EngineStats()
        self.histograms = RequestHistograms.create(self.max_model_len)
        self._seed_rng = random.Random(config.seed)
        logger.info(
            "engine ready: %s on %s (%s), attention backend %s",
            self.checkpoint_name,
            self.device,
            config.dtype,
            self.backend.name,
        )

    def _capture_decode_graphs(self, progress: Callable[[float, str], None] | None) -> None:
        if progress is not None:
            progress(0.99, "capturing decode CUDA graphs")
        try:
            self.runner.enable_decode_graphs(self.config.max_num_seqs, self.max_model_len)
        except Exception:  # a driver or capture problem costs speed, never service
            logger.warning("CUDA graph capture failed; decode steps run eagerly", exc_info=True)
            self.runner.decode_graphs = None
            # A capture invalidated mid-way can leave its side stream current: serve on the
            # device's default stream again.
            torch.cuda.synchronize(self.device)
            torch.cuda.set_stream(torch.cuda.default_stream(self.device))

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        kv_transfer: KVTransferRequest | None = None,
    ) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an active request")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string or None, got {cache_salt!r}")
        vocab = self.model_config.vocab_size
        bad_bias = sorted(t for t in params.logit_bias if t >= vocab)
        if bad_bias:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}); got {bad_bias[:5]}")
        prompt_ids = self.tokenize(prompt)
        limit = self.max_total_tokens
        given = list(kv_transfer.output_token_ids) if kv_transfer is not None else []
        if given:
            self._check_given_outputs(given, params)
        if len(prompt_ids) + len(given) >= limit:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; it must be shorter than the context limit "
                f"of {limit} tokens (max_model_len {self.max_model_len}, KV pool "
                f"{self.num_blocks} blocks x {self.block_size})"
            )
        now = self.clock()
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(
            request_id=request_id,
            index=0,
            token_ids=list(prompt_ids) + given,
            num_prompt_tokens=len(prompt_ids),
            params=params,
            seed=seed,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop),
            metrics=RequestMetrics(now, None, None, None),
            root_hash=root_hash(self.cache_identity, cache_salt),
            max_total_tokens=limit,
            eos_token_ids=self.eos_token_ids,
            num_forks=params.n,
            num_tools=len(getattr(prompt, "tools", None) or []),  # a ChatPrompt's
        )
        if kv_transfer is not None:
            if self.kv_layout.has_sliding_groups:
                raise ValueError("kv_transfer (disaggregated prefill/decode) does not carry a "
                                 "hybrid KV cache's sliding-window groups yet; serve this model "
                                 "colocated, or with hybrid_kv=False "
                                 "(--hybrid-kv off)")  # fmt: skip
            self._take_over(seq, kv_transfer)
        # A constraint that is known not to compile raises here (ValueError); one that is
        # compiling parks the sequence until step() finds its grammar ready.
        ready = params.structured is None or self.structured.admit(seq)
        self.requests[request_id] = [seq]
        if ready:
            self.scheduler.add(seq)
        self.stats.request_prompt_tokens_total += len(prompt_ids)

    def _check_given_outputs(self, given: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in given):
            raise ValueError(f"kv_transfer.output_token_ids must be in [0, {vocab}), got {given}")
        if params.n != 1 or len(given) >= params.max_tokens:
            raise ValueError(
                f"kv_transfer.output_token_ids ({len(given)}) needs n == 1 and fewer tokens "
                f"than max_tokens ({params.max_tokens})"
            )

    def _take_over(self, seq: Sequence, kv_transfer: KVTransferRequest) -> None:
        """A disaggregated request: lease its prompt at the end (prefill role), or continue
        after the tokens a prefill engine produced, on the blocks it pulled (decode role)."""
        seq.lease_on_finish = kv_transfer.do_remote_decode
        if seq.num_output_tokens:
            det = seq.detokenizer
            det.add_tokens(seq.output_token_ids)  # their text was streamed by the prefill engine
            det.emitted = len(det.text)
        if kv_transfer.payloads or seq.num_output_tokens:
            seq.held_blocks = self.transfer.adopt(seq, kv_transfer.payloads)

    @property
    def max_total_tokens(self) -> int:
        chunk = largest_chunk(self.config.long_prefill_chunk, self.config.max_num_batched_tokens)
        return max_sequence_tokens(self.kv_layout, self.num_blocks, self.block_size, chunk,
                                   self.max_model_len)  # fmt: skip

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        seqs = self.requests.get(request_id)
        if seqs is None:
            raise ValueError(f"request_id {request_id!r} is not an active request")
        outputs = []
        self.structured.discard(request_id)
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                outputs.append(self._finish(seq, "abort", "aborted by the client"))
        self.requests.pop(request_id, None)
        return outputs

    def is_active(self, request_id: str) -> bool:
        return request_id in self.requests

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ----------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        if self.structured.parked:
            self._admit_structured()
        if self.proposer is not None:
            self._prepare_drafts()
        batch = self.scheduler.schedule()
        self.stats.num_preemptions += len(batch.preempted)
        self.stats.prefix_cache_queries += batch.prefix_cache_queries
        self.stats.prefix_cache_hits += batch.prefix_cache_hits
        if batch.is_empty:
            # Nothing to run but grammars compiling: wait for one rather than spin.
            self.structured.wait(0.005)
            return []
        start = self.clock()
        for seq in batch.seqs:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = start
            if seq.held_blocks:  # admitted: its own block table references them now
                self.transfer.release_held(seq)
        try:
            logits, sampling = self.runner.execute(batch)
        except Exception as exc:  # keep serving everyone else's next requests
            logger.exception(
                "forward pass failed; failing the %d sequences of this step", len(batch.seqs)
            )
            self.kv.pending_stores.clear()  # their K/V was never written
            return self._fail_batch(batch, f"engine error: {exc}")
        if self.kv.pending_stores:
            self.kv.flush_pending_stores()
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
        self.stats.prompt_tokens_total += batch.num_prefill_tokens
        self.histograms.observe_step(batch.num_prefill_tokens + batch.num_decode_tokens)
        outputs = self._sample_and_emit(logits, sampling)
        end = self.clock()
        self.stats.steps.append(
            StepStats(
                end,
                end - start,
                batch.num_prefill_tokens,
                batch.num_decode_tokens,
                len(self.scheduler.running),
                len(self.scheduler.waiting),
            )
        )
        return outputs

    def _admit_structured(self) -> None:
        admission = self.structured.poll()
        for seq in admission.ready:
            self.scheduler.add(seq)
        for request_id, why in admission.refused:
            self.requests.pop(request_id, None)
            self.refusals[request_id] = why
            logger.info("request %s refused: %s", request_id, why)

    def take_refusals(self) -> dict[str, str]:
        """Requests refused after add_request returned (their grammar did not compile), with
        why; the server answers each with invalid_request."""
        out, self.refusals = self.refusals, {}
        return out
