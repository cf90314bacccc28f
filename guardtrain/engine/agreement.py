"""Rank agreement: how the processes of one run decide together (H7).

The engine asks three questions, always at the same batch on every rank:
whether a flag holds on every rank, whether it holds on any rank, and what
every rank's list of re-arms is. Adapters answer them through the strategy
they already have (Lightning's, Fabric's) or through ``torch.distributed``;
a single process answers them alone.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

__all__ = ["RankAgreement", "ReduceAgreement", "SingleProcess", "TorchDistributed"]


class RankAgreement(Protocol):
    """What the engine needs from a multi-process run."""

    world_size: int
    rank: int

    def all(self, flag: bool) -> bool:
        """``flag`` on every rank (a collective: every rank calls it at the same point)."""
        ...

    def any(self, flag: bool) -> bool:
        """``flag`` on any rank (a collective)."""
        ...

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (a collective)."""
        ...


class SingleProcess:
    """One process: every answer is this process's own."""

    world_size = 1
    rank = 0

    def all(self, flag: bool) -> bool:
        return flag

    def any(self, flag: bool) -> bool:
        return flag

    def gather(self, value: Any) -> list[Any]:
        return [value]


class TorchDistributed:
    """The default ``torch.distributed`` group (or ``group``), which must be initialised."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def _reduce(self, flag: bool, op: Any) -> bool:
        import torch

        backend = self._dist.get_backend(self._group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        value = torch.tensor(int(flag), device=device)
        self._dist.all_reduce(value, op=op, group=self._group)
        return bool(value.item())

    def all(self, flag: bool) -> bool:
        return self._reduce(flag, self._dist.ReduceOp.MIN)

    def any(self, flag: bool) -> bool:
        return self._reduce(flag, self._dist.ReduceOp.MAX)

    def gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, value, group=self._group)
        return out

    @classmethod
    def if_initialized(cls) -> RankAgreement:
        """This class when a default group with several ranks exists, else :class:`SingleProcess`."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return cls()
        return SingleProcess()


class ReduceAgreement:
    """Through a strategy's ``reduce_boolean_decision(flag, all=...)`` (Lightning, Fabric).

    Args:
        reduce: the strategy's ``reduce_boolean_decision``.
        world_size: the number of ranks.
        rank: this process's global rank.
        gather: ``all_gather_object``-like; defaults to ``torch.distributed``'s
            default group when it is initialised.
    """

    def __init__(
        self,
        reduce: Callable[..., bool],
        world_size: int,
        rank: int,
        gather: Callable[[Any], list[Any]] | None = None,
    ) -> None:
        self._reduce = reduce
        self._gather = gather
        self.world_size = world_size
        self.rank = rank

    def all(self, flag: bool) -> bool:
        return bool(self._reduce(flag, all=True))

    def any(self, flag: bool) -> bool:
        return bool(self._reduce(flag, all=False))

    def gather(self, value: Any) -> list[Any]:
        if self._gather is not None:
            return self._gather(value)
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return [value]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out
