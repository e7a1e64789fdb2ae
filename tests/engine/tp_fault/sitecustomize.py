"""Test-only: a fault in tensor-parallel workers, which import this at start-up when the test puts
this directory on PYTHONPATH. TQATTN_TEST_WORKER_FAULT=N makes a worker's N-th step raise."""

import os

if os.environ.get("TQATTN_TEST_WORKER_FAULT") and os.environ.get("RANK", "0") != "0":
    from tqattn.engine import model_runner

    _fail_at = int(os.environ["TQATTN_TEST_WORKER_FAULT"])
    _step = model_runner.ModelRunner.worker_step
    _calls = [0]

    def worker_step(self, *args, **kwargs):
        _calls[0] += 1
        if _calls[0] == _fail_at:
            raise RuntimeError(f"injected fault in worker step {_fail_at}")
        return _step(self, *args, **kwargs)

    model_runner.ModelRunner.worker_step = worker_step
