"""The rendezvous ports the launching tests pick (`net_utils.free_port`): two launches may run at once, one on each
xdist worker, so each worker picks from a block of its own, below the ports the OS hands to connections."""

from __future__ import annotations

import os
import socket

from net_utils import FIRST_PORT, bindable, ephemeral_start, free_port, worker_ports


def test_each_worker_has_its_own_block_below_the_ephemeral_range():
    ephemeral = ephemeral_start()
    blocks = [set(worker_ports(worker, ephemeral)) for worker in ("gw0", "gw1")]
    assert all(blocks) and not blocks[0] & blocks[1]
    assert max(blocks[0] | blocks[1]) < ephemeral and min(blocks[0]) == FIRST_PORT
    assert worker_ports("", ephemeral) == worker_ports("gw0", ephemeral)  # one process: the first block
    assert len(worker_ports("gw9", 32768)) == 0  # no room below the range: `free_port` falls back to the OS's pick


def test_free_port_picks_from_the_workers_block_and_skips_a_port_in_use():
    # This worker's own block (the first without xdist): a port held here is never one another worker's launch is
    # about to bind (this worker runs one test at a time).
    block = worker_ports(os.environ.get("PYTEST_XDIST_WORKER", ""), ephemeral_start())
    port = free_port()
    assert port in block and bindable(port)
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        assert not bindable(port)
        assert all(free_port() != port for _ in range(20))
