# Copyright 2026 The safe_trainers authors. Licensed under the Apache License, Version 2.0.
"""
Supervised fine-tuning of a causal language model on prompt-completion, conversational or plain-text data,
with `safe_trainers.SFTTrainer`: TRL's trainer plus the safety rules and the NaN guard.

# Tiny local run (no model or dataset given: a toy model and dataset are built locally, no network)
```bash
accelerate launch launch/train_sft.py --output_dir out/sft-toy --max_steps 10
```

# From a shipped config, with command-line overrides
```bash
accelerate launch --config_file configs/accelerate/multi_gpu.yaml launch/train_sft.py \
    --config configs/trainers/sft.yaml \
    --learning_rate 1e-5
```

# Every flag on the command line
```bash
python launch/train_sft.py \
    --model_name_or_path Qwen/Qwen2.5-0.5B \
    --dataset_name trl-lib/Capybara \
    --output_dir out/sft \
    --safety_mode fix
```

Run `python launch/train_sft.py --help` for every option (TRL's `SFTConfig` fields, `safety_*`, `nan_*`, model
and dataset arguments).
"""

from safe_trainers.scripts.entry import run


if __name__ == "__main__":
    run("sft")  # a mistake in the input: one message on stderr and exit status 2
