# Copyright 2026 The safe_trainers authors. Licensed under the Apache License, Version 2.0.
"""
Train a policy with Group Relative Policy Optimization against reward functions,
with `safe_trainers.GRPOTrainer`: TRL's trainer plus the safety rules and the NaN guard.

# Tiny local run (no model or dataset given: a toy model and dataset are built locally, no network)
```bash
accelerate launch launch/train_grpo.py --output_dir out/grpo-toy --max_steps 10
```

# From a shipped config, with command-line overrides
```bash
accelerate launch --config_file configs/accelerate/multi_gpu.yaml launch/train_grpo.py \
    --config configs/trainers/grpo.yaml \
    --learning_rate 1e-6
```

# Every flag on the command line
```bash
python launch/train_grpo.py \
    --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
    --dataset_name trl-lib/tldr \
    --output_dir out/grpo \
    --reward_funcs length \
    --safety_mode fix
```

Rewards: `--reward_funcs count_words length` (built-ins in `safe_trainers.scripts.rewards`) or `my_module:my_reward`.
Run `python launch/train_grpo.py --help` for every option (TRL's `GRPOConfig` fields, `safety_*`, `nan_*`, model
and dataset arguments).
"""

from safe_trainers.scripts.entry import run


if __name__ == "__main__":
    run("grpo")  # a mistake in the input: one message on stderr and exit status 2
