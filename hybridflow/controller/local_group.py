"""torchrun (multi-controller) mode: every rank runs the driver loop and is one worker itself.

    torchrun --nproc_per_node=2 examples/train_ppo.py ...     # trainer.launcher=torchrun

The RL dataflow is unchanged: the trainer calls a group's methods as it does under Ray, and this
group runs them in-process with the same dispatch modes, then exchanges the results so that every
rank's driver holds exactly what the Ray driver would:
- ONE_TO_ALL: every rank runs it; the per-rank results are all-gathered (the list Ray returns);
- DP_COMPUTE: every rank builds the same global batch (same data, same seeds), runs the method on
  ITS chunk only (the same split and padding as under Ray), and the chunks' results are
  all-gathered and concatenated: driver-side stages (rewards, advantages) then run on every rank
  on identical data, with no broadcast;
- RANK_ZERO: every rank runs it (these are collectives); rank 0's result is broadcast.
Worker code, the hybrid engine and checkpoints are the same (so a run can resume in either mode);
files the driver writes (config, metrics, trainer state, the latest-step file) are written by rank 0.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch.distributed as dist

from hybridflow.controller.decorator import LAYOUT_ATTR, Dispatch, collect_results, dispatch_args
from hybridflow.controller.worker import colocated_worker_cls, registered_methods
from hybridflow.parallel.process_group import init_torchrun  # noqa: F401  (re-exported: trainer/placement.py)


class _Done:
    """A finished call (the same `.result()` as a Ray `Pending`)."""

    def __init__(self, value: Any):
        self.value = value

    def result(self, timeout_s: float | None = None, waiting_for: str = "", key: str = "") -> Any:
        """The value: the call ran in this process when it was made, so there is nothing to wait for."""
        return self.value


class _Pool:
    def __init__(self, name: str, world_size: int):
        self.name, self.world_size = name, world_size


class LocalColocatedGroup:
    """The roles of one pool in THIS process (rank `dist.get_rank()` of `dist.get_world_size()`);
    the same surface as `ColocatedWorkerGroup` (methods `<role>__<method>`, `role(name)`, `submit`)."""

    def __init__(self, roles: dict[str, tuple[type, dict]], name: str = "global_pool"):

        self.role_classes = {role: cls for role, (cls, _) in roles.items()}
        self.worker_cls = colocated_worker_cls(self.role_classes)
        self.worker = self.worker_cls(role_kwargs={role: kw for role, (_, kw) in roles.items()})
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.pool = _Pool(name, self.world_size)
        self._layouts: dict[str, list | None] = {}
        for method in registered_methods(self.worker_cls):
            call = functools.partial(self._call, method)
            call.pool_name = name  # the DataFlow scheduler reads it
            setattr(self, method, call)

    def _layout(self, method: str) -> list | None:
        if method not in self._layouts:
            if getattr(getattr(self.worker_cls, method), LAYOUT_ATTR, None) is None:
                self._layouts[method] = None
            else:
                layouts: list = [None] * self.world_size
                dist.all_gather_object(layouts, self.worker._group_layout(method))
                self._layouts[method] = layouts
        return self._layouts[method]

    def submit(self, method: str, *args, **kwargs) -> _Done:
        mode = registered_methods(self.worker_cls)[method]
        layout = self._layout(method)
        rank_args, rank_kwargs, pad = dispatch_args(mode, self.world_size, args, kwargs, layout)
        mine = getattr(self.worker, method)(*rank_args[self.rank], **rank_kwargs[self.rank])
        if mode is Dispatch.RANK_ZERO:
            box = [mine]
            dist.broadcast_object_list(box, src=0)
            return _Done(box[0])
        results: list = [None] * self.world_size
        dist.all_gather_object(results, mine)
        return _Done(collect_results(mode, results, pad, layout))

    def _call(self, method: str, *args, **kwargs) -> Any:
        return self.submit(method, *args, **kwargs).result()

    def role(self, name: str):
        from hybridflow.controller.worker_group import RoleView

        return RoleView(self, name, self.role_classes[name])

    def pids(self) -> list[int]:
        pids: list = [None] * self.world_size
        dist.all_gather_object(pids, os.getpid())
        return pids

    def shutdown(self) -> None:
        """The process group belongs to the program (torchrun): `dist.destroy_process_group()` at its end."""
