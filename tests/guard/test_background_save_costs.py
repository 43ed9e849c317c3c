"""What a background save costs the run besides its copy: its wait is never timed as a (hung) step, the deadline times
each save from its own start, and a LoRA save copies the adapters it writes, not the frozen base model. Real trainers
on the toy model, the writer held mid-checkpoint (`safe_trainers/testing/held_writes.py`); a fake clock, no timing."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from transformers import TrainerCallback
from transformers.trainer_utils import SaveStrategy

from safe_trainers.testing.build import build_trainer
from safe_trainers.testing.held_writes import hold_until_waited


def test_a_rollback_from_disk_does_not_time_its_wait_for_the_write_as_a_hung_step(toy_models, tmp_path):
    # A rollback from disk waits for the checkpoint in flight. A write may take minutes (84 GB for a 7B full
    # fine-tune), far past the hang bound learned from the steps (10x the slowest): like the rollback's load and the
    # abort's save, the wait (`inspection.inspect` -> `announce`) runs with the step's watchdog clock paused, or a slow
    # write would be taken for a hung step (stacks, a `hang` event, under torchrun's agent exit 124 mid-write).
    from safe_trainers.testing.faults import Fault

    trainer = build_trainer(
        "dpo", toy_models["qwen2"], str(tmp_path), preset="guarded", faults=[Fault(step=6, kind="weight")],
        nan_rollback_from="checkpoint", save_in_background=True, max_steps=8, save_steps=4, hang_timeout=900.0,
        hang_action="report",
    )  # fmt: skip
    watchdog = trainer.safe_run.watchdog
    assert watchdog is not None
    held = hold_until_waited(trainer, 4, probe=lambda: watchdog._began is not None)  # the step's clock runs
    trainer.train()
    assert held.holding.is_set() and held.waits, "the rollback did not wait for checkpoint-4"
    assert held.waits == [False] * len(held.waits), "the wait for the write was timed as part of a step"


def test_the_deadline_measures_a_background_save_that_outlasts_the_save_interval(toy_models, tmp_path):
    # The deadline's margin holds the measured save time: from the step that starts a save (`save_began`, at
    # `on_step_end`) to its publication on the writer thread (`published_by_writer` -> `Deadline.saved`). A write
    # that outlasts the save interval (big checkpoints: the case the deadline is for) is timed from its own start
    # while the next save begins: checkpoint-2, written from t=2000 to t=5000 on the fake clock, takes 3000 s (not
    # the 1000 s since checkpoint-4's start).
    from transformers import TrainerCallback

    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    clock = Clock()

    class Steps(TrainerCallback):  # every step takes 1000 s on the fake clock
        def on_step_begin(self, args, state, control, **kwargs):
            clock.now += 1000.0

    def write_goes_on():  # the training thread waits for checkpoint-2: its write takes 1000 s more
        clock.now += 1000.0

    trainer = build_trainer(
        "dpo", toy_models["qwen2"], str(tmp_path), preset="guarded", save_in_background=True, max_steps=4,
        save_steps=2, job_end_time=1e9,
    )  # fmt: skip
    deadline = trainer.safe_run.preemption.deadline
    deadline.clock = clock
    trainer.add_callback(Steps())
    held = hold_until_waited(trainer, 2, probe=write_goes_on)
    trainer.train()
    assert held.waits, "checkpoint-2 was still being written at checkpoint-4's save"
    assert deadline.save_seconds is not None and deadline.save_seconds >= 3000.0, deadline.save_seconds


def test_a_lora_background_save_stages_the_adapters_it_writes_not_the_frozen_base_model(toy_models, tmp_path):
    # A LoRA checkpoint holds the adapters only (`adapter_model.safetensors`). A background save copies what
    # `PeftModel.save_pretrained` writes (`runtime/saved_weights.py`), not `model.state_dict()`: for a 7B base with a
    # 20 MB adapter, that would block every save for a 14 GB host copy (and hold 14 GB of host memory).
    from peft import LoraConfig

    trainer = build_trainer(
        "sft", toy_models["qwen2"], str(tmp_path), preset="guarded", save_in_background=True, max_steps=4,
        save_steps=2, trainer_kwargs={"peft_config": LoraConfig(r=4, target_modules=["q_proj", "v_proj"])},
    )  # fmt: skip
    from transformers import TrainerCallback

    staged = []

    class Staged(TrainerCallback):  # what the save's host buffers hold (let go when `train()` returns)
        def on_save(self, args, state, control, **kwargs):
            staged.append(trainer.safe_run.saves.buffers.model.nbytes())

    trainer.add_callback(Staged())
    trainer.train()
    assert os.path.isfile(os.path.join(str(tmp_path), "checkpoint-4", "adapter_model.safetensors"))
    adapters = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
    assert staged == [adapters, adapters], f"staged {staged} bytes for {adapters} bytes of adapters"


def test_a_prompt_learning_adapter_is_saved_as_it_was_at_its_step(toy_models, tmp_path):
    # P-tuning saves prompt embeddings that PEFT computes from the live prompt encoder at `save_pretrained`, whatever
    # state dict it is given: written on the writer thread, checkpoint-2 would hold the encoder's output of a later
    # step. Such weights are written on the training thread (`written_part` is `None`); the optimizer still goes to
    # the background. checkpoint-2's writer is held until the training thread waits for it (checkpoint-4's save),
    # before any of its deferred files.
    import torch
    from peft import PromptEncoderConfig
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    trainer = build_trainer(
        "sft", toy_models["qwen2"], str(tmp_path), preset="guarded", save_in_background=True, max_steps=4,
        save_steps=2, learning_rate=1e-2,
        trainer_kwargs={"peft_config": PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)},
    )  # fmt: skip
    at_step = {}

    class Embeddings(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            with torch.no_grad():
                at_step[state.global_step] = trainer.model.get_prompt_embedding_to_save("default").clone()

    trainer.add_callback(Embeddings())
    held = hold_until_waited(trainer, 2, before_writing=True)
    trainer.train()
    assert held.waits, "checkpoint-2 was still being written at checkpoint-4's save"
    saved = load_file(os.path.join(str(tmp_path), "checkpoint-2", "adapter_model.safetensors"))["prompt_embeddings"]
    assert not torch.equal(at_step[2], at_step[4]), "the prompt encoder did not train between the two saves"
    torch.testing.assert_close(saved, at_step[2], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("max_steps", "save_steps", "in_background", "buffers"),
    [(4, 4, [], 0), (8, 4, [4], 1)],
    ids=["only-the-last-step", "a-save-before-the-last"],
)
def test_the_last_checkpoint_is_written_in_line_and_buffers_are_prepared_only_for_earlier_ones(
    toy_models, tmp_path, max_steps, save_steps, in_background, buffers
):
    # `train()` waits for the last step's checkpoint at once: staging it to host memory first would only add a copy
    # (and a read-back check) to the run. A run whose only save is its last step holds no staging buffers at all.
    from guard_utils import checkpoint_steps

    from safe_trainers.testing.held_writes import hold_writes

    trainer = build_trainer(
        "dpo", toy_models["qwen2"], str(tmp_path), preset="guarded", save_in_background=True, max_steps=max_steps,
        save_steps=save_steps,
    )  # fmt: skip
    held = hold_writes(trainer, step=-1)  # holds nothing: records what reaches the writer
    allocations = {}

    class AtTheEnd(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            allocations.update(model=held.buffers.model.allocations, optimizer=held.buffers.optimizer.allocations)

    trainer.add_callback(AtTheEnd())
    trainer.train()
    assert held.started == in_background
    assert allocations == dict(model=buffers, optimizer=buffers)
    assert checkpoint_steps(str(tmp_path)) == list(range(save_steps, max_steps + 1, save_steps))
    assert os.path.isfile(os.path.join(str(tmp_path), f"checkpoint-{max_steps}", "optimizer.pt"))


@pytest.mark.parametrize(
    ("strategy", "state", "expected"),
    [
        ("no", dict(save_steps=4, max_steps=8, num_train_epochs=2), False),
        ("steps", dict(save_steps=4, max_steps=8, num_train_epochs=1), True),
        ("steps", dict(save_steps=8, max_steps=8, num_train_epochs=3), False),
        ("steps", dict(save_steps=500, max_steps=8, num_train_epochs=1), False),
        ("epoch", dict(save_steps=500, max_steps=8, num_train_epochs=1), False),
        ("epoch", dict(save_steps=500, max_steps=8, num_train_epochs=2), True),
        ("best", dict(save_steps=500, max_steps=8, num_train_epochs=1), True),
        (SaveStrategy.STEPS, dict(save_steps=2, max_steps=8, num_train_epochs=1), True),
    ],
)
def test_buffers_are_prepared_only_when_the_schedule_saves_before_the_last_step(strategy, state, expected):
    from safe_trainers.trainer.background_checkpoints import saves_before_the_end

    assert saves_before_the_end(SimpleNamespace(save_strategy=strategy), SimpleNamespace(**state)) is expected
