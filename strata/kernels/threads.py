"""Small torch products on one thread.

torch's CPU operators split even a decode step's tiny products (a router's 128x2048 matrix, a few
heads' attention) over an OpenMP team and wait at its barrier. On cores shared with other
processes one descheduled thread then stalls every such operator: SmolLM2 at 2 threads beside one
busy process ran at 7.6 tok/s, and 43 with its attention on one thread; a 4-layer qwen3-30b's four
router products took 18 ms per token. Below SMALL_WORK multiply-adds one thread is as fast on an
idle machine and does not wait on a peer; above it the team's share of the work pays.
"""

import torch

SMALL_WORK = 1 << 22


class one_thread_if_small:
    """`with one_thread_if_small(macs, device):` runs the block with torch on one thread when the
    work is on the CPU and `macs` is below SMALL_WORK (and restores the count after); otherwise
    it changes nothing."""

    __slots__ = ("macs", "threads")

    def __init__(self, macs: int, device: torch.device | str = "cpu"):
        self.macs = macs if torch.device(device).type == "cpu" else SMALL_WORK + 1
        self.threads = 0

    def __enter__(self):
        if self.macs <= SMALL_WORK and not torch.compiler.is_compiling():  # (a traced step keeps its threads)
            n = torch.get_num_threads()
            if n > 1:
                self.threads = n
                torch.set_num_threads(1)
        return self

    def __exit__(self, *exc):
        if self.threads:
            torch.set_num_threads(self.threads)
        return False
