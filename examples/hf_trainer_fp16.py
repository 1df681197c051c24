"""A tiny GPT-2 trained by Hugging Face `Trainer` in float16 with `lossscale.torch.GradScaler`.

The model is built from a config (random weights, nothing downloaded). The
Trainer subclass hands Accelerate lossscale's scaler, turns Accelerate's
float16 path on where Accelerate leaves it off (the CPU) and logs the loss
scale. Trainer then logs the unscaled `grad_norm`, and an overflowing step
is skipped without advancing the learning-rate schedule.

Run: python examples/hf_trainer_fp16.py
"""

import tempfile

import torch
import transformers

import lossscale.torch


class LossScaleTrainer(transformers.Trainer):
    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        accelerator = self.accelerator  # not prepared yet: `prepare` takes this scaler
        accelerator.scaler = lossscale.torch.GradScaler(
            accelerator.device.type, init_scale=2.0**24, growth_interval=20, telemetry=True
        )  # 2**24 overflows at first, to show the skips
        accelerator.native_amp = True  # a CPU has Accelerate leave fp16 off: turn its path on

    def log(self, logs, *args, **kwargs):
        if "loss" in logs:  # the training logs, every `logging_steps`
            logs["loss_scale"] = self.accelerator.scaler.get_scale()
        super().log(logs, *args, **kwargs)


transformers.set_seed(0)
transformers.logging.set_verbosity_error()
config = transformers.GPT2Config(
    vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
)
model = transformers.GPT2LMHeadModel(config)  # random weights: no download
starts = torch.randint(0, 64, (512,))
data = [{"input_ids": (s + torch.arange(16)) % 64} for s in starts]
data = [dict(d, labels=d["input_ids"]) for d in data]  # the model shifts the labels itself

args = transformers.TrainingArguments(
    output_dir=tempfile.mkdtemp(),
    fp16=True,
    optim="adamw_torch",  # not fused: a skipped step then does not move the LR schedule
    learning_rate=3e-3,
    max_steps=60,
    per_device_train_batch_size=16,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    dataloader_pin_memory=False,
    disable_tqdm=True,
)
trainer = LossScaleTrainer(model=model, args=args, train_dataset=data)
trainer.train()

logs = [r for r in trainer.state.log_history if "grad_norm" in r]  # one per step
skipped = [i for i, r in enumerate(logs) if not torch.isfinite(torch.tensor(r["grad_norm"]))]
held = all(logs[i + 1]["learning_rate"] == logs[i]["learning_rate"] for i in skipped[:-1])
norms = [r["grad_norm"] for i, r in enumerate(logs) if i not in skipped]
info = trainer.accelerator.scaler.summary()
print(f"skipped steps {[logs[i]['step'] for i in skipped]}, scaler counted {info['skipped_steps']}")
print(
    f"loss {logs[0]['loss']:.3f} -> {logs[-1]['loss']:.3f}  largest grad_norm {max(norms):.3g}  "
    f"LR held on skipped steps {held}  loss scale {logs[-1]['loss_scale']:g}"
)
