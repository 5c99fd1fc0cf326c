"""LLMEngine: requests in, tokens out, one scheduler step at a time."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import random
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from typing import Any

import torch

from engine_proc.attention import select_backend
from engine_proc.attention.kv_fp8 import calibrate_fp8_scales, calibration_token_ids
from engine_proc.attention.kv_quant import SCALE_DTYPE as KV_SCALE_DTYPE
from engine_proc.attention.kv_quant import kv_bytes_per_token
from engine_proc.attention.kv_quant import pool_dtype as kv_pool_dtype
from engine_proc.config import EngineConfig
from engine_proc.detokenizer import IncrementalDetokenizer
from engine_proc.kv_cache_manager import KVCacheManager, root_hash
from engine_proc.kv_events import KVEvent, KVEventLog, full_replay
from engine_proc.kv_tier_entry import BlockLayout
from engine_proc.kv_tiers import KVTiers, model_fingerprint
from engine_proc.kv_transfer import KVTransfer, KVTransferRequest
from engine_proc.metrics import RequestHistograms
from engine_proc.model_loader import Checkpoint, load_checkpoint
from engine_proc.model_runner import ModelRunner
from engine_proc.models.config import ModelConfig
from engine_proc.models.llama import LlamaModel, int4_unsupported_reason
from engine_proc.outputs import RequestMetrics, RequestOutput, TokenLogprobs
from engine_proc.request import Sequence, SequenceStatus
from engine_proc.sampler import RawLogprobs, compute_logprobs, sample
from engine_proc.sampling_params import SamplingParams
from engine_proc.scheduler import ScheduledBatch, Scheduler, SchedulerLimits
from engine_proc.telemetry import EngineStats, build_snapshot
from engine_proc.telemetry_types import EngineSnapshot, StepStats, TokenEvent

logger = logging.getLogger(__name__)

Prompt = str | list[int] | list[dict[str, str]]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CHAT_ROLES = ("system", "user", "assistant", "tool")


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        progress: Callable[[float, str], None] | None = None,
        checkpoint: Checkpoint | None = None,
    ) -> None:
        self.config = config
        self.clock = time.monotonic
        self.device = _resolve_device(config.device)
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
        self.decode_weights = _resolve_decode_weights(config.decode_weights, mc, self.device)
        self.model = LlamaModel(
            mc, ckpt.weights, self.dtype, self.device, self.max_model_len, self.decode_weights
        )
        del ckpt
        self.kv_cache_dtype = kv_dtype = config.kv_cache_dtype
        self.kv_bytes_per_token = kv_bytes_per_token(
            kv_dtype, mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype.itemsize
        )
        self.block_size = config.block_size
        self.block_bytes = self.kv_bytes_per_token * self.block_size
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_memory // self.block_bytes)
        kv_cache = torch.zeros(
            (mc.num_layers, 2, num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim),
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
            {"int8": "1 B + a 2 B scale per head", "fp8": "1 B"}.get(
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
            decode_step=config.decode_step,
        )  # fmt: skip
        if config.cuda_graphs and self.device.type == "cuda" and self.backend.graph_safe:
            self._capture_decode_graphs(progress)
        self.kv = KVCacheManager(num_blocks, self.block_size, config.enable_prefix_caching)
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
        )
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.requests: dict[str, list[Sequence]] = {}
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
        )
        if kv_transfer is not None:
            self._take_over(seq, kv_transfer)
        self.requests[request_id] = [seq]
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
        # One sequence must always fit in the pool by itself, or it could preempt itself forever.
        return min(self.max_model_len, self.num_blocks * self.block_size)

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = self.tokenize_text(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.tokenize_chat(prompt)
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        else:
            raise ValueError(
                "prompt must be a non-empty string, a list of token ids, or a list of chat "
                "messages {'role', 'content'}"
            )
        if not ids:
            raise ValueError("prompt must not be empty (it has no tokens)")
        return ids

    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of plain text (with BOS, as a text prompt is tokenized, by default)."""
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a string, got {type(text).__name__}")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def detokenize(self, token_ids: list[int]) -> str:
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"token ids must be integers in [0, {vocab}); got {bad[:5]}")
        return self.tokenizer.decode(token_ids)

    def tokenize_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a conversation under the model's chat template."""
        for i, m in enumerate(messages):
            if m.get("role") not in _CHAT_ROLES:
                raise ValueError(
                    f"messages[{i}].role must be one of {_CHAT_ROLES}, got {m.get('role')!r}"
                )
            if not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}].content must be a string")
        if not messages:
            raise ValueError("messages must not be empty")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"the model {self.checkpoint_name!r} has no chat template: send a plain prompt "
                "(/v1/completions) instead of chat messages"
            )
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        seqs = self.requests.get(request_id)
        if seqs is None:
            raise ValueError(f"request_id {request_id!r} is not an active request")
        outputs = []
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
        batch = self.scheduler.schedule()
        self.stats.num_preemptions += len(batch.preempted)
        self.stats.prefix_cache_queries += batch.prefix_cache_queries
        self.stats.prefix_cache_hits += batch.prefix_cache_hits
        if batch.is_empty:
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

    def _sample_and_emit(
        self, logits: torch.Tensor, sampling: list[Sequence]
    ) -> list[RequestOutput]:
        if not sampling:
            return []
        rows: list[int] = []
        seqs: list[Sequence] = []
        for row, seq in enumerate(sampling):
            family = [seq] + (self._fork(seq) if seq.num_forks > 1 else [])
            rows.extend([row] * len(family))
            seqs.extend(family)
        if len(rows) != len(sampling):
            logits = logits[torch.tensor(rows, device=logits.device)]
        params = [s.params for s in seqs]
        tokens = sample(
            logits,
            params,
            [s.seed for s in seqs],
            [s.num_output_tokens for s in seqs],
            [s.token_ids for s in seqs],
            [s.num_prompt_tokens for s in seqs],
        )
        logprobs = compute_logprobs(logits, [p.logprobs for p in params], tokens)
        now = self.clock()
        outputs = []
        for seq, token, raw in zip(seqs, tokens, logprobs, strict=True):
            seq.append_token(token, now)
            self.stats.generation_tokens_total += 1
            self.stats.token_events.append(
                TokenEvent(seq.display_id, seq.num_output_tokens - 1, now)
            )
            hit_stop = seq.detokenizer.add_tokens([token])
            reason = seq.check_stop(hit_stop)
            if reason is not None:
                handoff = None
                if seq.lease_on_finish and reason == "length":
                    handoff = self.transfer.lease(seq, now)
                self.scheduler.remove(seq)
                out = self._finish(seq, reason, None, new_token_ids=[token])
                out.kv_handoff = handoff
            else:
                out = self._output(seq, [token], seq.detokenizer.take_delta(final=False))
            if raw is not None:
                out.new_logprobs = [self._token_logprobs(token, raw)]
            outputs.append(out)
        return outputs

    def _token_logprobs(self, token: int, raw: RawLogprobs) -> TokenLogprobs:
        decode = self.tokenizer.decode
        top = [(t, decode([t]), lp) for t, lp in raw[1]]
        return TokenLogprobs(token, decode([token]), raw[0], top)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """The prompt is computed: split into n sequences sharing its blocks."""
        children = []
        for index in range(1, parent.num_forks):
            child = Sequence(
                request_id=parent.request_id,
                index=index,
                token_ids=list(parent.token_ids),
                num_prompt_tokens=parent.num_prompt_tokens,
                params=parent.params,
                seed=_child_seed(parent.seed, index),
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, parent.token_ids, parent.params.stop
                ),
                metrics=RequestMetrics(
                    parent.metrics.arrival_time, parent.metrics.first_scheduled_time, None, None
                ),
                root_hash=parent.root_hash,
                max_total_tokens=parent.max_total_tokens,
                eos_token_ids=parent.eos_token_ids,
                num_cached_tokens=parent.num_cached_tokens,
            )
            self.kv.fork(parent, child)
            self.scheduler.add_forked(child)
            self.requests[parent.request_id].append(child)
            children.append(child)
        parent.num_forks = 1
        return children

    def _fail_batch(self, batch: ScheduledBatch, message: str) -> list[RequestOutput]:
        outputs = []
        for seq in batch.seqs:
            # Blocks hashed for this step never got their K/V: they must not be hit later.
            first_unwritten = seq.num_computed_tokens // self.block_size
            self.scheduler.remove(seq, keep_hashes_below=first_unwritten)
            outputs.append(self._finish(seq, "error", message))
        for request_id in {s.request_id for s in batch.seqs}:
            for seq in self.requests.get(request_id, []):
                if not seq.is_finished:
                    self.scheduler.remove(seq)
                    outputs.append(self._finish(seq, "error", message))
        return outputs

    def _finish(
        self, seq: Sequence, reason: str, error: str | None, new_token_ids: list[int] | None = None
    ) -> RequestOutput:
        seq.status = SequenceStatus.FINISHED
        seq.num_forks = 1  # a request that ends before its prompt is done never forks
        self.transfer.release_held(seq)
        seq.finish_reason = reason
        seq.error = error
        seq.metrics.finished_time = self.clock()
        self.stats.num_requests_finished += 1
        self.histograms.observe_finished(seq)
        family = self.requests.get(seq.request_id, [])
        if family and all(s.is_finished for s in family):
            del self.requests[seq.request_id]
        out = self._output(seq, new_token_ids or [], seq.detokenizer.take_delta(final=True))
        out.finish_reason = reason
        out.error = error
        out.metrics = seq.metrics
        return out

    def _output(self, seq: Sequence, new_ids: list[int], delta: str) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=new_ids,
            text_delta=delta,
            token_ids=seq.output_token_ids,
            text=seq.detokenizer.text[: seq.detokenizer.emitted],
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=seq.metrics,  # token times of every output so far, for streaming clients
        )

    # ----------------------------------------------------------------- batch API
    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion together; one output per prompt (per sequence when n > 1),
        in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict))
        ):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        base = f"gen-{id(self)}-{self.clock()}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list, strict=True):
            self.add_request(rid, prompt, p)
        final: dict[tuple[str, int], RequestOutput] = {}
        pending = set(ids)
        while pending:
            for out in self.step():  # other callers' requests may share these steps
                if out.finished and out.request_id in pending:
                    final[(out.request_id, out.index)] = out
            pending = {r for r in pending if r in self.requests}
        order = {rid: i for i, rid in enumerate(ids)}
        return [final[key] for key in sorted(final, key=lambda k: (order[k[0]], k[1]))]

    # ----------------------------------------------------------------- live control and state
    def live_config(self) -> dict[str, int | bool]:
        return dataclasses.asdict(self.scheduler.limits) | {
            "enable_prefix_caching": self.kv.enable_caching
        }

    def set_limits(
        self,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        long_prefill_chunk: int | None = None,
    ) -> dict[str, int | bool]:
        self.scheduler.set_limits(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_chunk=long_prefill_chunk,
        )
        return self.live_config()

    def set_prefix_caching(self, enabled: bool) -> dict[str, int | bool]:
        if not isinstance(enabled, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {enabled!r}")
        self.kv.pool.set_caching(enabled)
        return self.live_config()

    def enable_kv_events(self, log: KVEventLog | None = None) -> None:
        """Record KV cache events (engine_proc/kv_events.py) of the pool and the lower tiers
        into one log (a fresh one unless given) for drain_kv_events()."""
        if self.kv.pool.events is None or log is not None:
            log = log or KVEventLog()
            self.kv.pool.events = log
            if self.kv.tiers is not None:
                self.kv.tiers.set_events(log)
            log.queue_replay(self.kv_event_replay())  # whatever is already cached

    def drain_kv_events(self) -> tuple[list[KVEvent], bool]:
        """Events since the last call, and whether a replay had to replace lost ones."""
        log = self.kv.pool.events
        if log is None:
            return [], False
        events, overflowed = log.drain()
        if overflowed:  # the log was not drained in time: describe the index from scratch
            events = self.kv_event_replay()
        return events, overflowed

    def replay_kv_events(self) -> None:
        """Queue a full replay, for subscribers that lost events."""
        if self.kv.pool.events is not None:
            self.kv.pool.events.queue_replay(self.kv_event_replay())

    def kv_event_replay(self) -> list[KVEvent]:
        """AllBlocksCleared for every medium, then every block of the pool and of each lower
        tier, parents first (engine_proc/kv_events.full_replay)."""
        stored = self.kv.pool.stored_events()
        if self.kv.tiers is not None:
            stored += self.kv.tiers.stored_events()
        return full_replay(stored)

    def reset_prefix_cache(self) -> bool:
        dropped = self.kv.pool.reset_prefix_cache()
        if self.kv.tiers is not None:  # the next request recomputes: lower tiers are emptied too
            self.kv.tiers.clear()
        logger.info("prefix cache reset: %d cached blocks dropped", dropped)
        return True

    def flush_kv_tiers(self) -> int:
        """Write every cached pool block down into the lower KV tiers (write-back only stores
        evicted blocks, so a prefix whose first blocks never left the pool would not survive a
        restart); call before shutting down. Returns the number of blocks offered."""
        tiers = self.kv.tiers
        if tiers is None:
            return 0
        cached = [b for b in self.kv.pool.blocks if b.block_hash is not None]
        for block in cached:
            tiers.store(block.block_hash, block.block_id)
        return len(cached)

    def model_info(self) -> dict[str, Any]:
        mc = self.model_config
        tiers = self.kv.tiers
        return {
            "name": self.checkpoint_name,
            "model_id": self.model_id,
            "architecture": mc.architecture,
            "num_layers": mc.num_layers,
            "num_heads": mc.num_heads,
            "num_kv_heads": mc.num_kv_heads,
            "head_dim": mc.head_dim,
            "vocab_size": mc.vocab_size,
            "dtype": self.config.dtype,
            "device": str(self.device),
            "attention_backend": self.backend.name,
            "decode_weights": self.decode_weights,
            "kv_cache_dtype": self.kv_cache_dtype,
            "cache_identity": self.cache_identity,
            # lower KV tiers (engine_proc/kv_tiers.py): their capacity in bytes, 0 = no such tier
            "kv_host_bytes": self.config.kv_host_memory if tiers and tiers.host else 0,
            "kv_disk_bytes": tiers.disk.capacity_bytes if tiers and tiers.disk else 0,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_pool_bytes": self.num_blocks * self.block_bytes,
            "max_model_len": self.max_model_len,
            "cuda_graph_sizes": (
                self.runner.decode_graphs.batch_sizes if self.runner.decode_graphs else []
            ),
        }

    def all_sequences(self) -> list[Sequence]:
        return [s for family in self.requests.values() for s in family if not s.is_finished]

    def snapshot(self) -> EngineSnapshot:
        snap = build_snapshot(
            now=self.clock(),
            stats=self.stats,
            kv=self.kv,
            seqs=self.all_sequences(),
            num_waiting=len(self.scheduler.waiting),
            block_bytes=self.block_bytes,
            contiguous_bytes_per_request=self.max_model_len * self.kv_bytes_per_token,
            live_config=self.live_config(),
        )
        if self.kv.tiers is not None:
            snap.counters.update(self.kv.tiers.counters())
        snap.counters.update(self.transfer.counters())
        snap.histograms = self.histograms.by_name
        snap.finished_reasons = dict(self.histograms.finished_reasons)
        return snap


def _resolve_decode_weights(choice: str, config: ModelConfig, device: torch.device) -> str:
    if choice != "auto":
        return choice
    why = int4_unsupported_reason(config, device)
    if why is not None:
        logger.info("decode weights: dense (int4 %s)", why)
        return "dense"
    return "int4"


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device 'cuda' was asked for but no CUDA GPU is available; use 'cpu' or 'auto'"
        )
    if dev.type == "cuda":
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {device!r}: this machine has CUDA devices 0..{count - 1}")
        # Triton launches, CUDA graph capture and their streams all follow the *current*
        # device: make it the engine's, or cuda:1 would get kernels aimed at cuda:0.
        torch.cuda.set_device(dev)
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _child_seed(seed: int, index: int) -> int:
    """Seed of sequence `index` of an n > 1 request; sequence 0 keeps the request's seed."""
    return (seed + index * 0x9E3779B97F4A7C15) % 2**63
