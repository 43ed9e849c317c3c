"""The integration layer: the only package that knows `transformers.Trainer`'s internals.

Every override of a Trainer method (`hooks`: the training loop and logs; `checkpoints`: staged, verified, published
checkpoints; `generation`: GRPO/RLOO), the guard's callback (`callbacks`), the check that those hooks ran
(`hooks_ran`), the run a trainer holds and the wiring of its callbacks (`run`), the guard's decisions carried out
(`inspection`, with `replay` and `checkpoint_rollback`), the guard's view of the trainer (`port`), preemption and
hangs at the end of `train()` (`run_control`), and the rules around TRL's constructor (`mixin`).
"""
