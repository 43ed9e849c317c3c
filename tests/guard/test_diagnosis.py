"""`guard/diagnosis.py`: the replay names the first module whose output went non-finite, and which micro-batch of
the step; the recent micro-batches are kept until the next inspection."""

from __future__ import annotations

import torch

from safe_trainers.guard.diagnosis import RecentBatches, first_nonfinite_module, localize


class Blowup(torch.nn.Module):
    """Turns an input whose first value is above 100 into Inf (a fault that depends on the data)."""

    def forward(self, x):
        return torch.where(x[..., :1] > 100, x * float("inf"), x)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Identity(), Blowup(), torch.nn.Linear(2, 1))


def replay(net):
    return lambda batch: net(batch["x"]).sum()


def test_the_first_module_whose_output_went_non_finite_is_named():
    net = model()
    found = first_nonfinite_module(net, lambda: net(torch.tensor([[1000.0, 1.0]])).sum())
    assert found == {"module": "1", "type": "Blowup", "input_finite": True, "rows": [0]}
    assert first_nonfinite_module(net, lambda: net(torch.ones(1, 2)).sum()) == {"module": None, "loss_finite": True}


def test_a_replay_that_fails_is_reported_not_raised():
    def broken():
        raise RuntimeError("boom")

    assert first_nonfinite_module(model(), broken)["reason"].startswith("replay failed: RuntimeError: boom")


def test_the_faulty_micro_batch_is_found_and_every_micro_batch_is_replayed():
    net, calls = model(), []
    net.register_forward_pre_hook(lambda module, args: calls.append(1))
    batches = [{"x": torch.ones(1, 2)}, {"x": torch.tensor([[1000.0, 1.0]])}, {"x": torch.ones(1, 2)}]
    found = localize(net, batches, replay(net), "cpu")
    assert (found["module"], found["micro_batch"], found["micro_batches"]) == ("1", 1, 3)
    assert len(calls) == 3  # all ranks run the same forwards, whichever went non-finite
    clean = localize(net, batches[:1], replay(net), "cpu")
    assert clean["module"] is None and "backward pass" in clean["reason"]


def test_recent_batches_are_kept_per_step_until_cleared():
    recent = RecentBatches()
    first = {"x": torch.ones(2)}
    recent.record(first)
    recent.record({"x": torch.zeros(2)})
    recent.end_step(3)
    assert len(recent.get(3)) == 2 and recent.get(4) == [] and recent.get(None) == []
    assert recent.get(3)[0]["x"].data_ptr() == first["x"].data_ptr()  # on the CPU the inputs are kept, not copied
    assert recent.nbytes() == 2 * 2 * 4
    recent.clear()
    assert recent.get(3) == [] and recent.nbytes() == 0
