"""What the machine offers: the device tier (CUDA, or CPU memory standing in) and RAM."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    name: str
    torch_device: torch.device
    default_budget: int  # bytes the tiers may use when --gpu-memory is not given

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.type == "cuda"


def device_info() -> DeviceInfo:
    """CUDA when present (90 % of free memory); otherwise a CPU-simulated device (half the RAM)."""
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return DeviceInfo(f"cuda ({torch.cuda.get_device_name()})", torch.device("cuda"), int(free * 0.9))
    return DeviceInfo("cpu (simulated device)", torch.device("cpu"), available_ram() // 2)


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30  # no /proc: assume a modest machine


def ram_default_budget() -> int:
    return int(available_ram() * 0.9)
