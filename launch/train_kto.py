# Copyright 2026 The safe_trainers authors. Licensed under the Apache License, Version 2.0.
"""
Train a policy with Kahneman-Tversky Optimization on unpaired, labelled completions,
with `safe_trainers.KTOTrainer`: TRL's trainer plus the safety rules and the NaN guard.

# Tiny local run (no model or dataset given: a toy model and dataset are built locally, no network)
```bash
accelerate launch launch/train_kto.py --output_dir out/kto-toy --max_steps 10
```

# From a shipped config, with command-line overrides
```bash
accelerate launch --config_file configs/accelerate/multi_gpu.yaml launch/train_kto.py \
    --config configs/trainers/kto.yaml \
    --learning_rate 1e-6
```

# Every flag on the command line
```bash
python launch/train_kto.py \
    --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
    --dataset_name trl-lib/kto-mix-14k \
    --output_dir out/kto \
    --safety_mode fix
```

Run `python launch/train_kto.py --help` for every option (TRL's `KTOConfig` fields, `safety_*`, `nan_*`, model
and dataset arguments).
"""

from safe_trainers.scripts.entry import run


if __name__ == "__main__":
    run("kto")  # a mistake in the input: one message on stderr and exit status 2
