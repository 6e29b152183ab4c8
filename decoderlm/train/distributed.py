"""Running the same training command on several processes with torchrun (PyTorch's own launcher).

One machine, N processes (gloo on CPU, nccl on CUDA; one GPU per process):

    torchrun --nproc_per_node=N -m decoderlm train --data DATA_DIR --out runs/x ...

Several machines: run the same line on every node, naming one node's address as the meeting point
(the rendezvous); training starts when all nodes have joined:

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST0:29500 \\
        --rdzv_id=myrun -m decoderlm train --data DATA_DIR --out runs/x ...

A node that never joins makes torchrun give up after its rendezvous timeout (`--rdzv_conf
join_timeout=SECONDS`, default 600). A process that dies makes torchrun stop the others and report which
rank failed; a process that hangs makes the others fail after `--dist-timeout` seconds. Either way
the run folder keeps its last checkpoint, and `--resume` continues from it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from decoderlm.errors import DecoderLMError


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Whether this process writes files and prints (rank 0)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def setup(device: str, timeout_s: int) -> World:
    """Join torchrun's process group if launched by torchrun with more than one process."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    world = World(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0")))
    if device.startswith("mps"):
        raise DecoderLMError("torchrun with --device mps is not supported; use --device cpu or cuda")
    if device.startswith("cuda:"):
        raise DecoderLMError(f"--device {device}: under torchrun each process takes the GPU of its LOCAL_RANK; use --device cuda")
    if device == "cuda":
        torch.cuda.set_device(world.local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
    return world


def device_for(device: str, world: World) -> torch.device:
    return torch.device("cuda", world.local_rank) if device == "cuda" and world.distributed else torch.device(device)


def all_sum(values: list[float], world: World) -> list[float]:
    """Sum each value over all processes (unchanged in one process)."""
    if not world.distributed:
        return values
    t = torch.tensor(values, dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t)
    return t.tolist()


def all_gather(value: object, world: World) -> list[object]:
    """Every process's `value`, in rank order."""
    if not world.distributed:
        return [value]
    gathered: list[object] = [None] * world.size
    dist.all_gather_object(gathered, value)
    return gathered


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def teardown(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()
