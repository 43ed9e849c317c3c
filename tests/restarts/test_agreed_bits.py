"""`restarts/preemption.py` `AgreedBits`: the preemption request of each step, a bit riding on the guard's per-step
all-reduce, kept on the device and read back later in step order (single process, CPU)."""

from __future__ import annotations

import torch

from safe_trainers.guard.step.flags import StepFlags
from safe_trainers.restarts.preemption import READ_LAG, AgreedBits, stop_step

CPU = torch.device("cpu")


class Rider:
    """A [`FlagRider`] over `AgreedBits`, as `PreemptionCallback` is under several ranks."""

    def __init__(self):
        self.bits = AgreedBits(CPU)
        self.requested = False

    def local_bit(self, device):
        return self.bits.local_bit(self.requested)

    def agreed(self, step, bit):
        self.bits.agreed(step, bit)


def test_the_local_bit_follows_its_value_in_one_tensor():
    bits = AgreedBits(CPU)
    first = bits.local_bit(False)
    assert first.dtype == torch.bool and not bool(first)
    assert bool(bits.local_bit(True)) and bool(bits.local_bit(True))
    assert not bool(bits.local_bit(False))  # a writer's "busy" bit clears (a preemption request never does)
    assert bits.local_bit(True) is first  # one device tensor for the whole run: nothing allocated per step


def test_agreed_bits_are_read_back_in_step_order_up_to_the_step_asked_and_once():
    bits = AgreedBits(CPU)
    for step, bit in ((1, False), (2, True), (3, False)):
        bits.agreed(step, torch.tensor(bit))
    assert bits.read_through(0) == []
    assert bits.read_through(1) == [(1, False)]
    assert bits.read_through(3) == [(2, True), (3, False)]
    assert bits.read_through(3) == []


def test_a_request_rides_the_guards_all_reduce_and_sets_the_stopping_step():
    rider, flags = Rider(), StepFlags()
    for step in (1, 2, 3):
        rider.requested = step >= 2  # the signal arrives during step 2 (`Preemption.requested` stays set)
        flags.observe_loss(torch.tensor(1.0))
        flags.end_step(step, torch.tensor(0.5), CPU, riders=[rider])
    agreed = rider.bits.read_through(3)
    assert agreed == [(1, False), (2, True), (3, True)]
    assert stop_step(agreed, READ_LAG) == 2 + READ_LAG  # every rank stops one step after the request is agreed
    assert stop_step([(1, False)], READ_LAG) is None
