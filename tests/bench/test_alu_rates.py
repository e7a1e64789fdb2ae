"""bench/lab/alu_rates.py: each op's kernel, compiled for sm_90 on CPU, runs its instruction
CHAINS × UNROLL times a loop iteration (ptxas neither fuses nor drops the chain steps)."""

import json
import os
import subprocess
import sys

import pytest

_COMPILE = """
import collections, json, torch
from bench.kernel_builds import compile_captured
from bench.sass_stats import disassemble, opcode
from bench.lab import alu_rates as A
got = {}
for op, (asm, sass) in A.OPS.items():
    k, _ = compile_captured(A._rate_kernel, (torch.zeros(64, dtype=torch.int32),
                            torch.zeros(2, dtype=torch.int64), 100), {"ASM": asm, "num_warps": 1})
    ins, _ = disassemble(k.asm["cubin"])
    got[op] = [sass, collections.Counter(opcode(i) for _, i in ins)[sass], len(ins)]
print(json.dumps(got))
"""


def test_alu_rate_kernels_run_their_instruction():
    pytest.importorskip("triton")
    from bench.lab import alu_rates
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _COMPILE], env=env, cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    steps = alu_rates.CHAINS * alu_rates.UNROLL.value
    assert set(got) == set(alu_rates.OPS)
    for op, (sass, n, total) in got.items():
        # the chain steps, plus at most a few of the same opcode in the address arithmetic
        assert steps <= n <= steps + 8, (op, sass, n)
        assert total < 2 * steps + 64, (op, total)
