"""Three evaluation splits with different class mixes and target means, for the chance-level
guards (test_eval_chance.py). (No tests here.)

Each sample's three views are its class's centre plus noise, through test_eval_report's
collator (audio_1 absent where the dataset index % 4 == 0). Class 2 is the training majority
(12 of 24); it is 3 of 12 validation samples and 6 of 16 test samples, 4 of them at indices
0, 4, 8, 12 (where audio_1 is absent). The targets ("sentiment") average 1.0 in training,
0.25 in validation and -0.5 in test."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

TRAIN_CLASSES = [2] * 12 + [0] * 6 + [1] * 6
VALID_CLASSES = [2, 0, 1, 0, 2, 1, 0, 1, 2, 0, 1, 0]
TEST_CLASSES = [2, 2, 2, 0, 2, 1, 0, 1, 2, 0, 1, 0, 2, 1, 0, 1]
# offsets that cancel over each split: four rounds of -0.2..0.2 and four 0s; +-0.2; -0.45..0.45
TRAIN_TARGETS = [1.0 + 0.1 * ((i % 5) - 2) for i in range(20)] + [1.0] * 4
VALID_TARGETS = [0.25 + 0.2 * ((i % 2) * 2 - 1) for i in range(12)]
TEST_TARGETS = [-0.5 + 0.3 * ((i % 4) - 1.5) for i in range(16)]
SPLITS = {"train": (TRAIN_CLASSES, TRAIN_TARGETS), "valid": (VALID_CLASSES, VALID_TARGETS),
          "test": (TEST_CLASSES, TEST_TARGETS)}


class MixedSplit(Dataset):
    def __init__(self, split: str) -> None:
        classes, targets = SPLITS[split]
        g = torch.Generator().manual_seed(len(classes))
        self.y = torch.tensor(classes)
        centre = torch.zeros(len(classes), 8)
        centre[torch.arange(len(classes)), self.y] = 3.0
        self.x = centre[:, None, :] + 0.5 * torch.randn(len(classes), 3, 8, generator=g)
        self.s = torch.tensor(targets, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], self.s[i], i


def mixed_loader(split: str) -> DataLoader:
    from test_eval_report import collate

    return DataLoader(MixedSplit(split), batch_size=8, collate_fn=collate)
