"""Server training on several processes or GPUs (``sfl-coord serve --server-workers N``).

One coordinator process carries about 400 agent-steps a second (``bench/coordinator_load.py``).
Past that, the round's split agents are sharded over N server workers (ranks of one
``torch.distributed`` process group: NCCL on GPUs, gloo on CPU):

- rank 0, the *leader*, is the coordinator: registration, selection, planning, assignments,
  aggregation, checkpoints. It also trains its own shard, and scores a block of the
  validation set between rounds, as every worker does (:mod:`coordinator.shard_scoring`).
- ranks 1..N-1 subscribe only to their agents' upward topics. Each decodes its agents'
  activations, runs the server portion on their rows and answers with the gradients.
- Every step, each rank scales its parameter gradients by its share of the step's rows and
  all-reduces them. This is DDP's algorithm, done by hand: DDP's module wrapper does not fit
  a forward where rows join at different blocks. Every rank then takes the same optimiser
  step, so the server model stays one model. The merged batch is still the union of all
  rows, and two workers train the model one worker trains, to float tolerance.
  BatchNorm is the exception: it normalises each rank's rows with that rank's own batch
  statistics, as DDP without SyncBatchNorm does.
- The leader broadcasts the round's plan and the model at the start of each round, so a
  resumed run and the aggregated model reach every rank. At the end of the round it gathers
  the workers' per-agent counters (bytes, messages, times).

A rank that dies breaks the process group: the others stop with an error, like a coordinator
crash, and ``--resume`` continues from the last checkpoint.

This module holds the process-group plumbing. The engine (:mod:`coordinator.engine`) decides
what to send and when.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import msgpack
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from sfl_core.config.run import RunConfig

__all__ = ["ServerShards", "cannot_share", "workers_hold_validation", "shard_agents", "worker_user", "launch_workers", "from_env", "GradReducer", "WorkerLost"]


class WorkerLost(ConnectionError):
    """Another rank of the process group stopped (crashed, killed, its machine gone)."""


def _collective(fn, *args, **kwargs):
    """One torch.distributed call; a peer that went away (gloo: "Connection closed by peer",
    NCCL: a DistBackendError) becomes :class:`WorkerLost`, one line for the operator."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:   # DistError is a RuntimeError; gloo raises plain ones
        text = " ".join(str(exc).split())
        raise WorkerLost(f"a server worker stopped ({text[:200]}); restart the run with --resume") from None

_RANK_ENV = "RANK"
_WORLD_ENV = "WORLD_SIZE"


def cannot_share(server_mode: str, has_broker: bool) -> str | None:
    """Why a run cannot have several server workers, or None. Checked before any rank starts."""
    if not has_broker:
        return "server workers need --broker: every one connects to the same broker"
    if server_mode == "sequential":
        return ("server workers cannot share server_mode: sequential (SplitFed v2 trains on one agent after "
                "another); use merged or per_agent")
    return None


def workers_hold_validation(cfg: "RunConfig") -> bool:
    """Whether the workers other than the leader hold the server's validation set, as the
    leader does: for the robust screens of their own agents' rows, and to score a block of it
    between rounds (:mod:`coordinator.shard_scoring`). Not where the run standardises inputs
    with statistics the leader agrees with the fleet (``task.normalize: federated``): a worker
    never learns them, and rows scaled otherwise than the agents' would set every honest row
    apart; the leader then scores alone."""
    return not (cfg.task is not None and cfg.task.normalize == "federated")


def worker_user(user: str, rank: int) -> str:
    """The broker user of server worker ``rank`` > 0. Each rank needs its own: a broker that
    takes the user name as the client id (``sfl-coord broker-config`` for Mosquitto) would
    otherwise let the ranks' connections knock each other off. It uses the coordinator's
    password (``broker-config --server-workers N`` creates these users)."""
    return f"{user}-w{rank}"


def shard_agents(agents: Iterable[str], world: int) -> dict[str, int]:
    """Agent -> rank, round-robin over the sorted ids: every rank derives the same map."""
    return {a: i % world for i, a in enumerate(sorted(agents))}


@dataclass
class ServerShards:
    """This process's place in the group of server workers."""

    rank: int
    world: int
    device: torch.device

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------- messages between ranks
    # msgpack in uint8 tensors, never pickle (torch.distributed's *_object calls pickle)
    def broadcast(self, doc: Any = None) -> Any:
        """The leader's ``doc`` on every rank."""
        data = msgpack.packb(doc, use_bin_type=True) if self.leader else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self._comm)
        _collective(dist.broadcast, size, 0)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.leader
               else torch.empty(int(size.item()), dtype=torch.uint8))
        buf = buf.to(self._comm)
        _collective(dist.broadcast, buf, 0)
        return doc if self.leader else msgpack.unpackb(buf.cpu().numpy().tobytes(), raw=False)

    def gather(self, doc: Any) -> list[Any]:
        """Every rank's ``doc`` at the leader (in rank order); ``[]`` elsewhere."""
        data = msgpack.packb(doc, use_bin_type=True)
        size = torch.tensor([len(data)], dtype=torch.int64, device=self._comm)
        sizes = [torch.zeros_like(size) for _ in range(self.world)]
        _collective(dist.all_gather, sizes, size)
        longest = int(max(s.item() for s in sizes))
        buf = torch.zeros(longest, dtype=torch.uint8)
        if data:
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.zeros(longest, dtype=torch.uint8, device=self._comm) for _ in range(self.world)]
        _collective(dist.all_gather, bufs, buf.to(self._comm))
        if not self.leader:
            return []
        return [msgpack.unpackb(b[:int(s.item())].cpu().numpy().tobytes(), raw=False) for b, s in zip(bufs, sizes)]

    def broadcast_model(self, model: torch.nn.Module) -> None:
        """The leader's parameters and buffers on every rank (after aggregation, after resume)."""
        for t in model.state_dict().values():
            if self.world > 1:
                data = t.detach().to(self._comm)
                _collective(dist.broadcast, data, 0)
                if not self.leader:
                    t.copy_(data.to(t.device))

    def send_to_leader(self, t: torch.Tensor) -> None:
        """``t`` to the leader, which takes it with :meth:`receive` (a tensor travels as itself,
        not through msgpack: the rows of a score are megabytes)."""
        _collective(dist.send, t.detach().contiguous().to(self._comm), 0)

    def receive(self, src: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """At the leader, the tensor rank ``src`` sends with :meth:`send_to_leader`, of ``shape``
        and ``dtype`` (which the ranks agreed on first)."""
        buf = torch.empty(tuple(shape), dtype=dtype, device=self._comm)
        _collective(dist.recv, buf, src)
        return buf

    def barrier(self) -> None:
        _collective(dist.barrier)

    def close(self) -> None:
        """Leave the group after a finished run: every rank reaches the barrier before any tears
        its connections down, then the group is destroyed while the interpreter is whole (a
        gloo group left to interpreter shutdown can abort the process)."""
        if dist.is_initialized():
            self.barrier()
            dist.destroy_process_group()

    @property
    def _comm(self) -> torch.device:
        """Where collectives run: NCCL needs CUDA tensors, gloo takes CPU ones."""
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


class GradReducer:
    """The per-step all-reduce that keeps one server model across ranks (see the module docstring)."""

    def __init__(self, shards: ServerShards):
        self.shards = shards

    def rows(self, n_local: int) -> int:
        t = torch.tensor([float(n_local)], dtype=torch.float64, device=self.shards._comm)
        _collective(dist.all_reduce, t)
        return int(t.item())

    def sync(self, params: Sequence[torch.nn.Parameter], buffers: Sequence[torch.Tensor], n_local: int,
             n_total: int) -> None:
        """Make every rank's gradients the gradient of the mean loss over all ranks' rows; average
        BatchNorm's running statistics by rows. A parameter keeps ``grad is None`` only where no
        rank has a gradient for it (SGD skips it then, as it would in one process)."""
        comm = self.shards._comm
        share = n_local / n_total if n_total else 0.0
        flat = torch.cat([(p.grad.detach() * share if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params]).to(comm) if params else torch.zeros(0, device=comm)
        has = torch.tensor([float(p.grad is not None) for p in params], device=comm)
        _collective(dist.all_reduce, flat)
        _collective(dist.all_reduce, has, op=dist.ReduceOp.MAX)
        pos = 0
        for p, h in zip(params, has.tolist()):
            n = p.numel()
            p.grad = flat[pos:pos + n].view_as(p).to(p.device) if h else None
            pos += n
        for b in buffers:
            if b.is_floating_point():
                v = (b.detach() * share).to(comm)
                _collective(dist.all_reduce, v)
                b.copy_(v.to(b.device))
            else:
                v = b.detach().to(comm)
                _collective(dist.all_reduce, v, op=dist.ReduceOp.MAX)
                b.copy_(v.to(b.device))

    def mean(self, value: float, n_local: int, n_total: int) -> float:
        """A per-row mean over all ranks from each rank's mean over its own rows."""
        t = torch.tensor([value * n_local], dtype=torch.float64, device=self.shards._comm)
        _collective(dist.all_reduce, t)
        return float(t.item()) / max(n_total, 1)


# ------------------------------------------------------------------ process group set-up
def from_env(device: torch.device, timeout_s: float = 1800.0) -> ServerShards | None:
    """Join the process group that ``launch_workers`` (or ``torchrun``) described in the
    environment; ``None`` for a single-process coordinator. ``timeout_s`` bounds every
    collective: the leader may spend the registration timeout between two of them."""
    world = int(os.environ.get(_WORLD_ENV, "1"))
    if world <= 1:
        return None
    rank = int(os.environ[_RANK_ENV])
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return ServerShards(rank, world, device)


def launch_workers(n: int, argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[subprocess.Popen]:
    """Start ranks 1..n-1 as copies of this ``sfl-coord serve`` command, and describe the group
    to this process (rank 0) through the environment, as ``torchrun`` would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = dict(env if env is not None else os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                WORLD_SIZE=str(n))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n), RANK="0", LOCAL_RANK="0")
    return [subprocess.Popen([sys.executable, "-m", "cli.coord", *argv],
                             env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(1, n)]
