"""Grammar compilation off the engine's step loop: a worker thread compiles, a bounded LRU
cache keyed by the constraint's digest keeps the results (compiled grammars and refusals alike,
so a client repeating a bad schema is answered at once).

The step loop never blocks on a compile: it submits, then polls `result()` each step. A
compile that runs past `timeout` is refused; the thread cannot be interrupted (xgrammar has no
cancel), so it finishes in the background and only the worker's next job waits for it."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from engine_proc.structured.grammar import GrammarError, compile_constraint, grammar_key

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (a JSON schema's is tens of KB to a few MB)
COMPILE_TIMEOUT = 10.0  # seconds


@dataclass(slots=True)
class Compiled:
    """A finished compile: the grammar, or why there is none."""

    grammar: Any | None
    error: str | None
    seconds: float


class GrammarCompiler:
    def __init__(self, make_info: Callable[[], Any], cache_size: int = CACHE_SIZE,
                 timeout: float = COMPILE_TIMEOUT) -> None:  # fmt: skip
        # xgrammar's view of the vocabulary takes ~0.3 s to build (49k tokens): built by the
        # worker on its first job, never on the step loop.
        self._make_info = make_info
        self._xgr: Any = None
        # One worker: jobs never race for self._xgr, and compiles take one core at most.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._cache: OrderedDict[str, Future[Compiled]] = OrderedDict()
        self._started: dict[str, float] = {}
        self.cache_size = cache_size
        self.timeout = timeout
        self.clock = time.monotonic

    def submit(self, kind: str, spec: str, field: str) -> str:
        """Start compiling (unless cached); the key to poll `result` with."""
        key = grammar_key(kind, spec)
        if key in self._cache:
            self._cache.move_to_end(key)
            return key
        self._cache[key] = self._pool.submit(self._compile, kind, spec, field)
        self._started[key] = self.clock()
        while len(self._cache) > self.cache_size:
            old, fut = next(iter(self._cache.items()))
            if not fut.done():  # the oldest is still compiling: let the cache run over
                break
            del self._cache[old]
            self._started.pop(old, None)
        return key

    def result(self, key: str, field: str) -> Compiled | None:
        """The compile's outcome, or None while it runs (within the timeout)."""
        fut = self._cache.get(key)
        if fut is None:  # evicted while its request waited (a burst of other grammars)
            return Compiled(None, f"{field}: the grammar was evicted before use; retry", 0.0)
        if fut.done():
            return fut.result()
        started = self._started.get(key, self.clock())
        if self.clock() - started > self.timeout:
            # A later request with the same grammar may find it compiled; this one is refused.
            return Compiled(None, f"{field}: the grammar took longer than {self.timeout:g} s "
                                  "to compile", self.clock() - started)  # fmt: skip
        return None

    def wait_any(self, keys: list[str], timeout: float) -> None:
        """Sleep until one of the compiles ends or `timeout` passes (an idle step loop)."""
        futures = [self._cache[k] for k in keys if k in self._cache]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def _compile(self, kind: str, spec: str, field: str) -> Compiled:
        start = time.perf_counter()
        try:
            if self._xgr is None:
                # xgrammar's own cache off: ours is keyed by the digest and bounded by entries.
                self._xgr = xgr.GrammarCompiler(self._make_info(), max_threads=1,
                                                cache_enabled=False)  # fmt: skip
            grammar = compile_constraint(self._xgr, kind, spec, field)
        except GrammarError as exc:
            return Compiled(None, str(exc), time.perf_counter() - start)
        except Exception as exc:  # a library bug refuses this request, never the engine
            logger.exception("grammar compile failed")
            return Compiled(None, f"{field}: the grammar could not be compiled ({exc})",
                            time.perf_counter() - start)  # fmt: skip
        seconds = time.perf_counter() - start
        logger.debug("compiled a %s grammar in %.1f ms", kind, seconds * 1e3)
        return Compiled(grammar, None, seconds)

    def __len__(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
