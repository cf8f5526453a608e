"""Small torch products on one thread.

torch's CPU operators split even a decode step's tiny products (a router's 128x2048 matrix, a few
heads' attention) over an OpenMP team and wait at its barrier. On cores shared with other
processes one descheduled thread then stalls every such operator: SmolLM2 at 2 threads beside one
busy process ran at 7.6 tok/s, and 43 with its attention on one thread; a 4-layer qwen3-30b's four
router products took 18 ms per token. Below SMALL_WORK multiply-adds one thread is as fast on an
idle machine and does not wait on a peer; above it the team's share of the work pays.
"""

import threading

import torch

SMALL_WORK = 1 << 22

_prompt = threading.local()  # .team: the torch thread count a `torch_team_for_large_only` scope lowered to 1


class one_thread_if_small:
    """`with one_thread_if_small(macs, device):` runs the block with torch on one thread when the
    work is on the CPU and `macs` is below SMALL_WORK (and restores the count after); otherwise
    it changes nothing, except inside `torch_team_for_large_only`, where work above SMALL_WORK gets
    the scope's team back for the block."""

    __slots__ = ("macs", "threads")

    def __init__(self, macs: int, device: torch.device | str = "cpu"):
        self.macs = macs if torch.device(device).type == "cpu" else SMALL_WORK + 1
        self.threads = 0

    def __enter__(self):
        if torch.compiler.is_compiling():  # (a traced step keeps its threads)
            return self
        n = torch.get_num_threads()
        if self.macs <= SMALL_WORK:
            if n > 1:
                self.threads = n
                torch.set_num_threads(1)
        elif n == 1 and getattr(_prompt, "team", 0) > 1:  # large work in a one-thread scope: the team
            self.threads = 1
            torch.set_num_threads(_prompt.team)
        return self

    def __exit__(self, *exc):
        if self.threads:
            torch.set_num_threads(self.threads)
        return False


def kernel_threads() -> int:
    """The kernels' pool threads for a call that names none: torch's count, or inside
    `torch_team_for_large_only` the team it lowered (the pool keeps its helpers)."""
    team = getattr(_prompt, "team", 0)
    return team if team > 1 else torch.get_num_threads()


class torch_team_for_large_only:
    """`with torch_team_for_large_only():` runs a prompt's forward with torch on one thread on this
    thread, and only blocks that `one_thread_if_small` finds large (attention, the router, a float
    product) get the caller's team back. A prompt's products run on the kernels' own pool; torch's
    team then only met its barrier on each of a layer's small operators (the KV copy, masks, SiLU,
    residual adds), and its workers spun between them (libgomp's default wait, when torch was
    imported before strata): SmolLM2's pp512 at 2 threads took 2.3-3.5 s of CPU against 0.93 s at
    1 thread, 1.1-1.2 s under OMP_WAIT_POLICY=PASSIVE. The kernels' pool keeps the team's size
    (`kernel_threads`)."""

    __slots__ = ("threads", "before")

    def __enter__(self):
        self.threads, self.before = 0, getattr(_prompt, "team", 0)
        n = torch.get_num_threads()
        if n > 1 and not torch.compiler.is_compiling():
            self.threads = _prompt.team = n
            torch.set_num_threads(1)
        return self

    def __exit__(self, *exc):
        if self.threads:
            _prompt.team = self.before
            torch.set_num_threads(self.threads)
        return False
