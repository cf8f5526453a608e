"""A next-layer expert predictor that needs only the routing: for logs that hold no predictions.

The runtime's prefetcher asks the next layer's router about the current hidden state; a
routing log has no hidden states, so its traces carry no predictions. This predictor uses
what a log does have: per token, the experts the layer just chose. It counts, over the
forwards seen so far, how often expert `b` of layer l+1 followed expert `a` of layer l in
the same token, and names for each token the top-k experts of l+1 by those counts
(summed over the token's experts at l). It learns only from earlier forwards, so every
prediction could have been made at run time, before layer l+1's router ran.
"""

from __future__ import annotations

import numpy as np

SOURCE = "next-layer expert-id co-occurrence, learned online from the log (not the runtime's router predictor)"


class CooccurrencePredictor:
    def __init__(self, n_layers: int, n_experts: int):
        self.follows = np.zeros((n_layers, n_experts, n_experts))  # [l + 1, a at l, b at l + 1]
        self.pending: list[tuple[int, np.ndarray, np.ndarray]] = []  # this forward's pairs, learned at its end

    def predict(self, layer: int, ids: np.ndarray) -> list[int]:
        """Distinct experts named for `layer + 1`, from each token's experts `ids` [tokens, k] at `layer`."""
        table = self.follows[layer + 1]
        scores = table[ids].sum(axis=1)  # [tokens, E]
        known = scores.sum(axis=1) > 0
        if not known.any():
            return []
        top = np.argsort(-scores[known], axis=1, kind="stable")[:, :ids.shape[1]]
        return sorted(set(top.reshape(-1).tolist()))

    def observe(self, layer: int, ids: np.ndarray, next_ids: np.ndarray) -> None:
        """Token by token, `ids` [tokens, k] at `layer` were followed by `next_ids` at `layer + 1`."""
        self.pending.append((layer, ids, next_ids))

    def end_forward(self) -> None:
        for layer, ids, next_ids in self.pending:
            rows = np.repeat(ids, next_ids.shape[1], axis=1).reshape(-1)
            cols = np.tile(next_ids, (1, ids.shape[1])).reshape(-1)
            np.add.at(self.follows[layer + 1], (rows, cols), 1)
        self.pending.clear()
