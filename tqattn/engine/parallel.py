"""Tensor parallelism: one model over N processes (ranks), each holding its shard of every layer.

The engine's own process is rank 0: it runs the scheduler, the block manager, the tokenizer and
sampling, and its shard of the model. Ranks 1..N-1 are worker processes it starts
(:mod:`tqattn.engine.worker`). The model is sharded by transformers' own tensor-parallel plan
(the config's ``base_model_tp_plan``: q/k/v and the MLP's gate/up projections column-wise, o_proj
and down_proj row-wise with an all-reduce, the LM head gathered) on torch.distributed — gloo on
CPU, NCCL on CUDA. Attention needs no communication: a rank computes whole heads, so its KV cache
holds only its own KV heads (``split_heads``).

Each step, rank 0 broadcasts the step's host arrays (token ids, positions, block tables, slot
mappings: :class:`~tqattn.engine.input_batch.StepHost`) on a gloo group of its own, and every rank
runs the same forward; start-up calls (cache allocation, warm-up, CUDA-graph capture) are sent the
same way (:class:`TensorParallelGroup`). Only rank 0 samples; with async scheduling it broadcasts
the sampled token ids on the device group, which the other ranks feed into the next step's
placeholders as rank 0 does.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tqattn.models.sharding import HeadSplit, check_model

# NVLink multicast (NVLS) stays off on the lent multi-GPU machines: set before NCCL starts.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# How long a collective (a step's all-reduce, a broadcast) may wait for the other ranks.
TIMEOUT = timedelta(minutes=30)


class TensorParallelError(RuntimeError):
    """A rank failed or the ranks lost step with each other; the engine cannot run on."""


# ---- the checks made before any process starts ---------------------------------------------------

def check_tensor_parallel(tp: int, hf_config: Any, device: torch.device) -> HeadSplit:
    """Everything that can be checked before a process starts: the model's plan and heads
    (:func:`tqattn.models.sharding.check_model`), the devices. Raises ValueError with what is
    allowed."""
    split = check_model(hf_config, tp)
    if not dist.is_available():
        raise ValueError(f"tensor_parallel_size={tp} needs torch.distributed, which this torch "
                         f"{torch.__version__} build lacks")
    if dist.is_initialized():  # this process is rank 0 of the group it initializes
        raise ValueError(f"tensor_parallel_size={tp}: torch.distributed is already initialized in "
                         f"this process (another tensor-parallel engine, or the caller's own group); "
                         f"one tensor-parallel engine per process: shut the other down first "
                         f"(llm.shutdown())")
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if device.index not in (None, 0):
            raise ValueError(f"tensor_parallel_size={tp} runs rank r on cuda:r; device={str(device)!r} "
                             f"names one GPU: pass device='cuda' and choose the GPUs with "
                             f"CUDA_VISIBLE_DEVICES")
        if tp > count:
            raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs, torch sees {count}")
    elif device.type == "cpu" and torch.cuda.is_available():
        # transformers builds its device mesh on the accelerator it detects, whatever the device.
        raise ValueError(f"tensor_parallel_size={tp} on CPU needs a machine where no GPU is visible "
                         f"(transformers puts the device mesh on the GPU it finds); use device='cuda', "
                         f"or hide the GPUs with CUDA_VISIBLE_DEVICES=")
    return split


def worker_env(device_type: str) -> dict[str, str]:
    """Environment additions of a rank's process: NVLink multicast off; on CPU no GPU visible (the
    check above refuses CPU ranks next to GPUs, the env keeps a worker from finding one)."""
    env = dict(NCCL_ENV)
    if device_type == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


# ---- the process group and the messages of rank 0 ----------------------------------------------

class TensorParallelGroup:
    """This process's place in the tensor-parallel group: its rank, the device group the model's
    collectives run on (the default group), and a gloo group for rank 0's messages.

    Rank 0 calls :meth:`send` before each step or start-up call; the other ranks :meth:`recv` and
    run the same. ``on_failure`` (rank 0) stops the workers when a call fails half way: the other
    ranks may wait in a collective that will never complete."""

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.cpu_group = dist.new_group(backend="gloo", timeout=TIMEOUT)
        self.on_failure = None  # rank 0: callable(exc) -> exception to raise
        self.failed: BaseException | None = None

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def send(self, message: tuple) -> None:
        if self.failed is not None:
            first = str(self.failed).splitlines()[0] if str(self.failed) else type(self.failed).__name__
            raise TensorParallelError(f"this engine's tensor-parallel ranks have stopped ({first}); "
                                      f"start a new engine") from self.failed
        dist.broadcast_object_list([message], src=0, group=self.cpu_group)

    def recv(self) -> tuple:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def share_tokens(self, tokens: torch.Tensor) -> None:
        """Rank 0: the step's sampled token ids to every rank (device group, no host sync)."""
        dist.broadcast(tokens, src=0)

    def receive_tokens(self, n: int) -> torch.Tensor:
        tokens = torch.empty(n, dtype=torch.int64, device=self.device)
        dist.broadcast(tokens, src=0)
        return tokens

    def min(self, value: int) -> int:
        """The smallest of every rank's value (every rank calls it)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def mean(self, values: list[float]) -> list[float]:
        """The mean over ranks of each value, the same on every rank (every rank calls it)."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.cpu_group)
        return (t / self.world_size).tolist()

    @contextlib.contextmanager
    def collective(self):
        """Rank 0: a call every rank takes part in; if it fails, the workers are stopped and the
        error re-raised (with a worker's traceback when a worker failed first)."""
        try:
            yield
        except BaseException as exc:
            if self.failed is None:
                self.failed = exc
            if self.on_failure is None or isinstance(exc, TensorParallelError):
                raise
            self.failed = self.on_failure(exc)
            raise self.failed from exc


def init_process_group(rank: int, world_size: int, store: dist.Store,
                       device: torch.device) -> TensorParallelGroup:
    """Join the group (rank 0 in the engine's process, the others in workers): NCCL on CUDA, gloo
    on CPU; rank r uses cuda:r."""
    os.environ.update(NCCL_ENV)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=TIMEOUT,
                            device_id=device if device.type == "cuda" else None)
    return TensorParallelGroup(rank, world_size, device)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
