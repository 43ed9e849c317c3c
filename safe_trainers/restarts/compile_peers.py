"""A rank that waits for another rank's compilation is not hung: the ranks tell each other through the store.

Each rank's hang watchdog stops its own clock while torch compiles on it (see `watchdog.py`), but the ranks do not
compile in step: a rank given a sequence length the others were not recompiles alone, and a busy host builds
slower. The others wait for it in the step's next collective with their clocks running, and a compilation longer than
the bound made them write their stacks and exit (status 124) while the compiling rank was working.

So each rank says in the process group's key-value store (the one `init_process_group` set up; its server answers
while the ranks are blocked in a collective) when it compiles and how long its compilations in each step took
([`PeerCompiles`]). A rank past its bound asks ([`PeerCompiles.excuse`]) before it counts as hung: while another rank
compiles, it waits on; once none does, the step may take as long again as the longest compilation of any rank in it,
as the compiling rank's own bound does. The store is read only by a rank already past its bound; a store that cannot
be reached excuses nothing (the watchdog then judges as before).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("safe_trainers")

PREFIX = "safe_trainers/compile"
RECHECK = 5.0  # seconds between a waiting rank's questions while another rank compiles


class PeerCompiles:
    """The compilations of every rank, in the process group's store (see the module docstring).

    Args:
        store (`torch.distributed.Store`): the process group's store.
        rank (`int`): this process's rank.
        world (`int`): the number of ranks.
    """

    def __init__(self, store: Any, rank: int, world: int):
        self.store, self.rank, self.world = store, rank, world
        self._excused = (0, 0.0)  # (step, the seconds it is excused so far)

    def began(self) -> None:
        self._add(f"{PREFIX}/compiling/{self.rank}", 1)

    def ended(self, step: int, seconds: float) -> None:
        """This rank's compilation ended, inside step `step` (or between it and the next), after `seconds`."""
        self._add(f"{PREFIX}/compiling/{self.rank}", -1)
        self._add(f"{PREFIX}/step{step}/{self.rank}", int(seconds * 1000))

    def excuse(self, step: int) -> float | None:
        """Seconds a waiting rank's step `step` may run past its bound: `None` while another rank compiles (ask
        again later); otherwise the longest time any other rank compiled in the step (0 if none did)."""
        others = [r for r in range(self.world) if r != self.rank]
        if any(self._add(f"{PREFIX}/compiling/{r}", 0) > 0 for r in others):
            return None
        return max(self._add(f"{PREFIX}/step{step}/{r}", 0) for r in others) / 1000

    def excused(self, step: int, over: float) -> float:
        """The seconds this rank, `over` seconds past its bound in step `step`, may run on (called by the watchdog's
        thread): while another rank compiles, `RECHECK` more than now; then the longest compilation of another rank
        in the step. The store is asked again only once the rank is past what it was given."""
        excused = self._excused[1] if self._excused[0] == step else 0.0
        if over > excused:
            excuse = self.excuse(step)
            excused = over + RECHECK if excuse is None else max(excused, excuse)
            self._excused = (step, excused)
        return excused

    def _add(self, key: str, amount: int) -> int:
        try:
            return int(self.store.add(key, amount))
        except Exception as e:  # noqa: BLE001  (a store that cannot be reached says nothing; the watchdog judges)
            logger.debug("The hang watchdog could not read the store (%s: %s).", type(e).__name__, e)
            return 0


class _NoPeers:
    """A single process (or no process group): no other rank compiles."""

    def began(self) -> None:
        pass

    def ended(self, step: int, seconds: float) -> None:
        pass

    def excused(self, step: int, over: float) -> float:
        return 0.0


NO_PEERS = _NoPeers()


def peer_compiles(rank: int) -> PeerCompiles | _NoPeers:
    """The other ranks' compilations, through the default process group's store ([`NO_PEERS`] with one rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return NO_PEERS
    return PeerCompiles(dist.distributed_c10d._get_default_store(), rank, dist.get_world_size())


__all__ = ["NO_PEERS", "PeerCompiles", "peer_compiles"]
