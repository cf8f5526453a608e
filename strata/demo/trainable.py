"""The demo's MTP draft layer, trainable: `strata.models.qwen4exp_mtp`'s math on transformers' modules.

At position p it reads the trunk's hidden state h_p (its streams collapsed by the output mixer,
what the LM head reads) and the next token x_{p+1}:

    u = fc_embedding(enorm(embed(x_{p+1}))) + fc_hidden(hnorm(h_p))
    g = body(inputs_embeds=u)      a one-layer qwen4exp text model: u copied into hc streams, one
                                   attention + MoE block, its final mixer (the head's hc_head)
    logits = trunk.lm_head(g)      predicts x_{p+2}

It is trained with the trunk frozen, to match the trunk's own next-token distribution one
position ahead (so a draft is what the trunk would have said: an accepted draft), and it starts
as a near copy of the trunk's last attention layer and output mixer. `hf_tensors()` names its
weights as a checkpoint's `mtp.*`, which Strata's converter maps to llama.cpp's NextN block.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn


def body_config(trunk_config):
    """One indexed-attention layer, no n-gram table, a token vocabulary it never uses."""
    cfg = copy.deepcopy(trunk_config)
    cfg.num_hidden_layers = 1
    cfg.layer_types = ["indexed_attention"]
    cfg.ple_layer_ids = []
    cfg.vocab_size = 8  # the body reads inputs_embeds; its own embedding table stays unused
    return cfg


class TrainableMTP(nn.Module):
    def __init__(self, trunk):
        super().__init__()
        from transformers import Qwen4ExpTextModel
        from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNorm

        c = trunk.config
        h, eps = c.hidden_size, c.rms_norm_eps
        self.fc_embedding = nn.Linear(h, h, bias=False)
        self.fc_hidden = nn.Linear(h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen4ExpTextRMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen4ExpTextRMSNorm(h, eps=eps)
        self.body = Qwen4ExpTextModel(body_config(c))
        self.body.embed_tokens.requires_grad_(False)
        # shared with the trunk, never trained here (kept out of parameters())
        self._trunk = [trunk]

    def init_from_trunk(self, generator: torch.Generator) -> None:
        """Start near "what the trunk says at p": its last attention layer (n-gram input aside) and
        output mixer, the hidden half of the input fusion the identity, the embedding half small."""
        trunk = self._trunk[0].model
        last = max(i for i, t in enumerate(trunk.config.layer_types) if t == "indexed_attention")
        self.body.layers[0].load_state_dict(trunk.layers[last].state_dict())
        self.body.hyper_connection_mixer.load_state_dict(trunk.hyper_connection_mixer.state_dict())
        h = self.fc_hidden.weight.shape[0]
        with torch.no_grad():
            self.fc_hidden.weight.copy_(torch.eye(h))
            self.fc_embedding.weight.copy_(torch.randn(h, h, generator=generator) * 0.02)
            self.pre_fc_norm_embedding.weight.zero_()
            self.pre_fc_norm_hidden.weight.zero_()

    def forward(self, next_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """next_tokens (B, T) = x_{p+1}, hidden (B, T, H) = h_p -> logits (B, T, V) for x_{p+2}."""
        trunk = self._trunk[0]
        e = trunk.model.embed_tokens(next_tokens)
        u = self.fc_embedding(self.pre_fc_norm_embedding(e)) + self.fc_hidden(self.pre_fc_norm_hidden(hidden))
        g = self.body(inputs_embeds=u, use_cache=False).last_hidden_state
        return trunk.lm_head(g)

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        """`mtp.*` checkpoint tensors; the block's indexer is left out (the MTP block attends densely)."""
        out = {"mtp.fc_embedding.weight": self.fc_embedding.weight,
               "mtp.fc_hidden.weight": self.fc_hidden.weight,
               "mtp.pre_fc_norm_embedding.weight": self.pre_fc_norm_embedding.weight,
               "mtp.pre_fc_norm_hidden.weight": self.pre_fc_norm_hidden.weight}
        for k, v in self.body.state_dict().items():
            if k.startswith("hyper_connection_mixer.") or (k.startswith("layers.") and ".indexer." not in k):
                out["mtp." + k] = v
        return {k: v.detach().contiguous().clone() for k, v in out.items()}


def distill_loss(mtp: TrainableMTP, x: torch.Tensor):
    """Cross-entropy of the head against the frozen trunk's distribution one position ahead."""
    trunk = mtp._trunk[0]
    with torch.no_grad():
        h = trunk.model(input_ids=x, use_cache=False).last_hidden_state  # (B, T, H)
        target = torch.softmax(trunk.lm_head(h[:, 1:]).float(), dim=-1)  # what the trunk says at p+1
    logits = mtp(x[:, 1:], h[:, :-1])  # (h_p, x_{p+1}) -> x_{p+2}
    loss = -(target * torch.log_softmax(logits.float(), dim=-1)).sum(-1).mean()
    agree = (logits.argmax(-1) == target.argmax(-1)).float().mean().item()
    return loss, agree


def train_mtp(trunk, train_data: torch.Tensor, held_data: torch.Tensor, args):
    """Stage 2 of `strata.demo.train`: the MTP head against the frozen trunk. -> (head, results)."""
    from strata.demo import trunk as trunk_stage

    trunk.eval().requires_grad_(False)
    torch.manual_seed(args.seed + 2)
    mtp = TrainableMTP(trunk)
    mtp.init_from_trunk(torch.Generator().manual_seed(args.seed + 3))
    mtp.train()
    t0 = time.perf_counter()
    with trunk_stage.dense_indexer():
        before = held_agreement(mtp, held_data, args.seq)

        def step_loss(x):
            loss, agree = distill_loss(mtp, x[:, :-1])
            return loss, loss.item(), f"agree {agree:.1%}"

        steps, ema, _ = trunk_stage.train_loop(step_loss, mtp.parameters(), train_data, steps=args.mtp_steps,
                                               minutes=args.mtp_minutes, seq=args.seq,
                                               batch_tokens=args.batch_tokens, lr=args.mtp_lr,
                                               seed=args.seed + 4, label="mtp", log_every=10)
        after = held_agreement(mtp, held_data, args.seq)
    minutes = (time.perf_counter() - t0) / 60
    print(f"mtp: {steps} steps in {minutes:.1f} min; agreement with the trunk's next token on held-out text "
          f"{before:.1%} at the start, {after:.1%} trained", flush=True)
    return mtp.eval(), {"mtp_steps": steps, "mtp_loss": float(ema), "mtp_held_out_agreement": after,
                        "mtp_minutes": round(minutes, 1)}


@torch.no_grad()
def held_agreement(mtp: TrainableMTP, data: torch.Tensor, seq: int, windows: int = 8) -> float:
    """How often the head's top token is the trunk's, over held-out windows."""
    was = mtp.training
    mtp.eval()
    n = min(windows, (len(data) - 1) // seq)
    x = data[: n * seq].view(n, seq).long()
    _, agree = distill_loss(mtp, x)
    mtp.train(was)
    return agree
