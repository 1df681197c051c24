"""Float16 mixed precision in PyTorch Lightning with lossscale's GradScaler.

Lightning's `MixedPrecision` plugin takes any `torch.amp.GradScaler`; ours
adds a fail-fast limit (training stops with a `LossScaleError` instead of
skipping steps forever) and telemetry, read with `scaler.summary()`. The
first steps overflow on purpose (the initial scale is too high) and are
skipped; `gradient_clip_val` clips the unscaled gradients. Runs on CUDA when
available, else on the CPU.

    python examples/lightning_fp16.py
"""

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision
from torch import nn

import lossscale.torch


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
# A toy task: which side of a random hyperplane a point lies on.
x = torch.randn(4096, 32)
y = (x @ torch.randn(32) > 0).long()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=128)

scaler = lossscale.torch.GradScaler(
    device, init_scale=2.0**24, growth_interval=50, max_consecutive_skips=20, telemetry=True
)
trainer = pl.Trainer(
    accelerator=device,
    max_epochs=3,
    plugins=[MixedPrecision("16-mixed", device, scaler=scaler)],
    gradient_clip_val=1.0,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
model = Classifier()
trainer.fit(model, loader)

with torch.no_grad():
    accuracy = (model.net(x.to(model.device)).argmax(1).cpu() == y).float().mean().item()
s = scaler.summary()
print(
    f"accuracy {accuracy:.3f}  loss scale {s['dynamic_scale']:g}  "
    f"skipped {s['skipped_steps']} of {s['steps']} steps"
)
