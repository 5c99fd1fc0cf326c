"""The engine's batch API: run prompts to completion together (LLM.generate's shape), over the
same requests and steps the server drives one at a time."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from engine_proc.engine.parts import EngineParts
from engine_proc.engine.tokens import Prompt
from engine_proc.outputs import RequestOutput
from engine_proc.sampling_params import SamplingParams


class BatchGeneration(EngineParts):
    """Mixin of LLMEngine: uses its add_request, step, abort_request and refusals."""

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
            refused = [self.refusals.pop(r) for r in pending if r in self.refusals]
            if refused:
                for rid in pending:
                    if rid in self.requests:
                        self.abort_request(rid)
                raise ValueError(refused[0])
            pending = {r for r in pending if r in self.requests}
        order = {rid: i for i, rid in enumerate(ids)}
        return [final[key] for key in sorted(final, key=lambda k: (order[k[0]], k[1]))]
