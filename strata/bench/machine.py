"""What the numbers were measured on: CPU, cores, RAM, GPU and library versions."""

from __future__ import annotations

import os
import platform


def describe() -> dict:
    import torch

    info = {"cpu": _cpu_name(), "cores": os.cpu_count(), "ram_gib": round(_ram_bytes() / 2**30, 1),
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1)}
    else:
        info["gpu"] = None
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
