"""Data-parallel fine-tuning on ``torch.distributed``: DDP, or FSDP2 (``fully_shard``).

Launched by ``torchrun`` (which sets RANK, WORLD_SIZE, MASTER_ADDR ...), every rank runs the same
program; ``init_distributed`` joins the group, ``shard`` wraps the model, and ``chunked_loss``
called with the wrapped model on a rank's rows (``rank_rows``) returns the global batch's loss
and leaves its gradient in ``.grad``: all-reduced whole under DDP, reduce-scattered into each
rank's shard under FSDP2, where each rank keeps 1/N of the parameters, gradients and optimizer
state and gathers one layer's parameters at a time to compute.

    torchrun --nproc-per-node 2 -m kvcache finetune --shard fsdp ...

Timeouts: every collective (the group's set-up included) fails after ``timeout`` seconds instead
of waiting forever for a rank that died; torchrun also stops the other ranks when one exits with
an error, and reports that rank's error.
"""

from __future__ import annotations

import datetime
import inspect
import os

import torch
import torch.distributed as dist

from .step import ChunkStep

SHARDINGS = ("ddp", "fsdp")
DEFAULT_TIMEOUT_S = 600.0


def init_distributed(device: torch.device | str = "cpu", timeout: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the process group torchrun describes in the environment (gloo on CPU, nccl on CUDA);
    return (rank, world size). Raises RuntimeError when not launched by torchrun (or another
    launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)."""
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"sharded training runs one process per rank under torchrun, but {', '.join(missing)} "
            "is not set: launch with torchrun --nproc-per-node N -m kvcache finetune ... --shard ddp|fsdp"
        )
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    device = torch.device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        except (RuntimeError, OSError) as e:  # DistStoreError (a timeout) is a RuntimeError
            raise RuntimeError(
                f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} could not join the process group at "
                f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within {timeout:g} s ({e}); are all the "
                "ranks started (torchrun --nproc-per-node, --nnodes), and is the address reachable?"
            ) from None
    return dist.get_rank(), dist.get_world_size()


def leave_distributed(finished: bool) -> None:
    """Leave the process group joined by ``init_distributed`` (a no-op when none is). With
    ``finished`` (every rank got through its work), wait for the other ranks first: gloo aborts a
    process whose peers tear down their connections while its own are still open, so ranks that
    leave at different moments can crash after the work is done. After an error the ranks are
    not all coming, so leave without waiting."""
    if not dist.is_initialized():
        return
    if finished:
        dist.barrier()
    dist.destroy_process_group()


def shard(model: torch.nn.Module, how: str) -> torch.nn.Module:
    """``model`` (a ``kvcache.Transformer``, or a peft model of one) wrapped for data parallelism
    over the initialised process group: ``"ddp"`` (each rank holds everything, gradients
    all-reduced) or ``"fsdp"`` (FSDP2: each decoder block, and the rest of the model, sharded
    over the ranks). Pass the result to ``chunked_loss`` and give its ``parameters()`` to the
    optimizer. Every rank must start from the same weights (load the same checkpoint, seed
    alike)."""
    if how not in SHARDINGS:
        raise ValueError(f"shard takes one of {', '.join(SHARDINGS)}, got {how!r}")
    if not dist.is_initialized():
        raise RuntimeError("no process group: call kvcache.train.shard.init_distributed() (under torchrun) first")
    step = ChunkStep(model)
    if how == "ddp":
        # The only buffers are the rotary frequencies, equal on every rank: syncing them before
        # every forward would cost a collective per chunk. (Newer torch releases renamed the flag.)
        ddp = torch.nn.parallel.DistributedDataParallel
        renamed = "forward_sync_buffers" in inspect.signature(ddp).parameters
        return ddp(step, **{"forward_sync_buffers" if renamed else "broadcast_buffers": False})
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # The mesh is on the model's device type. fully_shard's default mesh is on CUDA whenever CUDA
    # is available, which would move a CPU model (gloo ranks) there and give rank N device N.
    device = next(step.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    step.transformer.lay_out_head(hidden_major=False)  # FSDP2 shards row-major parameters only
    for block in step.transformer.layers:
        fully_shard(block, mesh=mesh)
    # The root holds the embeddings, the final norm and the output head, which every chunk uses.
    fully_shard(step, mesh=mesh)
    return step


def unwrap(sharded: torch.nn.Module) -> torch.nn.Module:
    """The model ``shard`` was given (its parameters sharded, under FSDP2)."""
    step = getattr(sharded, "module", sharded)
    if not isinstance(step, ChunkStep):
        raise ValueError(f"expected a model wrapped by kvcache.train.shard.shard, got {type(sharded).__name__}")
    return step.model


def rank_rows(rows: torch.Tensor | list, rank: int, world: int) -> torch.Tensor | list:
    """This rank's rows of a global batch ``rows`` (B, ...) or list of B ragged rows: contiguous,
    as even as they divide (the first B % world ranks get one more row). Raises ValueError when
    some rank would get none."""
    if len(rows) < world:
        raise ValueError(
            f"a global batch of {len(rows)} rows cannot be split over {world} ranks: every rank needs at "
            f"least one row; use --batch-size of at least {world}"
        )
    if isinstance(rows, (list, tuple)):
        size, extra = divmod(len(rows), world)
        start = rank * size + min(rank, extra)
        return list(rows[start : start + size + (rank < extra)])
    return torch.tensor_split(rows, world)[rank]


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the model ``shard`` was given (pass it, or what ``shard`` returned), with
    whole tensors on the CPU. A collective under FSDP2: every rank must call it, and every rank
    gets the result."""
    from torch.distributed.tensor import DTensor

    step = getattr(model, "module", model)
    state = {}
    for name, tensor in (step.model if isinstance(step, ChunkStep) else model).state_dict().items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        state[name] = tensor.detach().cpu()
    return state


def grad_norm(params: list[torch.Tensor], clip: float) -> float:
    """Clip the gradients of ``params`` (sharded or not) to a global norm of ``clip``; returns the
    norm before clipping. Under FSDP2 the norm is over the whole gradient (all ranks)."""
    norm = torch.nn.utils.clip_grad_norm_(params, clip)
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)
