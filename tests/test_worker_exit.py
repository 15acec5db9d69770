"""A finished training exits 0 whatever the monitor's edit-distance job is doing then.

The job runs at nice 19; on a starved machine (4 ranks on 2 cores) it outlived ``close()``'s one-second wait, and
a thread left inside a torch operator while the interpreter finalizes aborts the process: exit status 134,
"terminate called without an active exception", a finished training reported failed by torchrun and by the
scheduler. Each case runs in a fresh interpreter, with the job held inside torch operators for good."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from grpo_exporter.runtime.background import EXIT_TIMEOUT_S

SCRIPT = textwrap.dedent("""
    import json, sys, threading, time, torch
    from grpo_exporter import GRPOMonitor
    from grpo_exporter.runtime import background

    inside = threading.Event()

    def held(*args, **kwargs):  # the edit-distance job inside torch operators until the process ends
        inside.set()
        x = torch.ones(128, 128)
        while True:
            x = (x @ x).clamp_(-1, 1)

    background.rows_to_groups = held
    mon = GRPOMonitor(run="exit", group_size=4, port=None, close_linger_s=0, guard="off")
    ids = torch.randint(0, 50, (8, 12))
    mon.observe_rollout(0, rewards=torch.rand(8), completion_ids=ids,
                        completion_mask=torch.ones(8, 12, dtype=torch.bool))
    assert inside.wait(30), "no edit-distance job started"
    if sys.argv[1] == "close":
        start = time.perf_counter()
        mon.close()
        print(json.dumps({"close": time.perf_counter() - start}), flush=True)
    if sys.argv[1] == "raise":
        raise RuntimeError("the training failed")
""")


@pytest.mark.parametrize(("mode", "status"), [("close", 0), ("exit", 0), ("raise", 1)])
def test_an_exit_with_the_edit_distance_job_inside_torch_operators_ends_cleanly(mode: str, status: int) -> None:
    """Closed, the job is interrupted after close's wait (1 s); not closed, or the training raising, the exit hook
    interrupts it: the process ends with its own status, not 134, and says nothing of the interrupted job."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == status, done.stderr[-3000:]
    assert "terminate called" not in done.stderr
    assert "Interrupted" not in done.stderr
    assert "did not stop" not in done.stderr
    if mode == "close":
        (line,) = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
        assert line["close"] < 1.0 + EXIT_TIMEOUT_S
    if mode == "raise":
        assert "the training failed" in done.stderr
