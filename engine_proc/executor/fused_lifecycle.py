"""The fused CPU decode step's life in one engine (engine_proc/executor/fused_decode.py): whether
it can serve the model, loading or building the extension (in the background where the engine
starts on the eager path), and the switch to it once it is there."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from types import ModuleType

import torch

from engine_proc.config import SUPPORTED_DECODE_ACTIVATIONS, SUPPORTED_DECODE_STEPS
from engine_proc.executor import fused_build, fused_head
from engine_proc.executor.fused_decode import FusedDecodeStep, architecture_unsupported_reason
from engine_proc.models.llama import LlamaModel

logger = logging.getLogger(__name__)


def unsupported_reason(model: LlamaModel, kv_cache: torch.Tensor, kv_quantized: bool) -> str | None:
    """Why the fused step cannot serve this engine, or None when it can."""
    why = architecture_unsupported_reason(model.config)
    if why is not None:
        return why
    if model.decode_weights != "int4":
        return "needs decode_weights='int4'"
    if model.dtype != torch.float32 or kv_quantized or kv_cache.dtype not in (
        torch.float32, torch.float16
    ):
        return "needs a float32 model and a float32 or fp16 KV cache"
    if kv_cache.device.type != "cpu":
        return "runs on the CPU only"
    return fused_build.build_unavailable_reason()



class FusedDecode:
    """The fused step of one runner, per ``decode_step``: "fused" builds (or loads) it now;
    "auto" loads a finished build now, or builds one on a low-priority background thread (or
    waits there for another process's build, fused_build.py) while the engine decodes eagerly,
    and switches when it is ready; "eager" never uses it. A build that fails, or a model it
    cannot serve, leaves the eager path with a reason (logged, and in ``detail``)."""

    def __init__(
        self, model: LlamaModel, kv_cache: torch.Tensor, kv_quantized: bool, mode: str,
        activations: str = "exact",
    ) -> None:  # fmt: skip
        if mode not in SUPPORTED_DECODE_STEPS:
            raise ValueError(f"decode_step must be one of {SUPPORTED_DECODE_STEPS}, got {mode!r}")
        if activations not in SUPPORTED_DECODE_ACTIVATIONS:
            raise ValueError(f"decode_activations must be one of {SUPPORTED_DECODE_ACTIVATIONS}, "
                             f"got {activations!r}")  # fmt: skip
        self.model = model
        self.activations = activations
        self.step: FusedDecodeStep | None = None
        self.state = "eager"  # "fused" | "building" | "eager"
        # fused: the 4-bit kernel (INT4_KERNELS); building: "here" or "elsewhere" (another
        # process builds it); eager: why (what the window shows)
        self.detail = "decode_step='eager'" if mode == "eager" else ""
        self._pending: Future[ModuleType | str] | None = None
        why = self.detail or unsupported_reason(model, kv_cache, kv_quantized)
        if why is not None and activations == "int8":
            logger.warning("decode_activations='int8' is the fused CPU decode step's, which "
                           "does not run here (%s)", why)
        if mode == "eager":
            return
        if why is not None:
            log = logger.warning if mode == "fused" else logger.info
            log("fused decode step not used: %s; decoding eagerly", why)
            self.detail = why
            return
        found = "built" if mode == "fused" else fused_build.build_state()
        if found == "built":
            self._use(_guarded_load)
        else:
            self.state, self.detail = "building", "elsewhere" if found == "building" else "here"
            self._pending = _build_in_background()

    def ready(self) -> FusedDecodeStep | None:
        """The fused step once it is usable (polls a background build), else None."""
        if self._pending is not None and self._pending.done():
            pending, self._pending = self._pending, None
            self._use(pending.result)
        return self.step

    def _use(self, get_module: Callable[[], ModuleType | str]) -> None:
        module = get_module()
        if isinstance(module, str):  # why it could not be built
            self.state, self.detail = "eager", module
            return
        self.step = FusedDecodeStep.create(self.model, module, activations=self.activations)
        fused_head.use_head_kernel(self.model, module, self.step)
        # the window's status line reads "+int8" as the 8-bit arithmetic (ui/window/decode_status)
        suffix = "+int8" if self.step.int8_activations else ""
        self.state, self.detail = "fused", self.step.int4_kernel + suffix


def _guarded_load() -> ModuleType | str:
    try:
        return fused_build.load_extension()
    except Exception as exc:  # no compiler, a compile error, an unloadable module: stay eager
        logger.warning("fused decode step unavailable (%s); decoding eagerly", exc)
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"the build failed: {first_line[:120]}"  # the log has the whole error


def _build_in_background() -> Future[ModuleType | str]:
    future: Future[ModuleType | str] = Future()

    def build() -> None:
        if sys.platform == "linux":  # nice is per thread on Linux; the compiler inherits it
            os.nice(19)
        logger.info("building the fused decode step in the background (once per machine)")
        future.set_result(_guarded_load())

    threading.Thread(target=build, name="fused-decode-build", daemon=True).start()
    return future
