"""`python -m tests.trainers.run_speculators <speculators train flags>`: speculators' own `train`
(TrainConfig.resolve + train.cli.main, its real data loader, collator, model and optimiser) on the
CPU; prints one JSON line: the file indices its ArrowDataset loaded, the ones it found unavailable,
each loaded sample's supervised-token count, and the loss of every backward pass.

Patched, all GPU-only: the accelerator lookups (current_accelerator -> cpu, synchronize,
memory_allocated), the trainer's device index (get_local_rank -> cpu) and DataLoader's
pin_memory (needs an accelerator). The test passes `--loss-implementation eager` (the fused loss
is Triton) and `--draft-attn-impl sdpa` (FlexAttention has no backward on the CPU): both are
speculators' own flags.
"""

from __future__ import annotations

import json
import sys
from unittest import mock

import torch


def main(argv: list[str]) -> None:
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig
    from speculators.train.data import ArrowDataset
    from speculators.train.recovery import SampleUnavailable

    cpu = torch.device("cpu")
    loaded, unavailable, losses = {}, [], []
    get_raw, backward = ArrowDataset._get_raw_data, torch.Tensor.backward

    def spy_get(self, index):
        item = get_raw(self, index)
        file_idx = int(self._map_to_file_idx(index))
        if isinstance(item, SampleUnavailable):
            unavailable.append(file_idx)
        else:
            loaded[file_idx] = int(item["loss_mask"].sum())
        return item

    def spy_backward(t, *a, **k):
        losses.append(float(t.detach()))
        return backward(t, *a, **k)

    with mock.patch("torch.accelerator.current_accelerator",
                    side_effect=lambda check_available=False: None if check_available else cpu), \
            mock.patch("torch.accelerator.synchronize"), \
            mock.patch("torch.accelerator.memory_allocated", return_value=0), \
            mock.patch("speculators.train.trainer.get_local_rank", return_value=cpu), \
            mock.patch("torch.utils.data._utils.pin_memory.pin_memory", side_effect=lambda d, device=None: d), \
            mock.patch.object(ArrowDataset, "_get_raw_data", spy_get), \
            mock.patch.object(torch.Tensor, "backward", spy_backward):
        train(TrainConfig.resolve(argv))
    print(json.dumps({"loaded": loaded, "unavailable": unavailable, "losses": losses}))


if __name__ == "__main__":
    main(sys.argv[1:])
