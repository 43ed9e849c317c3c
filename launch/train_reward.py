# Copyright 2026 The safe_trainers authors. Licensed under the Apache License, Version 2.0.
"""
Train a reward model (sequence classifier, one score per text) on preference pairs,
with `safe_trainers.RewardTrainer`: TRL's trainer plus the safety rules and the NaN guard.

# Tiny local run (no model or dataset given: a toy model and dataset are built locally, no network)
```bash
accelerate launch launch/train_reward.py --output_dir out/reward-toy --max_steps 10
```

# From a shipped config, with command-line overrides
```bash
accelerate launch --config_file configs/accelerate/multi_gpu.yaml launch/train_reward.py \
    --config configs/trainers/reward.yaml \
    --learning_rate 1e-6
```

# Every flag on the command line
```bash
python launch/train_reward.py \
    --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
    --dataset_name trl-lib/ultrafeedback_binarized \
    --output_dir out/reward \
    --safety_mode fix
```

Run `python launch/train_reward.py --help` for every option (TRL's `RewardConfig` fields, `safety_*`, `nan_*`, model
and dataset arguments).
"""

from safe_trainers.scripts.entry import run


if __name__ == "__main__":
    run("reward")  # a mistake in the input: one message on stderr and exit status 2
