"""The engine: a loaded model plus the generation API the CLI and the server consume."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, fields
from typing import Iterator

import torch

from strata import kernels
from strata.kernels.gpu import graphs
from strata.errors import BadOption, StrataError
from strata.loader import load_with_tiers
from strata.runtime.generate import DecodeBatch, Sequence
from strata.runtime.sampling import SamplingParams
from strata.runtime.speculative import DraftStats
from strata.runtime.text import Response, StopText
from strata.tiers.options import TierOptions


@dataclass(slots=True)
class EngineOptions(TierOptions):  # tier options (placement, expert cache, trace) come first
    dtype: str = "float32"
    ctx_size: int = 0  # 0 = the model's trained context
    prefill_chunk: int = 8192
    cpu_threads: int = 0  # 0 = torch's default
    exact_activations: bool = False  # CPU kernels keep x in float32 (else 8-bit, as llama.cpp)
    activations: str = ""  # the CPU kernels' activation mode (strata.kernels.ACTIVATIONS); "": as set already
    progress: bool = False  # a progress bar on stderr while loading (the CLI turns it on)
    draft: str = "auto"  # on | off | auto (= on when the model has an MTP layer): speculative decoding
    draft_tokens: int = 2  # tokens the MTP head drafts per verify pass
    kv_device_budget: str | None = None  # --kv-device SIZE: tier the attention KV (device blocks + host RAM)
    expert_parallel: bool = False  # shard experts over a torchrun job's ranks (strata.tiers.expert_parallel)
    ep_trace: str | None = None  # balance the shards by this routing trace's expert use
    dist_timeout: float = 120.0  # seconds a rank may take to join or answer
    ep_comm: str = "broadcast"  # broadcast | alltoall: how a layer's tokens reach the ranks
    cuda_graphs: str = "auto"  # auto (on when the blocks run on CUDA) | on | off: decode steps' dense segments

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineOptions":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise BadOption(f"unknown option {unknown[0]!r}", f"known options: {', '.join(sorted(known))}")
        opts = cls(**kwargs)
        if opts.dtype not in ("float32", "bfloat16", "float16"):
            raise BadOption(f"dtype {opts.dtype!r} is not supported", "use float32, bfloat16 or float16")
        if opts.prefill_chunk <= 0:
            raise BadOption("--prefill-chunk must be positive")
        if opts.draft not in ("on", "off", "auto"):
            raise BadOption(f"draft {opts.draft!r} is not one of on, off, auto")
        if opts.kv_device_budget is not None:  # the size's form now; "one block per layer" once loaded
            from strata.tiers.sizes import parse_size

            parse_size(opts.kv_device_budget, "--kv-device")
        if opts.cuda_graphs not in ("auto", "on", "off"):
            raise BadOption(f"--cuda-graphs {opts.cuda_graphs!r} is not one of auto, on, off")
        if not 1 <= opts.draft_tokens <= 16:
            raise BadOption(f"--draft-tokens must be in 1..16, not {opts.draft_tokens}")
        return opts


def _device() -> torch.device:
    from strata.tiers import hardware

    return hardware.device_info().torch_device


def resident_memory(loaded, options):
    """The all-resident path's RAM lines: weights stay views of the file (page cache), so only the
    context and scratch are counted; the default context is the longest that fits the budget."""
    from strata.tiers import budget, hardware
    from strata.tiers.sizes import parse_size

    ram = parse_size(options.ram_memory, "--ram-memory") if options.ram_memory else hardware.ram_default_budget()
    dtype_bytes = 2 if options.dtype in ("bfloat16", "float16") else 4
    sizes = budget.state_sizes(loaded.source, loaded.config, dtype_bytes)
    trained = getattr(loaded.config, "context_length", 0) or 4096
    ctx = options.ctx_size or budget.choose_context(sizes, loaded.config, ram, trained, options.prefill_chunk,
                                                    dtype_bytes) or budget.MIN_CONTEXT
    kv = budget.context_bytes(sizes, ctx)
    chunk = budget.choose_chunk(loaded.config, ctx, min(options.prefill_chunk, ctx), max(ram - kv, 0), dtype_bytes)
    return budget.MemoryPlan(ram, 0, 0, 0, 0, kv, budget.scratch_bytes(loaded.config, chunk, ctx, dtype_bytes),
                             ctx, not options.ctx_size, chunk)


class Engine:
    """Load once, then `logits`, `generate` or `stream`; `stats` describes the last call."""

    def __init__(self, path, **options):
        self.options = EngineOptions.from_kwargs(**options)
        from strata.tiers.budget import return_large_frees_to_the_os

        return_large_frees_to_the_os()  # so anonymous memory stays what the RAM budget counts
        if self.options.cpu_threads > 0:
            torch.set_num_threads(self.options.cpu_threads)
        mode = self.options.activations
        if self.options.exact_activations:
            if mode not in ("", "float32"):
                raise BadOption(f"--exact-activations and --activations {mode} disagree", "give one of them")
            mode = "float32"
        if mode:
            try:
                kernels.set_activations(mode)
            except ValueError:
                raise BadOption(f"activations {mode!r} is not a mode", f"use one of {', '.join(kernels.ACTIVATIONS)}") from None
        t0 = time.perf_counter()
        loaded, self.tiers, self.kv_tier = load_with_tiers(path, self.options)  # the tiers plug in at construction
        self.model, self.config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.loaded = loaded
        # the RAM budget's lines (tiers/budget.py); under --expert-parallel rank 0's share
        memory = self.tiers.plan.memory if self.tiers is not None else resident_memory(loaded, self.options)
        self.memory = memory
        self.ctx_size = memory.ctx_size if memory is not None else (self.options.ctx_size or self.config.context_length)
        if memory is not None and memory.prefill_chunk < self.options.prefill_chunk:
            self.options.prefill_chunk = memory.prefill_chunk  # the scratch a longer chunk needs does not fit
        # after every placement: the dense segments of a decode step as CUDA graphs (kernels/gpu/graphs.py)
        self.cuda_graphs = graphs.enable(self.model, _device(), self.options.cuda_graphs)
        # speculative decoding with the model's MTP head (every row of a batch drafts)
        self.drafter = getattr(self.model, "mtp", None)
        if self.options.draft == "on" and self.drafter is None:
            why = getattr(self.model, "mtp_skipped", None) or "the model has no MTP (NextN) layer"
            raise BadOption(f"--draft on: {why}", "use --draft off or auto")
        self.drafting = self.drafter is not None and self.options.draft != "off"
        self.stats: dict = {"load_s": time.perf_counter() - t0}

    def summary(self) -> str:
        """One line on what was loaded and where it lives, for the CLI to print."""
        c = self.config
        n_experts = getattr(c, "n_experts", 0)
        what = f"{self.loaded.arch.ARCH}, {c.n_layers} layers" + (f" x {n_experts} experts" if n_experts else "")
        if self.tiers is None:
            where = "all weights in RAM"
        else:
            p = self.tiers.stats()["plan"]
            homes = "+".join(sorted(p["expert_homes"])) or "none"
            where = (f"experts home {homes}, cache {p['slots']} of {p['n_experts']} experts "
                     f"({p['cache_bytes'] / 2**20:.1f} MiB) on {p['device']}, "
                     f"{p['gpu_layers']}/{p['n_layers']} blocks on the device")
        draft = f", drafts {self.options.draft_tokens}" if self.drafting else ""
        chosen = " (the longest that fits the RAM budget; --ctx-size sets it)" if self.memory.ctx_chosen else ""
        return (f"loaded {what} in {self.stats['load_s']:.1f} s; {where}{draft}; context {self.ctx_size}{chosen}; "
                f"RAM planned {self.memory.describe()} of {self.memory.budget / 2**30:.2f} GiB")

    def close(self) -> str | None:
        """Stop the tiers' threads and write the expert trace, if asked; returns its path."""
        return self.tiers.close() if self.tiers is not None else None

    @property
    def eos_ids(self) -> set[int]:
        return set(self.tokenizer.eos_ids) if self.tokenizer is not None else set()

    def _check_prompt(self, ids: list[int]) -> list[int]:
        if not ids:
            raise StrataError("the prompt is empty", "pass at least one token")
        if len(ids) > self.ctx_size:
            raise StrataError(f"the prompt has {len(ids)} tokens but the context holds {self.ctx_size}",
                              "shorten the prompt or raise --ctx-size")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise StrataError(f"token id {bad[0]} is outside the vocabulary (size {self.config.vocab_size})")
        return list(ids)

    def logits(self, token_ids) -> torch.Tensor | list[torch.Tensor]:
        """Logits (T, vocab) of one prompt, or a list of them for a list of prompts."""
        batch = bool(token_ids) and isinstance(token_ids[0], (list, tuple))
        prompts = [self._check_prompt(p) for p in (token_ids if batch else [token_ids])]
        lengths = torch.tensor([len(p) for p in prompts])
        tokens = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
        for row, p in enumerate(prompts):
            tokens[row, : len(p)] = torch.tensor(p)
        with torch.inference_mode():
            out = self.model(tokens, self.model.new_cache(len(prompts)), n_new=lengths).float()
        rows = [out[i, : len(p)] for i, p in enumerate(prompts)]
        return rows if batch else rows[0]

    def generate(self, token_ids, max_new_tokens: int = 128, temperature: float = 0.0,
                 stop_at_eos: bool = True, **sampling) -> list[int] | list[list[int]]:
        """Greedy by default; a list of prompts decodes as one batch."""
        batch = bool(token_ids) and isinstance(token_ids[0], (list, tuple))
        prompts = [self._check_prompt(p) for p in (token_ids if batch else [token_ids])]
        params = SamplingParams(temperature=temperature, **sampling)
        outs = self._generate_batch(prompts, max_new_tokens, params, stop_at_eos)
        return outs if batch else outs[0]

    def _generate_batch(self, prompts, max_new_tokens, params, stop_at_eos) -> list[list[int]]:
        eos = self.eos_ids if stop_at_eos else set()
        seqs = [Sequence(p, params, StopText(None, (), eos, min(max_new_tokens, self.ctx_size - len(p))))
                for p in prompts]
        outs: dict[int, list[int]] = {id(s): [] for s in seqs}
        batch = self.decode_batch()
        t0 = time.perf_counter()
        results = batch.add([s for s in seqs if s.text.limit > 0])
        t_first = time.perf_counter()
        while True:
            for s, responses in results:
                if s.error is not None:
                    raise s.error
                outs[id(s)] += [r.token for r in responses if r.token is not None]
            if not batch.rows:
                break
            results = batch.step()
        done = [outs[id(s)] for s in seqs]
        self._record(sum(len(p) for p in prompts), sum(len(o) for o in done), t0, t_first if any(done) else None,
                     batch.stats)
        return done

    def decode_batch(self, stats: DraftStats | None = None) -> DecodeBatch:
        """A new decode loop over this model: drafting with the MTP head when drafting is on."""
        drafter = self.drafter if self.drafting else None
        return DecodeBatch(self.model, drafter, self.options.draft_tokens, self.options.prefill_chunk, stats)

    def stream(self, token_ids: list[int], max_new_tokens: int = 128, temperature: float = 0.0,
               stop: list[str] = (), stop_at_eos: bool = True, **sampling) -> Iterator[Response]:
        """Yield `Response`s (token, text delta, finish_reason) as tokens are made."""
        prompt = self._check_prompt(token_ids)
        params = SamplingParams(temperature=temperature, **sampling)
        limit = min(max_new_tokens, self.ctx_size - len(prompt))
        if limit <= 0:
            yield Response(None, "", "length")
            return
        eos = self.eos_ids if stop_at_eos else set()
        seq = Sequence(prompt, params, StopText(self.tokenizer, stop, eos, limit))
        batch = self.decode_batch()
        t0, t_first, n = time.perf_counter(), None, 0
        results = batch.add([seq])
        while True:
            for s, responses in results:
                if s.error is not None:
                    raise s.error
                for r in responses:
                    t_first = t_first or time.perf_counter()
                    n += r.token is not None
                    yield r
            if not batch.rows:
                break
            results = batch.step()
        self._record(len(prompt), n, t0, t_first, batch.stats)

    def _record(self, n_prompt: int, n_out: int, t0: float, t_first: float | None,
                draft: DraftStats | None = None) -> None:
        end = time.perf_counter()
        t_first = t_first or end
        decode_s = end - t_first
        self.stats.update({
            "prompt_tokens": n_prompt, "completion_tokens": n_out,
            "prefill_s": t_first - t0, "decode_s": decode_s,
            "prefill_tokens_per_s": n_prompt / max(t_first - t0, 1e-9),
            "decode_tokens_per_s": (n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else 0.0,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        })
        self.stats["tokens_per_s"] = self.stats["decode_tokens_per_s"]
        if draft is not None:  # acceptance of the MTP head's drafts (see strata.runtime.speculative)
            self.stats["draft"] = draft.as_dict()
        else:
            self.stats.pop("draft", None)
        if self.tiers is not None:
            self.stats["tiers"] = self.tiers.stats()
        table = getattr(self.model, "ple_table", None)
        if table is not None:  # the n-gram table's reads from disk, since load
            self.stats["ngram_table"] = table.stats()


def load(path, **options) -> Engine:
    """Open a GGUF file or a Hugging Face directory; see `EngineOptions` for options."""
    return Engine(path, **options)
