"""Train mmviews with a backbone of one's own (docs/backbones.md): a small convolutional network
registered under the name ``my_convnet``, named by the recipe, trained on synthetic image views.

    python docs/examples/own_backbone.py [RUN_DIR]
"""

import sys

import torch
from torch import nn

from mmviews.config import config_from_dict
from mmviews.modalities import register_backbone
from mmviews.train import train


@register_backbone("my_convnet")
class MyConvNet(nn.Module):
    """Two strided conv stages and a global average: images [N, 3, H, W] -> features [N, 2 * width]."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, stride=2, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        self.stage = nn.Sequential(nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.BatchNorm2d(2 * width),
                                   nn.ReLU())

    def blocks(self) -> list[nn.Module]:  # optional: lets finetune.mode last_n pick the last blocks
        return [self.stem, self.stage]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.stage(self.stem(images)).mean(dim=(2, 3))


recipe = {
    "name": "own-backbone",
    "data": {"name": "synthetic", "options": {"num_samples": 128, "modalities": ["image"]}, "batch_size": 32},
    "views": [{"modality": "image"}, {"modality": "image", "augment": "simclr", "params": {"size": 32}}],
    "encoder": {"embed_dim": 32},
    # The adapter type is the registered name; ``args`` are MyConvNet's keyword arguments.
    "adapters": {"image": {"type": "my_convnet", "args": {"width": 16}, "image_size": 32}},
    "objective": {"name": "mv_dhel", "params": {"temperature": 0.2}},
    "optimisation": {"lr": 3e-3, "epochs": 2},
    "evaluation": {"tasks": ["linear:class"]},
    "output": {"progress_bar": False},
}

if __name__ == "__main__":
    run_dir = sys.argv[1] if len(sys.argv) > 1 else "runs/own-backbone"
    summary = train(config_from_dict(recipe, "own_backbone.py"), run_dir, source="own_backbone.py", overwrite=True)
    for row in summary["headline"]:
        print(row["metric"], "trained", round(row["trained"], 3), "random init", round(row["random_init"], 3))
