"""`guard/step/flags.py` on its own: how each step's losses and gradient norm become the device flags and the
[`StepReading`]s read back at an inspection, and how the skip flag reaches a real optimizer through accelerate's
wrapper (single process: the collectives are the identity)."""

import math

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from safe_trainers.guard.policy import StepReading
from safe_trainers.guard.step.flags import StepFlags

CPU = torch.device("cpu")
NAN = float("nan")


def close(flags: StepFlags, step: int, losses: list[float], grad_norm, **kwargs) -> bool:
    for loss in losses:
        flags.observe_loss(torch.tensor(loss))
    return bool(flags.end_step(step, grad_norm, CPU, **kwargs))


def test_healthy_and_faulted_steps_read_back_in_one_list():
    flags = StepFlags()
    assert close(flags, 1, [1.0, 2.0], torch.tensor(0.5)) is False
    assert close(flags, 2, [1.0, NAN], torch.tensor(0.5)) is True
    assert close(flags, 3, [1.0], torch.tensor(float("inf"))) is True
    records = flags.read()
    assert flags.pending == [] and flags.read() == []
    assert records[0] == StepReading(1, 3.0, 0.5, False, (), False, False, 3.0)  # the loss is the micro-batches' sum
    assert records[1].judged_loss == 0.0  # a non-finite loss is a fault, judged as 0 by the spike detector
    assert records[1].bad and records[1].bad_ranks == (0,)  # a non-finite loss names its rank
    assert records[2].bad and records[2].bad_ranks == ()  # only the gradient was non-finite
    assert math.isnan(records[1].loss) and math.isinf(records[2].grad_norm)


@pytest.mark.parametrize("grad_norm", [None, 0.25, torch.tensor(0.25)])
def test_the_gradient_norm_may_be_a_tensor_a_float_or_missing(grad_norm):
    flags = StepFlags()
    skipped = close(flags, 1, [1.0], grad_norm)
    (record,) = flags.read()
    # Without a norm the step cannot be shown finite: it is a fault.
    assert skipped is (grad_norm is None) and record.bad is (grad_norm is None)
    if grad_norm is not None:
        assert record.grad_norm == 0.25


def test_under_a_loss_scaler_nonfinite_gradients_with_a_finite_loss_are_its_overflow():
    flags = StepFlags(loss_scaled=True)
    assert close(flags, 1, [1.0], torch.tensor(float("inf"))) is False  # the scaler skips it itself
    assert close(flags, 2, [NAN], torch.tensor(float("inf"))) is True
    first, second = flags.read()
    assert (first.bad, first.overflow) == (False, True)
    assert (second.bad, second.overflow) == (True, False)


def test_a_dropped_or_optimizer_skipped_step_is_a_fault():
    flags = StepFlags(loss_scaled=True)
    assert close(flags, 1, [1.0], torch.tensor(0.5), dropped=True) is True
    plain = StepFlags()
    assert close(plain, 1, [1.0], torch.tensor(0.5), optimizer_skipped=True) is True
    assert [r.bad for r in flags.read() + plain.read()] == [True, True]


def test_clear_forgets_the_step_in_progress_and_the_pending_ones():
    flags = StepFlags()
    close(flags, 1, [1.0], torch.tensor(0.5))
    flags.observe_loss(torch.tensor(NAN))
    flags.clear()
    assert close(flags, 2, [2.0], torch.tensor(0.5)) is False  # the NaN of the cleared step is gone
    assert [(r.step, r.loss) for r in flags.read()] == [(2, 2.0)]


class PreemptionBit:
    """A rider on the step's all-reduce, as `restarts/preemption.py` uses it."""

    def __init__(self, bit: bool):
        self.bit, self.seen = bit, []

    def local_bit(self, device):
        return torch.tensor(self.bit, device=device)

    def agreed(self, step, bit):
        self.seen.append((step, bool(bit)))


@pytest.mark.parametrize("bit", [False, True])
def test_a_rider_gets_its_agreed_bit_and_does_not_touch_the_step(bit):
    flags, rider = StepFlags(), PreemptionBit(bit)
    assert close(flags, 7, [1.0], torch.tensor(0.5), riders=[rider]) is False
    assert rider.seen == [(7, bit)] and flags.read()[0].bad is False


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("fault", [False, True])
def test_the_skip_flag_reaches_the_optimizer_inside_accelerates_wrapper(fused, fault):
    Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    inner = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused)
    optimizer = AcceleratedOptimizer(inner, device_placement=False)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(2, 4)).sum().backward()
    flags = StepFlags()
    close(flags, 1, [NAN if fault else 1.0], torch.tensor(1.0))
    flags.skip_update(optimizer)
    optimizer.step()
    flags.after_update(optimizer)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert unchanged is fault
    assert "found_inf" not in vars(inner)  # no later step and no pickled optimizer carries the flag
