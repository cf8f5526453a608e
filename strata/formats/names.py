"""GGUF tensor-name patterns that more than one layer matches (the planner, its auto mode)."""

from __future__ import annotations

import re

EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")  # a layer's stacked experts
